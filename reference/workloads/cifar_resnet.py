"""Reference run of the ResNet-on-CIFAR workload: fp32, per-parameter Python SGD (lr 0.01,
momentum 0.9, the original baseline's), the plain loop, one batch a step."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import nn

import reference.training
from kernels.training import TrainResult
from reference.optim import sgd

NAME = "baseline (fp32, SGD, plain loop)"


def steps(model: nn.Module, device: str, lr: float = 0.01) -> Callable[[list], TrainResult]:
    """A function that trains ``model`` over a list of (x, y) batches, one SGD step a batch."""
    opt = sgd(model.parameters(), lr=lr, momentum=0.9)
    return lambda batches: reference.training.train(model, F.cross_entropy, opt, batches, device=device)
