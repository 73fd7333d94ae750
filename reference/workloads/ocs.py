"""Reference run of the OCS workload: loop-materialized scores, fp32, per-parameter Python SGD,
the plain loop."""

from __future__ import annotations

import reference
import reference.training
from kernels.workloads.ocs import Method

REFERENCE = Method("reference (loop, fp32)", reference.ocs_scores, reference.training.train, reference.sgd)
