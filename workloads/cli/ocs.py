"""``python -m workloads.cli.ocs``: the OCS run (or its ablation) on this device, reference beside optimized."""

from __future__ import annotations

import argparse

import torch

from workloads import ocs
from workloads.cli.options import add_common, describe, parse_args, save
from workloads.ocs import REFERENCE, Config, optimized, optimized_recipe, run
from workloads.ocs_ablation import HEADER, ablation, format_rows, table
from workloads.rotated_digits import digits, mnist, rotated_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.ocs", description=ocs.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=3, help="3: smoke; 20: the original's full run")
    parser.add_argument("--passes", type=int, default=10, help="passes over each task's images")
    add_common(parser)
    parser.add_argument("--mnist", metavar="PATH", help="local MNIST (torchvision layout) instead of digits")
    parser.add_argument("--ablation", action="store_true", help="all five rows, not only reference/optimized")
    args = parse_args(parser, argv)
    try:
        cfg = Config(tasks=args.tasks, passes=args.passes, device=args.device, mnist=args.mnist)
    except ValueError as e:
        parser.error(str(e))
    try:
        data = mnist(cfg.mnist) if cfg.mnist else digits(cfg.seed)
    except FileNotFoundError as e:
        parser.error(str(e))
    tasks = rotated_tasks(data, cfg.tasks, cfg.degrees, cfg.device)
    print(f"OCS, rotated {'MNIST' if cfg.mnist else 'digits'}, {cfg.tasks} tasks x {cfg.passes} passes "
          f"({-(-len(tasks[0][0][1]) // cfg.stream)} stream batches of up to {cfg.stream}) on "
          f"{describe(cfg.device)}")
    if args.ablation:
        rows = ablation(cfg, tasks)
    else:
        rows = [run(m, cfg, tasks) for m in (REFERENCE, optimized(optimized_recipe(cfg, tasks)))]
    print("\n".join(format_rows(rows)))
    same = all(torch.equal(a, b) for a, b in zip(rows[0].selected, rows[-1].selected, strict=True))
    apart = (rows[0].params - rows[-1].params).abs().max().item()
    print(f"reference and {rows[-1].name} selected the same samples at every step: {same}; "
          f"final parameters differ by at most {apart:.3g}")
    save(args, "ocs", HEADER, table(rows), cfg, "s/task",
         {"average accuracy after each task": {r.name: [sum(a) / len(a) for a in r.accuracy] for r in rows}},
         metric_column="avg accuracy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
