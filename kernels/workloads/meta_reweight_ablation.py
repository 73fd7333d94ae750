"""The Meta-Weight-Net workload's command line: balanced-test accuracy with and without
reweighting for the reference and the optimized run, then Betty's memory table (baseline / + AMP
/ + accumulation / both), peak memory of one outer step (CUDA: max_memory_allocated; CPU: the
perf gate's resident-set high-water mark) and time per outer step, every row in one process.
``python -m kernels.workloads.meta_reweight --help``."""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from kernels.training import Recipe
from kernels.workloads.common import markdown, mib
from kernels.workloads.meta_reweight import (
    Config,
    RunReport,
    amp_recipe,
    class_counts,
    learner,
    optimized_recipe,
    outer_step,
    run,
)


def memory_ablation(cfg: Config, accumulation: int = 4, steps: int = 5) -> list[RunReport]:
    """Betty's memory table, each row ``steps`` timed outer steps after 2 warm-up steps."""
    from reference.workloads.meta_reweight import reference_learner, reference_step

    cfg = replace(cfg, steps=steps)
    rows = [("reference (fp32, exact hypergradient)", reference_step, reference_learner(cfg)),
            ("baseline (fp32, DARTS kernel)", outer_step, learner(cfg)),
            ("+ AMP", outer_step, learner(cfg, recipe=amp_recipe(cfg.device))),
            (f"+ accumulation {accumulation}", outer_step, learner(cfg, recipe=Recipe(accumulation=accumulation))),
            (f"+ AMP + accumulation {accumulation}", outer_step,
             learner(cfg, recipe=amp_recipe(cfg.device, accumulation)))]
    return [run(name, step, ln, cfg, warmup=2, measure_peak=True) for name, step, ln in rows]


def accuracy_runs(cfg: Config, recipe: Recipe) -> list[RunReport]:
    """Balanced-test accuracy after ``cfg.steps`` outer steps, with and without reweighting."""
    from reference.workloads.meta_reweight import reference_learner, reference_step

    return [run(f"{side}, {'reweighted' if rw else 'plain CE'}", step, make(), cfg, rw)
            for side, step, make in (("reference", reference_step, lambda: reference_learner(cfg)),
                                     (f"optimized ({recipe.name}, accumulation {recipe.accumulation})",
                                      outer_step, lambda: learner(cfg, recipe=recipe)))
            for rw in (True, False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.workloads.meta_reweight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="outer steps of the accuracy runs")
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--max-per-class", type=int, default=490)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        cfg = Config(steps=args.steps, max_per_class=args.max_per_class, device=args.device)
        recipe = optimized_recipe(cfg, args.accumulation)
    except ValueError as e:
        parser.error(str(e))
    print(f"Meta-Weight-Net: train {sum(class_counts(cfg))} long-tailed (n_c {class_counts(cfg)}), meta "
          f"{10 * cfg.meta_per_class}, test {10 * cfg.test_per_class}, batch {cfg.batch}, on {cfg.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = accuracy_runs(cfg, recipe)
    print("\n".join(markdown(["run", "ms / outer step", "balanced test accuracy"],
                             [[r.name, f"{r.ms_per_step:.1f}", f"{r.balanced_accuracy:.1%}"] for r in rows])))
    print()
    mem = memory_ablation(cfg, args.accumulation)
    base = mem[1].peak_mib
    print("\n".join(markdown(["run", "peak MiB", "saved vs baseline", "ms / outer step"],
                             [[r.name, mib(r.peak_mib), "-" if not (base and r.peak_mib) else
                               f"{1 - r.peak_mib / base:.1%}", f"{r.ms_per_step:.1f}"] for r in mem])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
