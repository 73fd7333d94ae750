"""``python -m workloads.cli.cifar_resnet``: the ResNet-on-CIFAR ablation table on this device."""

from __future__ import annotations

import argparse

from workloads import cifar_resnet as workload
from workloads.cifar_resnet import HEADER, Config, ablation, format_rows, table
from workloads.cli.options import add_common, describe, leaves_out_amp, parse_args, save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.cifar_resnet",
                                     description=workload.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    add_common(parser, amp_rows=True, accuracy=True)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = parse_args(parser, argv)
    if args.steps < 1 or args.batch < 2 or args.batch % 2:
        parser.error("--steps must be >= 1 and --batch an even number >= 2 (the OneCycleLR row splits each "
                     "batch into 2 micro-batches)")
    try:
        cfg = Config(steps=args.steps, batch=args.batch, device=args.device, eval_images=args.eval_images)
    except ValueError as e:
        parser.error(str(e))
    print(f"ResNet10 on synthetic CIFAR, {cfg.steps} steps of batch {cfg.batch} on "
          f"{describe(cfg.device)}")
    rows = ablation(cfg, compile_=not args.no_compile, emulated_bf16=not leaves_out_amp(args, cfg.device))
    print("\n".join(format_rows(rows)))
    save(args, "cifar_resnet", HEADER, table(rows), cfg, "ms/step",
         {"training loss per step": {r.name: r.losses for r in rows}}, metric_column="accuracy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
