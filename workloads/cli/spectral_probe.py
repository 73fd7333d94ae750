"""``python -m workloads.cli.spectral_probe``: the spectral-probe run (ablation, or seeds) on this device.

Features are kept between runs in ``--cache-dir`` (default ``$XDG_CACHE_HOME/kernelgate/spectral_probe``,
else ``~/.cache/kernelgate/spectral_probe``): the first run computes them, a later run with the same
data and code reads them back. ``--ablation`` measures computing and reading back in a fresh
temporary folder, so its rows never read an earlier run's features.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from kernels.feature_cache import FeatureCache
from workloads import spectral_probe as workload
from workloads.cli.options import add_common, describe, parse_args, save
from workloads.common import markdown
from workloads.spectral_probe import (
    HEADER,
    SD15_SHAPES,
    SHAPES,
    Config,
    ablation,
    accuracy_claim,
    compare_seeds,
    format_rows,
    layer_indices,
    optimized_method,
    reference_method,
    run,
    table,
)

QUICK = {"samples": 100, "max_epochs": 10, "sample_layers": 0.25}  # --quick's settings, unless given


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernelgate" / "spectral_probe"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.spectral_probe", description=workload.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=None, help="weight sets (400; 100 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="16, or 128 with --shapes sd15")
    parser.add_argument("--sample-layers", type=float, default=None, metavar="FRACTION",
                        help="use a seeded fraction of the layers (1.0; 0.25 with --quick)")
    parser.add_argument("--dim", type=int, default=256, help="the square layers' width")
    parser.add_argument("--shapes", choices=SHAPES, default="square", help="sd15: SD 1.5's 128 attention shapes")
    parser.add_argument("--max-epochs", type=int, default=None, help="60 (10 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: --samples 100 --max-epochs 10 --sample-layers 0.25 unless given")
    parser.add_argument("--no-amp", action="store_true",
                        help="the optimized run in fp32 (default: Recipe.auto, AMP where it measures faster)")
    parser.add_argument("--num-workers", type=int, default=0,
                        help="DataLoader workers generating the layers' weights while features are computed (0)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                       help=f"keep features here between runs (default {default_cache_dir()})")
    cache.add_argument("--no-cache", action="store_true", help="compute the features, keep nothing")
    parser.add_argument("--ablation", action="store_true", help="every row, not only reference/optimized")
    parser.add_argument("--seeds", type=int, default=0, help="compare test accuracy over this many seeds")
    add_common(parser)
    args = parse_args(parser, argv)
    if args.ablation and (args.cache_dir or args.no_cache):
        parser.error("--ablation computes and reads back features in its own temporary folder; "
                     "--cache-dir and --no-cache apply to the plain run")
    if args.seeds < 0:
        parser.error(f"--seeds must be >= 0, got {args.seeds}")
    if args.seeds and (args.cache_dir or args.no_cache or args.output_dir):
        parser.error("--seeds computes every seed's features afresh and prints its table; --cache-dir, "
                     "--no-cache and --output-dir apply to the plain run and --ablation")
    given = {"samples": args.samples, "max_epochs": args.max_epochs, "sample_layers": args.sample_layers}
    sizes = {k: v for k, v in given.items() if v is not None}
    try:
        layers = args.layers if args.layers is not None else len(SD15_SHAPES) if args.shapes == "sd15" else 16
        cfg = Config(layers=layers, dim=args.dim, device=args.device, shapes=args.shapes,
                     num_workers=args.num_workers, **({**QUICK, **sizes} if args.quick else sizes))
        store = None if args.no_cache or args.ablation or args.seeds else FeatureCache(
            args.cache_dir or default_cache_dir())
    except (ValueError, OSError) as e:
        parser.error(str(e))
    amp = not args.no_amp
    shape = "SD 1.5's shapes" if cfg.shapes == "sd15" else f"{cfg.dim}x{cfg.dim}"
    print(f"Spectral probe: {cfg.samples} samples x {len(layer_indices(cfg))} of {cfg.layers} layers of {shape} "
          f"(rank {cfg.rank}), {cfg.classes} classes, on {describe(cfg.device)}")
    if args.seeds > 0:
        pairs = compare_seeds(cfg, args.seeds, amp)
        cells = [[str(i), f"{r:.1%}", f"{o:.1%}"] for i, (r, o) in enumerate(pairs)]
        print("\n".join(markdown(["seed", "reference", "optimized"], cells)))
        print(accuracy_claim(pairs))
        return 0
    if args.ablation:
        with tempfile.TemporaryDirectory() as cache_dir:
            rows = ablation(cfg, cache_dir, amp)
    else:
        print(f"features cache: {store.directory}" if store else "features cache: none (--no-cache)")
        opt = optimized_method(cfg, store, amp)
        again = [replace(opt, name=opt.name + ", again")] if store else []
        rows = [run(m, cfg) for m in (reference_method(), opt, *again)]
    print("\n".join(format_rows(rows)))
    save(args, "spectral_probe", HEADER, table(rows), cfg, ["features s", "train s"],
         {"validation loss per epoch": {r.name: r.val_loss for r in rows},
          "validation accuracy per epoch": {r.name: r.val_accuracy for r in rows}}, metric_column="test accuracy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
