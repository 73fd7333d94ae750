"""Data-parallel training on torch.distributed: one process per device, launched by torchrun.

    torchrun --nproc-per-node 2 train.py       # gloo on CPU, NCCL on CUDA (one GPU per process)

    with process_group() as dp:                 # joins the group torchrun describes, leaves it at exit
        model = dp.wrap(model)                  # DistributedDataParallel on this rank's device
        loader = DataLoader(data, batch_size=b, sampler=dp.sampler(data, seed=0))
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            train(model, loss_fn, opt, loader, recipe)     # the same call as on one process
            save_checkpoint(path, model, opt, step=...)    # every rank calls it; rank 0 writes

Each rank holds a replica and trains on its own 1/world_size of every global batch; DDP averages
the gradients in the backward pass, so world_size processes at batch b compute what one process
computes at batch world_size * b (to rounding, for a model without BatchNorm: its statistics are
per rank; SyncBatchNorm, ``wrap(sync_batchnorm=True)``, is CUDA-only in torch). The engine
(kernels.training.train) skips DDP's all-reduce on every micro-batch of an accumulation window
but the last (``no_sync``): one gradient all-reduce per optimizer step (a trailing partial
window's gradients are all-reduced by the engine at its end). darts_hypergradient averages v
and its result over the ranks when given a DDP model (kernels/hypergrad.py).

Errors: a rank that raises leaves the group at once and re-raises; torchrun then stops the other
ranks (their collectives fail when the peer's connection closes, or at ``timeout_s``), and exits
non-zero with the failing rank's traceback. No rank waits on a barrier the failed one never reaches.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from kernels import checks

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("gloo", "nccl")


def active() -> bool:
    """A process group of more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def unwrap(model: nn.Module) -> nn.Module:
    """The module a DistributedDataParallel wraps (checkpoints and functional calls use its names)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def shard(t: Tensor) -> Tensor:
    """This rank's rows of a global batch (B, ...): rows rank, rank + W, ... as DistributedSampler
    strides its indices. B must be a multiple of the world size W (uneven shards would weight
    samples unequally and leave ranks at different step counts)."""
    w = world_size()
    if t.ndim == 0 or t.shape[0] % w:
        raise ValueError(f"a global batch must have a first dimension divisible by the world size {w}, got shape "
                         f"{tuple(t.shape)}; use a batch of a multiple of {w}")
    return t[rank()::w]


def all_mean_(tensors: list[Tensor]) -> list[Tensor]:
    """In place: each tensor averaged over the ranks, one all-reduce per dtype over all of them
    flattened together (gloo has no AVG: a sum, then a division)."""
    # checked before the first all-reduce: a refusal halfway would leave some tensors averaged
    bad = [i for i, t in enumerate(tensors) if not (t.is_floating_point() or t.is_complex())
           or (t.requires_grad and t.is_leaf)]
    if bad:
        t = tensors[bad[0]]
        grad = " that requires grad" if t.requires_grad else ""
        raise TypeError(f"tensors[{bad[0]}] is a {t.dtype} tensor{grad}: all_mean_ averages floating or complex "
                        "tensors in place (pass a parameter's .grad or .data, not the parameter)")
    if active() and tensors:
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= world_size()
            parts = flat.split([t.numel() for t in group])
            torch._foreach_copy_(group, [v.view_as(t) for v, t in zip(parts, group, strict=True)])
    return tensors


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the group: its rank, the group's size and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module, *, sync_batchnorm: bool = False) -> DistributedDataParallel:
        """``model`` on this rank's device in DistributedDataParallel (rank 0's parameters
        broadcast to every rank). ``sync_batchnorm``: BatchNorm statistics over the global batch
        (CUDA only, torch's SyncBatchNorm)."""
        checks.module(model, "model")
        checks.flag(sync_batchnorm, "sync_batchnorm")
        if isinstance(model, DistributedDataParallel):
            raise ValueError("model is already wrapped in DistributedDataParallel")
        if sync_batchnorm:
            if self.device.type != "cuda":
                raise ValueError("sync_batchnorm=True needs CUDA (torch's SyncBatchNorm has no CPU kernel); "
                                 "on CPU BatchNorm statistics stay per rank, or use GroupNorm")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def sampler(self, dataset: Dataset, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> DistributedSampler:
        """This rank's share of ``dataset`` each epoch (call ``set_epoch`` before each); without
        ``drop_last`` the last samples repeat so every rank gets as many batches."""
        checks.flag(shuffle, "shuffle")
        checks.flag(drop_last, "drop_last")
        seed = checks.integer(seed, "seed", low=0)  # a Python int: the sampler seeds a Generator with it
        return DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                  seed=seed, drop_last=drop_last)


def agree(ok: bool) -> bool:
    """Whether every rank's ``ok`` is true (one all-reduce): ranks that must fail together, e.g.
    when rank 0 alone wrote a file and could not."""
    if not active():
        return ok
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(ok)], device=on)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextmanager
def process_group(device: str | None = None, *, backend: str | None = None,
                  timeout_s: float = 300.0) -> Iterator[DataParallel]:
    """Join the process group torchrun describes in the environment, yield this rank's
    ``DataParallel``, and leave the group at exit (after a barrier when the block succeeded;
    at once when it raised). ``device``: "cpu" or "cuda" (default: cuda when available); each
    rank on CUDA gets ``cuda:LOCAL_RANK``. ``backend``: gloo or nccl (default: nccl on CUDA,
    gloo on CPU); ``timeout_s``: how long a collective waits for a missing rank."""
    missing = [v for v in TORCHRUN_ENV if v not in os.environ]
    if missing:
        raise RuntimeError(f"process_group() needs the environment torchrun sets ({', '.join(missing)} "
                           "missing): launch with `torchrun --nproc-per-node N script.py` (or python -m "
                           "torch.distributed.run)")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialized in this process")
    kind = checks.choice(device or ("cuda" if torch.cuda.is_available() else "cpu"),
                         "device (each rank takes cuda:LOCAL_RANK)", ("cpu", "cuda"))
    backend = checks.choice(backend or ("nccl" if kind == "cuda" else "gloo"), "backend", BACKENDS)
    if backend == "nccl" and kind == "cpu":
        raise ValueError("backend='nccl' needs device='cuda'; on CPU use gloo")
    timeout_s = checks.number(timeout_s, "timeout_s", low=0, low_open=True)  # a float, as timedelta takes
    local_rank = int(os.environ["LOCAL_RANK"])
    if kind == "cuda":
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"device='cuda' needs a GPU per process: local rank {local_rank}, "
                               f"{torch.cuda.device_count()} GPU(s) visible; run at most that many processes per "
                               "host (torchrun --nproc-per-node), or device='cpu'")
        on = torch.device("cuda", local_rank)
        torch.cuda.set_device(on)
    else:
        on = torch.device("cpu")
    # torch.distributed.nn.functional binds group.WORLD into its functions' defaults when first
    # imported, and DistributedDataParallel imports it: after init_process_group that pins the group
    # for the process's life, so destroy_process_group cannot free it, its gloo threads outlive the
    # interpreter and abort the process at exit now and then ("terminate called without an active
    # exception"). Imported first, the defaults hold None.
    importlib.import_module("torch.distributed.nn.functional")

    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    dp = DataParallel(dist.get_rank(), dist.get_world_size(), local_rank, on)
    try:
        yield dp
    except BaseException:
        dist.destroy_process_group()  # leave at once: the other ranks' collectives fail, torchrun stops them
        raise
    dist.barrier()
    dist.destroy_process_group()
