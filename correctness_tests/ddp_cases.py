"""Data-parallel training cases, each run two ways: under torchrun on 2 CPU processes
(ddp_worker.py, each rank on its half of every global batch) and in one process on the whole
global batches (test_distributed.py). fp32: the two must end with equal parameters to rounding.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from kernels.distributed import DataParallel, shard
from kernels.models import MLP
from kernels.training import Recipe, TrainResult, train
from workloads import meta_reweight as mw

GLOBAL_BATCH = 16
# A small Meta-Weight-Net problem: GroupNorm, so each rank's shard computes what the whole batch
# does (BatchNorm statistics are per rank, and SyncBatchNorm has no CPU kernel).
MWN = mw.Config(max_per_class=40, imbalance=10.0, meta_per_class=4, test_per_class=2, batch=GLOBAL_BATCH,
                meta_batch=GLOBAL_BATCH, steps=2, norm="group", widths=(8, 8, 16, 16), lr=0.05)


def _data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=gen), torch.randint(0, 5, (n,), generator=gen)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP((12, 32, 5))


class AllReduces:
    """How many gradient all-reduce rounds (over bucket 0) DDP made: the state of ``counted``."""

    rounds = 0


# unannotated: DDP checks a hook's annotations as objects, and this module's are strings
def counted(state, bucket):  # noqa: ANN001, ANN201
    """A DDP communication hook: torch's all-reduce, counted in ``state``."""
    state.rounds += bucket.index() == 0
    return allreduce_hook(None, bucket)


def _local(batches: list[tuple[Tensor, Tensor]], dp: DataParallel | None) -> list[tuple[Tensor, Tensor]]:
    return batches if dp is None else [(shard(x), shard(y)) for x, y in batches]


def _prepare(model: nn.Module, dp: DataParallel | None) -> tuple[nn.Module, AllReduces]:
    counter = AllReduces()
    if dp is None:
        return model, counter
    wrapped = dp.wrap(model)
    wrapped.register_comm_hook(counter, counted)
    return wrapped, counter


def case_sgd(dp: DataParallel | None) -> tuple[nn.Module, TrainResult, int]:
    """Momentum SGD, 4 steps of one global batch each."""
    model, counter = _prepare(_mlp(), dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(4 * GLOBAL_BATCH, seed=1)
    batches = list(zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH), strict=True))
    return model, train(model, F.cross_entropy, opt, _local(batches, dp)), counter.rounds


def case_accumulation(dp: DataParallel | None) -> tuple[nn.Module, TrainResult, int]:
    """Accumulation 2 over 5 micro-batches: windows of 2, 2 and a trailing 1 (3 optimizer steps)."""
    model, counter = _prepare(_mlp(), dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data(5 * GLOBAL_BATCH, seed=2)
    batches = list(zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH), strict=True))
    return model, train(model, F.cross_entropy, opt, _local(batches, dp), Recipe(accumulation=2)), counter.rounds


def case_sampler(dp: DataParallel | None) -> tuple[nn.Module, TrainResult, int]:
    """A DataLoader over a DistributedSampler (shuffled, 2 epochs): each rank's batch of 8 is its
    stride of the global permutation, whose consecutive 16 one process reads."""
    model, counter = _prepare(_mlp(), dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(*_data(3 * GLOBAL_BATCH, seed=3))
    if dp is None:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
        loader = DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)
    else:
        sampler = dp.sampler(data, shuffle=True, seed=7)
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp.world_size, sampler=sampler)
    losses = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        losses += train(model, F.cross_entropy, opt, loader).losses
    return model, TrainResult(losses, len(losses), 0, 0.0), counter.rounds


def case_hypergradient(dp: DataParallel | None) -> tuple[nn.Module, TrainResult, int]:
    """Two Meta-Weight-Net outer steps with accumulation 2: the engine's inner step, then W's Adam
    step on the DARTS hypergradient; returns the classifier and W as one module."""
    cfg = replace(MWN)
    ln = mw.learner(cfg, recipe=Recipe(accumulation=2))
    ln.model, counter = _prepare(ln.model, dp)
    train_set, meta_set, _ = mw.datasets(cfg)
    data, meta = mw.batches(train_set, cfg.batch, cfg.seed + 1), mw.batches(meta_set, cfg.meta_batch, cfg.seed + 2)
    for _ in range(cfg.steps):
        mw.outer_step(ln, next(data), next(meta), cfg)
    both = nn.ModuleDict({"classifier": ln.model.module if dp else ln.model, "weight_net": ln.weight_net})
    return both, TrainResult([], cfg.steps, 0, 0.0), counter.rounds


def case_uneven(dp: DataParallel | None) -> tuple[nn.Module, TrainResult, int]:
    """Accumulation 2 over micro-batches of 16, 16, 16 and 8 (a loader's short last batch): each
    weighs by its samples, on every rank alike."""
    model, counter = _prepare(_mlp(), dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(7 * GLOBAL_BATCH // 2, seed=4)
    batches = list(zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH), strict=True))
    return model, train(model, F.cross_entropy, opt, _local(batches, dp), Recipe(accumulation=2)), counter.rounds


class TemperedCE(nn.Module):
    """Cross-entropy at a learned temperature: a loss module with a parameter of its own, which
    DDP (wrapping the model alone) does not all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.zeros(()))

    def forward(self, out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out * self.log_t.exp(), y)


class RankZeroTemperedCE(TemperedCE):
    """TemperedCE whose temperature only rank 0's batch reaches: rank 1's backward leaves its
    gradient None (as a class-conditional term would for a rank whose batch lacks the class)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, out: Tensor, y: Tensor) -> Tensor:
        return super().forward(out, y) if self.rank == 0 else F.cross_entropy(out, y)


def case_loss_module(dp: DataParallel | None) -> tuple[nn.Module, TrainResult, int]:
    """The optimizer trains the loss module's temperature too, accumulation 2 over 4 micro-batches:
    its gradient is averaged over the ranks at every step (each rank stepped its own before)."""
    model, counter = _prepare(_mlp(), dp)
    loss = TemperedCE()
    opt = torch.optim.SGD([*model.parameters(), *loss.parameters()], lr=0.1)
    x, y = _data(4 * GLOBAL_BATCH, seed=5)
    batches = list(zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH), strict=True))
    result = train(model, loss, opt, _local(batches, dp), Recipe(accumulation=2))
    both = nn.ModuleDict({"classifier": model.module if dp else model, "loss": loss})
    return both, result, counter.rounds


CASES = {"sgd": case_sgd, "accumulation": case_accumulation, "uneven": case_uneven, "sampler": case_sampler,
         "hypergradient": case_hypergradient, "loss_module": case_loss_module}
# DDP's gradient all-reduce rounds in each case: one per optimizer step, none more; the trailing
# window of "accumulation" (1 micro-batch) is all-reduced by the engine itself, not by DDP's hook
ALL_REDUCES = {"sgd": 4, "accumulation": 2, "uneven": 2, "sampler": 6, "hypergradient": 2, "loss_module": 2}
