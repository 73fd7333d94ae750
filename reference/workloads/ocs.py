"""Reference run of the OCS workload: scores from the loop-materialized E with the original's
literal formulas, fp32, the plain loop (reference.training.train).

It steps torch's fused SGD, the arithmetic ``kernels.sgd`` picks for the MLP's dense fp32
parameters, so the two runs differ only in how samples are chosen and in the loop, whose fp32
arithmetic is the same: "the same samples at every step" then tests the scores (a per-parameter
Python SGD drifts apart by rounding until a top-k tie flips). The SGD is a negligible part of a step.
"""

from __future__ import annotations

import functools

import torch

from reference.coreset import ocs_scores as scores
from reference.training import train

optimizer = functools.partial(torch.optim.SGD, fused=True)

NAME = "reference (loop scores, fp32)"
__all__ = ["NAME", "optimizer", "scores", "train"]
