"""The OCS workload's ablation: reference / vmap / einsum / ghost Gram / ghost + AMP, each a full
run of ``kernels.workloads.ocs`` measured in one process on one device; the rows after the
reference share the engine and fused SGD and differ in how the scores are computed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from kernels.coreset import ocs_scores
from kernels.per_sample import per_sample_grads
from kernels.training import Recipe
from kernels.workloads.ocs import Config, OCSReport, Scorer, optimized, run
from kernels.workloads.rotated_digits import Split


def _materialized(grads_fn: Callable) -> Scorer:
    from reference.coreset import literal_scores

    return lambda m, loss_fn, x, y, *, memory, tau: literal_scores(m, loss_fn, x, y, memory, tau, grads_fn)


def _vmap_grads(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    from kernels.per_sample import _vmap_grads as vmap_grads

    return vmap_grads(model, loss_fn, x, y, [n for n, p in model.named_parameters() if p.requires_grad],
                      "error", None)


def ablation(cfg: Config, tasks: list[tuple[Split, Split]]) -> list[OCSReport]:
    """reference / vmap / einsum / ghost Gram / ghost + AMP, in one process on one device. The
    rows after the reference share the engine and fused SGD and differ in the scores."""
    from reference.workloads.ocs import REFERENCE

    amp = Recipe(torch.float16, grad_scaler=True) if cfg.device.startswith("cuda") else Recipe(torch.bfloat16)
    methods = [REFERENCE, optimized(Recipe(), _materialized(_vmap_grads), "vmap (materialized E)"),
               optimized(Recipe(), _materialized(per_sample_grads), "einsum (materialized E)"),
               optimized(Recipe(), ocs_scores, "ghost Gram"),
               optimized(amp, ocs_scores, f"ghost Gram + AMP ({amp.name})")]
    return [run(m, cfg, tasks) for m in methods]


def format_rows(rows: list[OCSReport]) -> list[str]:
    base = sum(rows[0].seconds) / len(rows[0].seconds)
    lines = ["| run | s/task | speedup | peak MiB | avg accuracy | forgetting | per-task accuracy at the end |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        per, peak = sum(r.seconds) / len(r.seconds), "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        lines.append(f"| {r.name} | {per:.2f} | {base / per:.2f}x | {peak} | {r.average_accuracy:.1%} | "
                     f"{r.forgetting:.1%} | {' '.join(f'{a:.0%}' for a in r.accuracy[-1])} |")
    return lines
