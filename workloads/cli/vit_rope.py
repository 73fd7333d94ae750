"""``python -m workloads.cli.vit_rope``: the RoPE ViT run (or its ablation) on this device."""

from __future__ import annotations

import argparse
from dataclasses import replace

from kernels.models import RopeViT
from kernels.training import Recipe, checkpoint_settings
from workloads import vit_rope as workload
from workloads.cli.options import add_common, check_checkpoint, describe, leaves_out_amp, parse_args, save
from workloads.common import progress
from workloads.vit_rope import (
    HEADER,
    Config,
    ablation,
    format_rows,
    optimized_method,
    reference_method,
    run,
    run_settings,
    table,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.vit_rope", description=workload.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--depth", type=int, default=6)
    add_common(parser, amp_rows=True, accuracy=True)
    parser.add_argument("--cifar", metavar="PATH",
                        help="a folder with CIFAR-10's binary version (cifar-10-batches-bin/), not synthetic")
    parser.add_argument("--ablation", action="store_true", help="every row, not only reference/optimized")
    parser.add_argument("--no-compile", action="store_true", help="skip the ablation's torch.compile rows")
    parser.add_argument("--checkpoint", metavar="PATH", help="save the optimized run's state here (atomically)")
    parser.add_argument("--save-every", type=int, default=10, metavar="K", help="steps between saves (10)")
    parser.add_argument("--resume", action="store_true", help="continue the optimized run from --checkpoint")
    clip = parser.add_mutually_exclusive_group()
    clip.add_argument("--max-grad-norm", type=float, default=1.0, help="clip gradients to this global norm (1.0)")
    clip.add_argument("--no-clip", action="store_true", help="no gradient clipping")
    args = parse_args(parser, argv)
    if args.ablation and (args.checkpoint or args.resume):
        parser.error("--checkpoint and --resume apply to the optimized run, not to --ablation")
    try:
        cfg = Config(steps=args.steps, batch=args.batch, accumulation=args.accumulation, depth=args.depth,
                     device=args.device, cifar=args.cifar, eval_images=args.eval_images,
                     max_grad_norm=None if args.no_clip else args.max_grad_norm, checkpoint=args.checkpoint,
                     save_every=args.save_every, resume=args.resume)
    except ValueError as e:
        parser.error(str(e))
    # the checkpoint's path (and, resuming, its file) now: a bad one would fail after the reference run
    resumed_model = RopeViT(cfg.dim, cfg.heads, cfg.depth) if cfg.resume else None
    check_checkpoint(parser, cfg.checkpoint, cfg.resume, cfg.steps + cfg.warmup_steps, resumed_model)
    recipe = None
    if cfg.resume:  # the recipe the run was saved under, not one Recipe.auto picks again; the rest must match
        saved = checkpoint_settings(cfg.checkpoint) or {}
        named = saved.get("recipe")
        recipe = Recipe.from_name(named, accumulation=saved["accumulation"]) if named else None
        differ = sorted(k for k, v in run_settings(cfg, recipe).items() if saved.get(k) != v)
        if differ or not saved:
            parser.error(f"--checkpoint {cfg.checkpoint} was saved by a run with other settings ("
                         + ("none saved" if not saved else ", ".join(f"--{k.replace('_', '-')} {saved.get(k)}"
                                                                    for k in differ))
                         + "): resume with the run's own settings, or start afresh with a new file")
    data = f"CIFAR-10 from {cfg.cifar}" if cfg.cifar else "synthetic CIFAR"
    clipped = f"clipped at {cfg.max_grad_norm:g}" if cfg.max_grad_norm else "no clipping"
    print(f"RoPE ViT (D {cfg.dim}, {cfg.heads} heads, depth {cfg.depth}) on {data}, {cfg.steps} steps "
          f"of batch {cfg.batch} ({clipped}) on {describe(cfg.device)}")
    plain = replace(cfg, checkpoint=None, resume=False)  # the reference run is never checkpointed
    if args.ablation:
        rows = ablation(cfg, compile_=not args.no_compile, emulated_bf16=not leaves_out_amp(args, cfg.device))
    else:
        rows = [run(m, c) for m, c in progress([(reference_method(), plain), (optimized_method(cfg, recipe), cfg)],
                                                desc="runs", unit="run")]
    print("\n".join(format_rows(rows)))
    save(args, "vit_rope", HEADER, table(rows), cfg, "ms/step",
         # a resumed run's losses at their own steps (None before its first)
         {"training loss per step": {r.name: [None] * (r.first_step - 1) + r.losses for r in rows}},
         metric_column="accuracy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
