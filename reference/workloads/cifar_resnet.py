"""Reference run of the ResNet-on-CIFAR workload: the seed's baseline, fp32 SGD, plain loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import reference.training
from kernels.models import ResNet10
from kernels.workloads.cifar_resnet import Config, RunReport, timed
from reference.optim import sgd


def run_reference(cfg: Config, lr: float = 0.01) -> RunReport:
    """fp32, per-parameter Python SGD (lr 0.01, momentum 0.9: the seed's baseline), one batch a step."""
    torch.manual_seed(cfg.seed)
    model = ResNet10().to(cfg.device)
    opt = sgd(model.parameters(), lr=lr, momentum=0.9)
    return timed("baseline (fp32, SGD, plain loop)", cfg, model,
                 lambda d: reference.training.train(model, F.cross_entropy, opt, d, device=cfg.device))
