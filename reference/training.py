"""The reference training loop: plain fp32, one batch per optimizer step, nothing else."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from kernels.training import LossFn, Recipe, TrainResult, check_max_grad_norm


def train(model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
          batches: Iterable[tuple[Tensor, Tensor]], recipe: Recipe | None = None, *,
          device: str | torch.device | None = None,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
          scaler: torch.amp.GradScaler | None = None, max_grad_norm: float | None = None) -> TrainResult:
    """zero_grad, forward, loss, backward, clip (with ``max_grad_norm``), step (and scheduler
    step) for each batch.

    ``recipe`` and ``scaler`` are accepted for signature parity: fp32 only, no scaler. Clipping
    is written out: the global norm sqrt(sum of every gradient element squared), and every
    gradient times max_grad_norm / (norm + 1e-6) when that is under 1 (torch's formula).
    """
    if (recipe is not None and recipe != Recipe()) or scaler is not None:
        raise ValueError(f"the reference loop is plain fp32 with no accumulation; got {recipe}")
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.train()
    losses, norms, start = [], [], time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        if max_grad_norm is not None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            norm = math.sqrt(sum(float((grad.double() ** 2).sum()) for grad in grads))
            coef = max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for grad in grads:
                    grad.mul_(coef)
            norms.append(norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return TrainResult(losses, len(losses), 0, time.perf_counter() - start, norms)
