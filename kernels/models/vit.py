"""A RoPE vision transformer (after Vision-BDH): 4x4 patches of 32x32 images -> 64 tokens,
pre-LN blocks of RoPE self-attention and a GELU MLP, mean-pooled into a linear head.

RoPE runs over the patch index with BDH's settings (theta 2^16, pairs (2i, 2i + 1)). The
attention module is a parameter (``kernels.RopeSelfAttention`` or the reference's, which share
parameters and state dicts), so the reference and optimized runs train the same model.
"""

from __future__ import annotations

from torch import Tensor, nn

from kernels.attention import RopeSelfAttention


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attention: type[RopeSelfAttention], mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attention(dim, heads, max_seq_len=64, base=2.0**16, interleaved=True)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RopeViT(nn.Module):
    """images (B, 3, 32, 32) -> logits (B, classes). Defaults: D 192, 6 heads, 6 layers."""

    def __init__(self, dim: int = 192, heads: int = 6, depth: int = 6, classes: int = 10, patch: int = 4,
                 attention: type[RopeSelfAttention] = RopeSelfAttention) -> None:
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim ({dim}) / heads ({heads}) must be an even head dim")
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(Block(dim, heads, attention) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)  # (B, 64, D), patches in raster order
        return self.head(self.norm(self.blocks(tokens)).mean(1))
