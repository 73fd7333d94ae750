"""The reference training loop: plain fp32, one batch per optimizer step, nothing else."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from kernels.training import LossFn, Recipe, TrainResult


def train(model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
          batches: Iterable[tuple[Tensor, Tensor]], recipe: Recipe | None = None, *,
          device: str | torch.device | None = None,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
          scaler: torch.amp.GradScaler | None = None) -> TrainResult:
    """zero_grad, forward, loss, backward, step (and scheduler step) for each batch.

    ``recipe`` and ``scaler`` are accepted for signature parity: fp32 only, no scaler.
    """
    if (recipe is not None and recipe != Recipe()) or scaler is not None:
        raise ValueError(f"the reference loop is plain fp32 with no accumulation; got {recipe}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.train()
    losses, start = [], time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return TrainResult(losses, len(losses), 0, time.perf_counter() - start)
