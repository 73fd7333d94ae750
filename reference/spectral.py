"""Reference top-k singular values: the full ``torch.linalg.svdvals``, truncated."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.spectral import _check, features_with


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
    """The same features from the full svdvals of every matrix (the original's torch.linalg.svd)."""
    return features_with(topk_singular_values, weights, k)
