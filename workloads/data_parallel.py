"""The ResNet-on-CIFAR and Meta-Weight-Net workloads data parallel: time per step and peak
memory per process, 1 process against N (``python -m workloads.cli.data_parallel``).

Every rank builds the same model and the same global batches, trains on its 1/N of each
(kernels.distributed), and times ``steps`` steps after 2 warm-up steps (workloads.common's
median_step_ms; Meta-Weight-Net through its own meta_reweight.run, the memory table's); then one
more step is measured for the peak memory it adds in this process (perfgate.timing.peak_memory). One process
runs the plain loop (no DDP wrapper), as a user on one device would. Rank 0 gathers the ranks'
medians and peaks (one all-reduce, MAX).

On one CPU host the N processes share its cores (torchrun gives each 1 thread where one process
uses them all): the rows measure DDP's overhead and the per-process memory, not a speedup; the
speedup is for N devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
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
from workloads.common import median_step_ms, mib

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


def run_name(row: Row) -> str:
    """A run's label in the PNG: its workload and process count (the table's first column, the
    workload, is the same for every process count)."""
    return f"{row.workload}, {row.processes} process{'es' if row.processes > 1 else ''}"


WARMUP = 2  # untimed steps before the timed ones
# each workload's config, built by its measure and, for its refusals, before any process is launched
CONFIGS = {"cifar_resnet": lambda batch, steps, device: cifar_resnet.Config(steps=steps + 1, batch=batch,
                                                                           warmup=WARMUP, device=device),
           "meta_reweight": lambda batch, steps, device: meta_reweight.Config(batch=batch, meta_batch=batch,
                                                                             steps=steps, device=device)}


def _cifar(batch: int, steps: int, device: str, dp: DataParallel | None) -> tuple[float, int | None]:
    """(median ms, peak bytes) of the optimized CIFAR loop (fp32, fused AdamW), each step on this
    rank's share of global batch i; the peak of one more step."""
    cfg = CONFIGS["cifar_resnet"](batch, steps, device)
    torch.manual_seed(cfg.seed)
    model = ResNet10().to(device)
    opt = adamw(model.parameters(), lr=2e-3, weight_decay=1e-4)
    if dp is not None:
        model = dp.wrap(model)
    local = [(x, y) if dp is None else (shard(x), shard(y)) for x, y in cfg.batches()]
    calls = (partial(train, model, F.cross_entropy, opt, [b], device=device) for b in local[:-1])
    ms = median_step_ms(calls, WARMUP, device)
    return ms, peak_memory(lambda: train(model, F.cross_entropy, opt, local[-1:], device=device), device)


def _meta_reweight(batch: int, steps: int, device: str, dp: DataParallel | None) -> tuple[float, int | None]:
    """(median ms, peak bytes) of the Meta-Weight-Net outer step (fp32, DARTS kernel): the memory
    table's baseline row (meta_reweight.run), each rank on its share of the global batches."""
    cfg = CONFIGS["meta_reweight"](batch, steps, device)
    ln = meta_reweight.learner(cfg)
    if dp is not None:
        ln.model = dp.wrap(ln.model)
    report = meta_reweight.run("data parallel", meta_reweight.outer_step, ln, cfg, warmup=WARMUP,
                               measure_peak=True)
    return report.ms_per_step, None if report.peak_mib is None else report.peak_mib * 2**20


MEASURES = {"cifar_resnet": _cifar, "meta_reweight": _meta_reweight}


def measure(workload: str, batch: int, steps: int, device: str, dp: DataParallel | None) -> Row:
    """This rank's median step and peak, gathered to the row every rank returns."""
    if workload not in MEASURES:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    world = 1 if dp is None else dp.world_size
    device = device if dp is None else str(dp.device)  # each rank on its own GPU, cuda:LOCAL_RANK
    if batch < world or batch % world:
        raise ValueError(f"the global batch {batch} must be a multiple of the {world} processes")
    ms, peak = MEASURES[workload](batch, steps, device, dp)
    mine = torch.tensor([ms, -1.0 if peak is None else peak / 2**20], dtype=torch.float64)
    if dp is not None:
        mine = mine.to(dp.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's time, the largest rank's peak
    ms, peak_mib = mine.tolist()
    return Row(workload, world, torch.get_num_threads(), batch, ms, None if peak_mib < 0 else peak_mib)
