"""Models shared by kernels, references, tests and workloads."""

from kernels.models.mlp import MLP
from kernels.models.resnet import ResNet10
from kernels.models.vit import RopeViT

__all__ = ["MLP", "ResNet10", "RopeViT"]
