"""A small CIFAR ResNet-10: a stem conv, four stages of one BasicBlock, a linear head.

Ten weight layers (stem, 4 x 2 block convs, head), widths 16-32-64-128, about 0.3M parameters:
the size class of the original's 230k-parameter course net, in the standard residual form.
``norm="group"`` swaps BatchNorm for GroupNorm (8 groups where the width allows): per-sample
statistics, so a batch split into micro-batches computes exactly the same function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

NORMS = ("batch", "group")


def norm_layer(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(math.gcd(8, channels), channels)


class BasicBlock(nn.Module):
    """conv3x3-norm-ReLU-conv3x3-norm plus a (1x1 conv + norm when the shape changes) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(norm, c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm_layer(norm, c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet10(nn.Module):
    """x (B, 3, 32, 32) -> logits (B, classes)."""

    def __init__(self, classes: int = 10, widths: Sequence[int] = (16, 32, 64, 128), norm: str = "batch") -> None:
        super().__init__()
        if len(widths) != 4 or any(w < 1 for w in widths):
            raise ValueError(f"widths must be 4 positive channel counts, got {tuple(widths)}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), norm_layer(norm, widths[0]),
                                  nn.ReLU())
        stages, c_in = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(BasicBlock(c_in, w, stride=1 if i == 0 else 2, norm=norm))
            c_in = w
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"x must be (B, 3, H, W) images, got shape {tuple(x.shape)}")
        return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))
