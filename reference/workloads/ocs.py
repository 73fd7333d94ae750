"""Reference run of the OCS workload: loop-materialized scores, fp32, per-parameter Python SGD,
the plain loop."""

from __future__ import annotations

import reference
import reference.training
from kernels.workloads.ocs import Config, OCSReport, Split, run


def run_reference(cfg: Config, tasks: list[tuple[Split, Split]]) -> OCSReport:
    return run("reference (loop, fp32)", cfg, tasks, reference.ocs_scores, reference.training.train, reference.sgd)
