"""``python -m workloads.cli.spectral_probe``: the spectral-probe run (ablation, or seeds) on this device."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace

import torch

from kernels.feature_cache import FeatureCache
from workloads import spectral_probe as workload
from workloads.common import markdown
from workloads.spectral_probe import (
    SD15_SHAPES,
    SHAPES,
    Config,
    ablation,
    accuracy_claim,
    compare_seeds,
    format_rows,
    optimized_method,
    reference_method,
    run,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.spectral_probe", description=workload.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--layers", type=int, default=None, help="16, or 128 with --shapes sd15")
    parser.add_argument("--dim", type=int, default=256, help="the square layers' width")
    parser.add_argument("--shapes", choices=SHAPES, default="square", help="sd15: SD 1.5's 128 attention shapes")
    parser.add_argument("--max-epochs", type=int, default=60)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ablation", action="store_true", help="every row, not only reference/optimized")
    parser.add_argument("--seeds", type=int, default=0, help="compare test accuracy over this many seeds")
    args = parser.parse_args(argv)
    try:
        layers = args.layers if args.layers is not None else len(SD15_SHAPES) if args.shapes == "sd15" else 16
        cfg = Config(samples=args.samples, layers=layers, dim=args.dim, max_epochs=args.max_epochs,
                     device=args.device, shapes=args.shapes)
    except ValueError as e:
        parser.error(str(e))
    shape = "SD 1.5's shapes" if cfg.shapes == "sd15" else f"{cfg.dim}x{cfg.dim}"
    print(f"Spectral probe: {cfg.samples} samples x {cfg.layers} layers of {shape} (rank "
          f"{cfg.rank}), {cfg.classes} classes, on {cfg.device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    if args.seeds > 0:
        pairs = compare_seeds(cfg, args.seeds)
        cells = [[str(i), f"{r:.1%}", f"{o:.1%}"] for i, (r, o) in enumerate(pairs)]
        print("\n".join(markdown(["seed", "reference", "optimized"], cells)))
        print(accuracy_claim(pairs))
        return 0
    with tempfile.TemporaryDirectory() as cache_dir:
        if args.ablation:
            rows = ablation(cfg, cache_dir)
        else:
            opt = optimized_method(cfg, FeatureCache(cache_dir))
            rows = [run(m, cfg) for m in (reference_method(), opt, replace(opt, name=opt.name + ", cached"))]
    print("\n".join(format_rows(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
