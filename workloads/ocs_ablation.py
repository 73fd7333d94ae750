"""The OCS workload's ablation: reference / vmap / einsum / ghost Gram / ghost +
AMP, each a full run of ``workloads.ocs`` measured in one process on one device; all
rows step the same SGD (kernels.sgd's), and the rows after the reference share the engine and differ in
how the scores are computed (``python -m workloads.cli.ocs --ablation``)."""

from __future__ import annotations

from collections.abc import Callable

from kernels.coreset import ocs_scores
from kernels.per_sample import per_sample_grads
from kernels.training import Recipe
from reference.coreset import literal_scores
from workloads.common import amp_recipe, markdown, mib, progress, vmap_grads
from workloads.ocs import REFERENCE, Config, OCSReport, Scorer, optimized, run
from workloads.rotated_digits import Split


def _materialized(grads_fn: Callable) -> Scorer:
    return lambda m, loss_fn, x, y, *, memory, tau: literal_scores(m, loss_fn, x, y, memory, tau, grads_fn)


def ablation(cfg: Config, tasks: list[tuple[Split, Split]]) -> list[OCSReport]:
    """reference / vmap / einsum / ghost Gram / ghost + AMP, in one process on one device. The
    rows after the reference share the engine and fused SGD and differ in the scores."""

    amp = amp_recipe(cfg.device)
    methods = [REFERENCE, optimized(Recipe(), _materialized(vmap_grads), "vmap (materialized E)"),
               optimized(Recipe(), _materialized(per_sample_grads), "einsum (materialized E)"),
               optimized(Recipe(), ocs_scores, "ghost Gram"),
               optimized(amp, ocs_scores, f"ghost Gram + AMP ({amp.name})")]
    return [run(m, cfg, tasks) for m in progress(methods, desc="ablation", unit="run")]


HEADER = ["run", "s/task", "speedup", "peak MiB", "avg accuracy", "forgetting", "per-task accuracy at the end"]


def table(rows: list[OCSReport]) -> list[list[str]]:
    """The cells of ``HEADER``, one list per run."""
    base = sum(rows[0].seconds) / len(rows[0].seconds)
    cells = []
    for r in rows:
        per = sum(r.seconds) / len(r.seconds)
        cells.append([r.name, f"{per:.2f}", f"{base / per:.2f}x", mib(r.peak_mib), f"{r.average_accuracy:.1%}",
                      f"{r.forgetting:.1%}", " ".join(f"{a:.0%}" for a in r.accuracy[-1])])
    return cells


def format_rows(rows: list[OCSReport]) -> list[str]:
    return markdown(HEADER, table(rows))
