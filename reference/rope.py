"""Reference RoPE: cos and sin recomputed on every call, the textbook x cos + rotate_half(x) sin."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.rope import check_rotate, check_settings


def angles(head_dim: int, positions: Tensor, base: float) -> Tensor:
    """theta (..., D/2) in fp64: each position (...) times base^(-2i/D), i = 0 .. D/2 - 1."""
    two_i = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    return positions.to(torch.float64)[..., None] * base ** -(two_i / head_dim)


def rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    """(-x_b, x_a) for each pair (x_a, x_b): pairs (i, i + D/2), or (2i, 2i + 1) interleaved."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([-b, a], dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RotaryEmbedding(nn.Module):
    """Same constructor and call as ``kernels.RotaryEmbedding``; keeps only the settings."""

    def __init__(self, head_dim: int, max_seq_len: int = 2048, base: float = 10000.0,
                 interleaved: bool = False, *, grow: bool = True) -> None:
        super().__init__()
        check_settings(head_dim, max_seq_len, base)
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, float(base)
        self.interleaved, self.grow = bool(interleaved), grow

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        check_rotate(x, self.head_dim, offset, positions)
        if positions is None:
            positions = torch.arange(offset, offset + x.shape[2], device=x.device)
        if not self.grow and positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is beyond the cache of {self.max_seq_len} "
                             "positions (grow=False); build the embedding with a larger max_seq_len")
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32  # rotations in fp32, fp64 for fp64
        theta = angles(self.head_dim, positions, self.base)  # (S, D/2) or (B, S, D/2)
        if theta.ndim == 3:
            theta = theta[:, None]
        if self.interleaved:
            theta = theta.repeat_interleave(2, dim=-1)
        else:
            theta = torch.cat([theta, theta], dim=-1)
        xf = x.to(ct)
        return (xf * theta.cos().to(ct) + rotate_half(xf, self.interleaved) * theta.sin().to(ct)).to(x.dtype)
