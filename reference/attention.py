"""Reference attention: per-call RoPE and explicit softmax(Q K^T / sqrt(D) + mask) V."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kernels.attention import check_attention, check_module, check_module_input
from reference.rope import RotaryEmbedding


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                      attn_mask: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v, kv heads repeated for grouped-query attention."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    if causal:
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        is_bool = attn_mask.dtype == torch.bool
        scores = scores.masked_fill(~attn_mask, float("-inf")) if is_bool else scores + attn_mask.to(q.dtype)
    if bool(torch.isinf(scores).all(-1).any()):
        raise ValueError("attn_mask (after the causal mask, if any) leaves some query with no key to attend to: "
                         "its softmax is undefined; let every query attend to at least one key")
    return torch.softmax(scores, dim=-1) @ v


def rope_attention(q: Tensor, k: Tensor, v: Tensor, rope: RotaryEmbedding, *, causal: bool = False,
                   attn_mask: Tensor | None = None, offset: int = 0, positions: Tensor | None = None) -> Tensor:
    """q (B, H, S, D), k and v (B, H_kv, S, D) -> (B, H, S, D). ``rope`` gives only its settings."""
    check_attention(q, k, v, attn_mask)
    rope = RotaryEmbedding(rope.head_dim, rope.max_seq_len, rope.base, rope.interleaved, grow=rope.grow)
    q, k = rope(q, offset=offset, positions=positions), rope(k, offset=offset, positions=positions)
    return softmax_attention(q, k, v, causal=causal, attn_mask=attn_mask)


class RopeSelfAttention(nn.Module):
    """x (B, S, dim) -> (B, S, dim): the kernel module's constructor, layers and state dict (qkv, proj),
    with the reference RoPE and attention."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, max_seq_len: int = 2048,
                 base: float = 10000.0, interleaved: bool = False, causal: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        self.n_kv_heads = check_module(dim, n_heads, n_kv_heads, causal, bias)
        self.n_heads, self.head_dim, self.causal = n_heads, dim // n_heads, causal
        self.qkv = nn.Linear(dim, (n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.rope = RotaryEmbedding(self.head_dim, max_seq_len, base, interleaved)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        check_module_input(x, self.proj.in_features, self.qkv.weight)
        b, s, dim = x.shape
        # one projection to every head's q, k and v, then (B, heads, S, head_dim) each
        qkv = self.qkv(x).view(b, s, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        out = rope_attention(q, k, v, self.rope, causal=self.causal, attn_mask=attn_mask)
        return self.proj(out.transpose(1, 2).reshape(b, s, dim))
