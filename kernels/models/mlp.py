"""The OCS MLP (784-256-256-10 by default): Linear + ReLU stacks, optional dropout."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """x (B, sizes[0]) -> logits (B, sizes[-1]). Dropout (p) after the first hidden layer only,
    as in the OCS original (only its first dropout is live)."""

    def __init__(self, sizes: Sequence[int] = (784, 256, 256, 10), dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must list >= 2 positive widths, got {tuple(sizes)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(fan_in, fan_out, bias=bias))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
                if i == 0 and dropout > 0:
                    layers.append(nn.Dropout(dropout))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))
