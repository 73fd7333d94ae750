"""Reference top-k singular values: the full ``torch.linalg.svdvals``, truncated."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import checks
from kernels.spectral import _check


def topk_singular_values(A: Tensor, k: int, *, oversample: int | None = None, niter: int | None = None,
                         generator: torch.Generator | None = None,
                         return_error: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Exact: every singular value, the k largest kept (error 0). The randomized settings are
    accepted for signature parity and ignored."""
    _check(A, k, oversample, niter)
    a = A.float() if A.dtype in (torch.float16, torch.bfloat16) else A
    s = torch.linalg.svdvals(a)[..., :k].to(A.dtype)
    return (s, torch.zeros_like(s)) if return_error else s


def spectral_features(weights: Tensor | list[Tensor], k: int = 10, *,
                      generator: torch.Generator | None = None) -> Tensor:
    """The same features from the full svdvals of every matrix (the original's torch.linalg.svd):
    per matrix its k largest values s (zero-padded to k), s / sum(s), the gaps (s_i - s_i+1) / s_i,
    the entropy of s / sum(s), s_1 / s_k and sum(s), with the original's 1e-8 guards; a list of
    layers gives their features side by side."""
    if isinstance(weights, list | tuple):
        if not weights:
            raise ValueError("weights is an empty list; pass a (..., m, n) tensor or a list of (B, m_l, n_l) "
                             "layers")
        return torch.cat([spectral_features(w, k) for w in weights], dim=-1)
    checks.integer(k, "k", low=2)
    _check(weights, 1, None, None, finite=False)  # topk_singular_values checks finiteness
    s = topk_singular_values(weights, min(k, min(weights.shape[-2:])))
    s = s.to(torch.float64 if s.dtype == torch.float64 else torch.float32)
    s = torch.cat([s, s.new_zeros(*s.shape[:-1], k - s.shape[-1])], dim=-1)
    total = s.sum(-1, keepdim=True)
    share = s / (total + 1e-8)
    entropy = -(share * torch.log(share + 1e-8)).sum(-1, keepdim=True)
    gaps = (s[..., :-1] - s[..., 1:]) / (s[..., :-1] + 1e-8)
    ratio = s[..., :1] / (s[..., -1:] + 1e-8)
    return torch.cat([s, share, gaps, entropy, ratio, total], dim=-1)
