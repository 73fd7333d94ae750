"""The OCS workload's command line and ablation: reference / vmap / einsum / ghost Gram / ghost +
AMP, each a full run of ``kernels.workloads.ocs`` measured in one process on one device; all
rows step the same fused SGD, and the rows after the reference share the engine and differ in
how the scores are computed. ``python -m kernels.workloads.ocs --help``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor, nn

from kernels.coreset import ocs_scores
from kernels.per_sample import per_sample_grads
from kernels.training import Recipe
from kernels.workloads import ocs
from kernels.workloads.common import markdown, mib
from kernels.workloads.ocs import Config, OCSReport, Scorer, optimized, optimized_recipe, run
from kernels.workloads.rotated_digits import Split, digits, mnist, rotated_tasks


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
    from reference.workloads.ocs import REFERENCE  # kernels imports reference only to run it

    amp = Recipe(torch.float16, grad_scaler=True) if cfg.device.startswith("cuda") else Recipe(torch.bfloat16)
    methods = [REFERENCE, optimized(Recipe(), _materialized(_vmap_grads), "vmap (materialized E)"),
               optimized(Recipe(), _materialized(per_sample_grads), "einsum (materialized E)"),
               optimized(Recipe(), ocs_scores, "ghost Gram"),
               optimized(amp, ocs_scores, f"ghost Gram + AMP ({amp.name})")]
    return [run(m, cfg, tasks) for m in methods]


def format_rows(rows: list[OCSReport]) -> list[str]:
    base = sum(rows[0].seconds) / len(rows[0].seconds)
    cells = []
    for r in rows:
        per = sum(r.seconds) / len(r.seconds)
        cells.append([r.name, f"{per:.2f}", f"{base / per:.2f}x", mib(r.peak_mib), f"{r.average_accuracy:.1%}",
                      f"{r.forgetting:.1%}", " ".join(f"{a:.0%}" for a in r.accuracy[-1])])
    return markdown(["run", "s/task", "speedup", "peak MiB", "avg accuracy", "forgetting",
                     "per-task accuracy at the end"], cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.workloads.ocs", description=ocs.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=3, help="3: smoke; 20: the original's full run")
    parser.add_argument("--passes", type=int, default=10, help="passes over each task's images")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mnist", metavar="PATH", help="local MNIST (torchvision layout) instead of digits")
    parser.add_argument("--ablation", action="store_true", help="all five rows, not only reference/optimized")
    args = parser.parse_args(argv)
    try:
        cfg = Config(tasks=args.tasks, passes=args.passes, device=args.device)
    except ValueError as e:
        parser.error(str(e))
    data = mnist(args.mnist) if args.mnist else digits(cfg.seed)
    tasks = rotated_tasks(data, cfg.tasks, cfg.degrees, cfg.device)
    print(f"OCS, rotated {'MNIST' if args.mnist else 'digits'}, {cfg.tasks} tasks x {cfg.passes} passes "
          f"({-(-len(tasks[0][0][1]) // cfg.stream)} stream batches of up to {cfg.stream}) on {cfg.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    from reference.workloads.ocs import REFERENCE

    if args.ablation:
        rows = ablation(cfg, tasks)
    else:
        rows = [run(m, cfg, tasks) for m in (REFERENCE, optimized(optimized_recipe(cfg, tasks)))]
    print("\n".join(format_rows(rows)))
    same = all(torch.equal(a, b) for a, b in zip(rows[0].selected, rows[-1].selected, strict=True))
    apart = (rows[0].params - rows[-1].params).abs().max().item()
    print(f"reference and {rows[-1].name} selected the same samples at every step: {same}; "
          f"final parameters differ by at most {apart:.3g}")
    return 0
