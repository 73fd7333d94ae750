"""Models shared by kernels, references, tests and workloads."""

from kernels.models.mlp import MLP

__all__ = ["MLP"]
