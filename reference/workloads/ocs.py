"""Reference run of the OCS workload: scores from the loop-materialized E with the original's
literal formulas, fp32, the plain loop (reference.training.train).

It steps the same SGD as the optimized run (``kernels.sgd``), so the two runs differ only in how
samples are chosen and in the loop, whose fp32 arithmetic is the same: "the same samples at every
step" then tests the scores. Measured (20 tasks x 10 passes, 2800 steps): identical selections
and bit-identical parameters to the end. With the per-parameter Python SGD instead, parameters
drift apart by rounding (~1e-6 after 10 tasks) until a top-k boundary tie flips one sample at
step 1406 of task 11, and the runs part from there. The SGD is under 1% of a step here (0.27M
parameters against ~70 ms of scoring).
"""

from __future__ import annotations

from kernels.optim import sgd as optimizer
from reference.coreset import ocs_scores as scores
from reference.training import train

NAME = "reference (loop scores, fp32)"
__all__ = ["NAME", "optimizer", "scores", "train"]
