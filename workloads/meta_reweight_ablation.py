"""The Meta-Weight-Net workload's ablation: balanced-test accuracy with and without
reweighting for the reference and the optimized run, then Betty's memory table (baseline / + AMP
/ + accumulation / both; the AMP rows where bf16 runs in hardware, or with --emulated-bf16), peak
memory of one outer step (CUDA: max_memory_allocated; CPU: the perf gate's resident-set
high-water mark) and time per outer step, every row in one process
(``python -m workloads.cli.meta_reweight``)."""

from __future__ import annotations

from dataclasses import replace

from kernels.training import Recipe
from reference.workloads.meta_reweight import reference_step
from workloads.common import amp_recipe, bf16_emulated, progress
from workloads.meta_reweight import (
    Config,
    RunReport,
    learner,
    outer_step,
    reference_learner,
    run,
)


def memory_ablation(cfg: Config, accumulation: int | None = None, steps: int = 5,
                    emulated_bf16: bool = False) -> list[RunReport]:
    """Betty's memory table, each row ``steps`` timed outer steps after 2 warm-up steps, the
    accumulation rows at ``accumulation`` micro-batches (default ``cfg.accumulation``). Where bf16
    is emulated (a CPU without bf16 instructions) the two AMP rows are left out, unless
    ``emulated_bf16``."""
    accumulation = cfg.accumulation if accumulation is None else accumulation
    cfg = replace(cfg, steps=steps)
    amp = emulated_bf16 or not bf16_emulated(cfg.device)
    rows = [("reference (fp32, exact hypergradient)", reference_step, reference_learner(cfg)),
            ("baseline (fp32, DARTS kernel)", outer_step, learner(cfg))]
    if amp:
        rows.append(("+ AMP", outer_step, learner(cfg, recipe=amp_recipe(cfg.device))))
    accumulated = learner(cfg, recipe=Recipe(accumulation=accumulation))
    rows.append((f"+ accumulation {accumulation}", outer_step, accumulated))
    if amp:
        rows.append((f"+ AMP + accumulation {accumulation}", outer_step,
                     learner(cfg, recipe=amp_recipe(cfg.device, accumulation))))
    return [run(name, step, ln, cfg, warmup=2, measure_peak=True)
            for name, step, ln in progress(rows, desc="memory table", unit="run")]


def accuracy_runs(cfg: Config, recipe: Recipe) -> list[RunReport]:
    """Balanced-test accuracy after ``cfg.steps`` outer steps, with and without reweighting."""
    sides = (("reference", reference_step, lambda: reference_learner(cfg)),
             (f"optimized ({recipe.name}, accumulation {recipe.accumulation})", outer_step,
              lambda: learner(cfg, recipe=recipe)))
    runs = [(side, step, make, rw) for side, step, make in sides for rw in (True, False)]
    return [run(f"{side}, {'reweighted' if rw else 'plain CE'}", step, make(), cfg, rw)
            for side, step, make, rw in progress(runs, desc="accuracy runs", unit="run")]
