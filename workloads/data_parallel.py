"""The ResNet-on-CIFAR and Meta-Weight-Net workloads data parallel: time per step and peak
memory per process, 1 process against N (``python -m workloads.cli.data_parallel``).

Every rank builds the same model and the same global batches, trains on its 1/N of each
(kernels.distributed), and times ``steps`` steps after 2 warm-up steps; then one more step is
measured for the peak memory it adds in this process (perfgate.timing.peak_memory). One process
runs the plain loop (no DDP wrapper), as a user on one device would. Rank 0 gathers the ranks'
medians and peaks (one all-reduce of a tensor each).

On one CPU host the N processes share its cores (torchrun gives each 1 thread where one process
uses them all): the rows measure DDP's overhead and the per-process memory, not a speedup; the
speedup is for N devices.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.distributed import DataParallel, shard
from kernels.models import ResNet10
from kernels.optim import adamw
from kernels.training import train
from perfgate.timing import peak_memory
from workloads import cifar_resnet, meta_reweight
from workloads.common import mib

WORKLOADS = ("cifar_resnet", "meta_reweight")
DEFAULT_BATCH = {"cifar_resnet": cifar_resnet.Config.batch, "meta_reweight": meta_reweight.Config.batch}
HEADER = ("workload", "processes", "threads/process", "global batch", "batch/process", "runs",
          "ms/step (slowest rank)", "ms/step range", "peak MiB/process (largest)")


@dataclass
class Row:
    """One run: every rank's median step and peak, reduced to the slowest and the largest."""

    workload: str
    processes: int
    threads: int
    global_batch: int
    ms_per_step: float  # the slowest rank's median
    peak_mib: float | None  # the largest rank's peak


def summary(runs: list[Row]) -> list[str]:
    """The table's cells for repeated runs of one workload and process count: the median run's
    time with the range over runs (the host's noise moves a run by 10-30%), the median peak."""
    first, times = runs[0], sorted(r.ms_per_step for r in runs)
    peaks = sorted(r.peak_mib for r in runs if r.peak_mib is not None)
    return [first.workload, str(first.processes), str(first.threads), str(first.global_batch),
            str(first.global_batch // first.processes), str(len(runs)), f"{median(times):.1f}",
            f"{times[0]:.1f}-{times[-1]:.1f}", mib(median(peaks) if peaks else None)]


def _cifar_step(batch: int, steps: int, device: str, dp: DataParallel | None) -> Callable[[int], None]:
    """Step i of the optimized CIFAR loop (fp32, fused AdamW) on this rank's share of global batch i."""
    cfg = cifar_resnet.Config(steps=steps + 3, batch=batch, warmup=0, device=device)
    torch.manual_seed(cfg.seed)
    model = ResNet10().to(device)
    opt = adamw(model.parameters(), lr=2e-3, weight_decay=1e-4)
    if dp is not None:
        model = dp.wrap(model)
    data = cfg.batches()
    local = data if dp is None else [(shard(x), shard(y)) for x, y in data]
    return lambda i: train(model, F.cross_entropy, opt, [local[i]], device=device)


def _meta_reweight_step(batch: int, steps: int, device: str, dp: DataParallel | None) -> Callable[[int], None]:
    """Outer step i of the Meta-Weight-Net workload (fp32, DARTS kernel) on global batch i."""
    cfg = meta_reweight.Config(batch=batch, meta_batch=batch, steps=steps, device=device)
    ln = meta_reweight.learner(cfg)
    if dp is not None:
        ln.model = dp.wrap(ln.model)
    train_set, meta_set, _ = meta_reweight.datasets(cfg)
    data = meta_reweight.batches(train_set, cfg.batch, cfg.seed + 1)
    meta = meta_reweight.batches(meta_set, cfg.meta_batch, cfg.seed + 2)
    return lambda i: meta_reweight.outer_step(ln, next(data), next(meta), cfg)


STEPS = {"cifar_resnet": _cifar_step, "meta_reweight": _meta_reweight_step}


def measure(workload: str, batch: int, steps: int, device: str, dp: DataParallel | None) -> Row:
    """This rank's median step and peak, gathered to the row every rank returns."""
    if workload not in STEPS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    world = 1 if dp is None else dp.world_size
    device = device if dp is None else str(dp.device)  # each rank on its own GPU, cuda:LOCAL_RANK
    if batch < world or batch % world:
        raise ValueError(f"the global batch {batch} must be a multiple of the {world} processes")
    step = STEPS[workload](batch, steps, device, dp)
    times = []
    for i in range(2 + steps):
        t0 = time.perf_counter()
        step(i)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = peak_memory(lambda: step(2 + steps), device)
    mine = torch.tensor([1e3 * median(times), -1.0 if peak is None else peak / 2**20], dtype=torch.float64)
    if dp is not None:
        mine = mine.to(dp.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's time, the largest rank's peak
    ms, peak_mib = mine.tolist()
    return Row(workload, world, torch.get_num_threads(), batch, ms, None if peak_mib < 0 else peak_mib)

