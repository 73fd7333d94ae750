"""Reference RoPE: cos and sin recomputed on every call, the textbook x cos + rotate_half(x) sin."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.rope import check_rotate, check_settings, compute_dtype, rope_angles


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
        ct = compute_dtype(x)  # the kernel's: fp32, or fp64 for fp64 inputs
        angles = rope_angles(self.head_dim, positions, self.base)  # fp64, (S, D/2) or (B, S, D/2)
        if angles.ndim == 3:
            angles = angles[:, None]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        xf = x.to(ct)
        return (xf * angles.cos().to(ct) + rotate_half(xf, self.interleaved) * angles.sin().to(ct)).to(x.dtype)
