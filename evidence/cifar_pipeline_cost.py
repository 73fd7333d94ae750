"""What reproducibility and the input pipeline cost the CIFAR ResNet step, interleaved.

    python -m evidence.cifar_pipeline_cost [--rounds 3] [--steps 30] [--batch 128]
                                                     [--threads N] [--workers 0 2]

Each round runs, one after another, the CIFAR ablation's rows "auto" (preloaded tensors),
"auto, deterministic" and "auto + DataLoader" with each of ``--workers`` (workloads/cifar_resnet.py),
so every row meets the host's state of each round; prints each round's ms/step and each row's
median ratio over "auto" across rounds. ``--threads``: torch's threads (default: torch's), e.g.
1 thread and 1 worker on a 2-core host leaves the worker a core of its own.
"""

from __future__ import annotations

import argparse
from statistics import median

import torch
import torch.nn.functional as F

from kernels.models import ResNet10
from kernels.training import Recipe
from workloads.cifar_resnet import Config, run
from workloads.cli.options import describe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(steps=args.steps, batch=args.batch)
    x, y = cfg.batches()[0]
    auto = Recipe.auto(cfg.device, model=ResNet10(), loss_fn=F.cross_entropy, batch=(x, y))
    rows = {"auto": {}, "auto, deterministic": {"reproducible": True},
            **{f"auto + DataLoader, {w} workers": {"workers": w} for w in args.workers}}
    print(f"{args.steps} steps of batch {args.batch}, recipe {auto.name}, on {describe(cfg.device)}")
    ms: dict[str, list[float]] = {name: [] for name in rows}
    for i in range(args.rounds):
        for name, kwargs in rows.items():
            ms[name].append(run(cfg, auto, name, **kwargs).ms_per_step)
        print(f"round {i + 1}: " + ", ".join(f"{name} {v[-1]:.1f} ms" for name, v in ms.items()), flush=True)
    for name, v in ms.items():
        ratios = [a / b for a, b in zip(v, ms["auto"], strict=True)]
        print(f"{name}: median {median(v):.1f} ms/step, {median(ratios):.2f}x auto's time "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
