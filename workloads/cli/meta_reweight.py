"""``python -m workloads.cli.meta_reweight``: Meta-Weight-Net accuracy and memory tables on this device."""

from __future__ import annotations

import argparse
from dataclasses import replace

from workloads import meta_reweight as workload
from workloads.cli.options import add_common, describe, leaves_out_amp, parse_args, save
from workloads.common import markdown, mib
from workloads.meta_reweight import Config, class_counts, optimized_recipe
from workloads.meta_reweight_ablation import accuracy_runs, memory_ablation

ACCURACY = ["run", "ms / outer step", "balanced test accuracy"]
MEMORY = ["run", "peak MiB", "saved vs baseline", "ms / outer step"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.meta_reweight", description=workload.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="outer steps of the accuracy runs")
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--max-per-class", type=int, default=490)
    parser.add_argument("--memory-steps", type=int, default=5, help="timed outer steps per memory-table row")
    add_common(parser, amp_rows=True)
    args = parse_args(parser, argv)
    if args.memory_steps < 1:
        parser.error(f"--memory-steps must be >= 1, got {args.memory_steps}")
    try:
        cfg = Config(steps=args.steps, max_per_class=args.max_per_class, device=args.device,
                     accumulation=args.accumulation)
        recipe = optimized_recipe(cfg)
    except ValueError as e:
        parser.error(str(e))
    print(f"Meta-Weight-Net: train {sum(class_counts(cfg))} long-tailed (n_c {class_counts(cfg)}), meta "
          f"{10 * cfg.meta_per_class}, test {10 * cfg.test_per_class}, batch {cfg.batch}, on "
          f"{describe(cfg.device)}")
    if cfg.norm == "batch" and cfg.accumulation > 1:  # the two sides then compute different functions
        micro = cfg.batch // cfg.accumulation
        print(f"note: the optimized runs' BatchNorm normalizes each micro-batch of {micro} "
              f"(accumulation {cfg.accumulation}), the reference's the batch of {cfg.batch}: their accuracies "
              "differ by that too, not by arithmetic alone")
    rows = accuracy_runs(cfg, recipe)
    accuracy = [[r.name, f"{r.ms_per_step:.1f}", f"{r.balanced_accuracy:.1%}"] for r in rows]
    print("\n".join(markdown(ACCURACY, accuracy)))
    print()
    mem = memory_ablation(cfg, steps=args.memory_steps, emulated_bf16=not leaves_out_amp(args, cfg.device))
    base = mem[1].peak_mib
    memory = [[r.name, mib(r.peak_mib), "-" if not (base and r.peak_mib) else f"{1 - r.peak_mib / base:.1%}",
               f"{r.ms_per_step:.1f}"] for r in mem]
    print("\n".join(markdown(MEMORY, memory)))
    save(args, "meta_reweight_accuracy", ACCURACY, accuracy, cfg, "ms / outer step",
         metric_column="balanced test accuracy")
    # the memory table's own config: its rows ran --memory-steps steps each, not --steps
    save(args, "meta_reweight_memory", MEMORY, memory, replace(cfg, steps=args.memory_steps), "peak MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
