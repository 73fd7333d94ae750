"""Rotated-digits continual-learning data: scikit-learn's digits at 28x28 (or local MNIST), task t
rotated by degrees x (t - 1). Nothing is downloaded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

Split = tuple[Tensor, Tensor]  # images (N, 1, 28, 28) or rows (N, 784) float32, labels (N,) int64


def all_digits() -> Split:
    """All 1797 of scikit-learn's digits at 28x28 in [0, 1], in its order: (N, 1, 28, 28), labels (N,)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=28, mode="bilinear", align_corners=False).clamp(0, 1)
    return x, torch.tensor(d.target, dtype=torch.int64)


def digits(seed: int = 0) -> tuple[Split, Split]:
    """``all_digits`` split 80/20 by a seeded permutation: (train (1437, 1, 28, 28), test (360, ...))."""
    x, y = all_digits()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


def mnist(root: str) -> tuple[Split, Split]:
    """MNIST from local files under ``root`` (torchvision layout); never downloads."""
    from torchvision.datasets import MNIST

    def load(train: bool) -> Split:
        try:
            ds = MNIST(root, train=train, download=False)
        except RuntimeError as e:
            raise FileNotFoundError(f"no MNIST files under {root!r} (torchvision layout "
                                    "MNIST/raw/*-ubyte); this workload never downloads") from e
        return ds.data.unsqueeze(1).float() / 255.0, ds.targets.long()

    return load(True), load(False)


def rotated_tasks(data: tuple[Split, Split], tasks: int, degrees: float = 9.0,
                  device: str = "cpu") -> list[tuple[Split, Split]]:
    """Task t: every train and test image rotated by degrees x (t - 1), flattened to (N, 784)
    rows on ``device``."""
    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    from torchvision.transforms.v2.functional import InterpolationMode, rotate

    def rot(s: Split, angle: float) -> Split:
        # the original's TF.rotate on PIL images: nearest neighbour, corners filled with 0
        x = rotate(s[0], angle, interpolation=InterpolationMode.NEAREST, fill=0.0) if angle else s[0]
        return x.flatten(1).to(device), s[1].to(device)

    return [(rot(data[0], degrees * t), rot(data[1], degrees * t)) for t in range(tasks)]
