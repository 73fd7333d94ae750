"""Reference run of the OCS workload: scores from the loop-materialized E with the original's
literal formulas, fp32, the plain loop (reference.training.train).

It steps the same SGD as the optimized run (``kernels.sgd``), so the two runs differ only in how
samples are chosen and in the loop, whose fp32 arithmetic is the same: "the same samples at every
step" then tests the scores (a per-parameter Python SGD drifts apart by rounding until a top-k
tie flips; docs/measurements/from-the-code.md). The SGD is a negligible part of a step.
"""

from __future__ import annotations

from kernels.optim import sgd as optimizer
from reference.coreset import ocs_scores as scores
from reference.training import train

NAME = "reference (loop scores, fp32)"
__all__ = ["NAME", "optimizer", "scores", "train"]
