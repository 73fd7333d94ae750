"""Reference run of the OCS workload: scores from the loop-materialized E with the original's
literal formulas, fp32, the plain loop (reference.training.train).

It steps torch's SGD as ``kernels.sgd`` picks it for the MLP's dense fp32 parameters (fused on the
CPU, foreach on CUDA), so the two runs differ only in how samples are chosen and in the loop, whose
fp32 arithmetic is the same: "the same samples at every step" then tests the scores (a per-parameter
Python SGD drifts apart by rounding until a top-k tie flips). The SGD is a negligible part of a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from reference.coreset import ocs_scores as scores
from reference.training import train


def optimizer(params: Iterable[torch.Tensor], **hyper: Any) -> torch.optim.SGD:
    """torch's SGD over ``params`` (tensors on one device): fused on the CPU, foreach on CUDA."""
    params = list(params)
    cuda = bool(params) and params[0].device.type == "cuda"
    return torch.optim.SGD(params, **({"foreach": True} if cuda else {"fused": True}), **hyper)


NAME = "reference (loop scores, fp32)"
__all__ = ["NAME", "optimizer", "scores", "train"]
