"""Per-feature standardization on any device, with scikit-learn StandardScaler's semantics.

``mean_``, ``var_`` (ddof=0), ``scale_`` = sqrt(var_) with constant features given scale 1
(sklearn's test var <= n eps var + (n mean eps)^2, in float64 with float64's eps), and
``n_samples_seen_``. ``partial_fit`` merges batches with Chan et al.'s pairwise update, so
chunked fitting equals one fit up to rounding. Numerics: every batch is shifted by a fixed
reference row (the first sample seen) before ``var_mean``, so a large common offset (1e6 plus
unit noise) never enters a sum of squares; fp16/bf16 inputs accumulate in fp32, fp64 in fp64.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Standardizer:
    """fit / partial_fit / transform / inverse_transform on X (N, D); fit returns self."""

    def __init__(self) -> None:
        self.n_samples_seen_ = 0
        self.mean_: Tensor | None = None
        self.var_: Tensor | None = None
        self.scale_: Tensor | None = None
        self._shift: Tensor | None = None
        self._m2: Tensor | None = None  # sum of squared deviations from the running mean
        self._dmean: Tensor | None = None  # running mean minus the shift

    def _check(self, x: Tensor, name: str = "X") -> None:
        if not isinstance(x, Tensor) or x.ndim != 2:
            raise ValueError(f"{name} must be a (N, D) tensor, got {getattr(x, 'shape', type(x).__name__)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}; cast with .float()")
        if x.shape[0] == 0:
            raise ValueError(f"{name} has no samples (N = 0)")
        if self._shift is not None:
            if x.shape[1] != self._shift.shape[0]:
                raise ValueError(f"{name} has {x.shape[1]} features, the standardizer was fitted on "
                                 f"{self._shift.shape[0]}")
            if x.device != self._shift.device:
                raise ValueError(f"{name} is on {x.device}, the fitted statistics on {self._shift.device}")

    def fit(self, X: Tensor) -> Standardizer:
        self.__init__()
        return self.partial_fit(X)

    def partial_fit(self, X: Tensor) -> Standardizer:
        """Merge X (N, D) into the running statistics."""
        self._check(X)
        acc = torch.float64 if X.dtype == torch.float64 else torch.float32
        if self._shift is None:
            self._shift = X[0].to(acc)
            self._dmean = torch.zeros_like(self._shift)
            self._m2 = torch.zeros_like(self._shift)
        # two passes over the shifted data: faster on CPU than torch.var_mean over dim 0, whose
        # reduction is strided (docs/measurements/from-the-code.md)
        d = X.to(acc) - self._shift
        mean_b = d.mean(0)
        var_b = d.sub_(mean_b).square_().mean(0)  # in place: d is ours, one (N, D) allocation less
        _finite(mean_b, var_b)
        na, nb = self.n_samples_seen_, X.shape[0]
        n = na + nb
        delta = mean_b - self._dmean
        self._dmean = self._dmean + delta * (nb / n)
        self._m2 = self._m2 + var_b * nb + delta.square() * (na * nb / n)
        self.n_samples_seen_ = n
        self.mean_ = self._shift + self._dmean
        self.var_ = self._m2 / n
        # sklearn's constant-feature test exactly (float64, its eps): var <= n eps var + (n mean eps)^2.
        # A constant column is exactly 0 here (every row minus the shift row is 0), so the fp32
        # accumulation needs no looser rule (an fp32 eps flagged real features with n >= 2^23).
        var64, mean64, eps = self.var_.double(), self.mean_.double(), torch.finfo(torch.float64).eps
        constant = var64 <= n * eps * var64 + (n * mean64 * eps).square()
        self.scale_ = torch.where(constant, torch.ones_like(self.var_), self.var_.sqrt())
        return self

    def _fitted(self, X: Tensor) -> torch.dtype:
        if self.mean_ is None:
            raise RuntimeError("this Standardizer is not fitted yet: call fit(X) or partial_fit(X) first")
        self._check(X)
        return self.mean_.dtype

    def transform(self, X: Tensor, *, out: Tensor | None = None) -> Tensor:
        """(X - mean_) / scale_ in the accumulation dtype, returned in X's dtype. The mean is
        subtracted in two parts (shift, then the small rest): mean_ rounded to fp32 at 1e6 is
        0.06 off, which would be 6% of unit-variance data. ``out``: a tensor like X (fp32 or
        fp64) to write the result into and return, e.g. the previous call's result: a fresh
        (N, D) result page-faults on every call under glibc's default malloc
        (docs/kernels/spectral.md)."""
        acc = self._fitted(X)
        if out is not None:
            _check_out(X, out, acc)
        result = torch.sub(X.to(acc), self._shift, out=out).sub_(self._dmean).div_(self.scale_)
        _finite(result.sum())  # one reduction instead of an isfinite pass: NaN and inf propagate into it
        return result if out is not None else result.to(X.dtype)

    def inverse_transform(self, X: Tensor) -> Tensor:
        acc = self._fitted(X)
        out = torch.mul(X.to(acc), self.scale_).add_(self._dmean).add_(self._shift)
        _finite(out.sum())
        return out.to(X.dtype)

    def fit_transform(self, X: Tensor) -> Tensor:
        return self.fit(X).transform(X)


def _check_out(x: Tensor, out: Tensor, acc: torch.dtype) -> None:
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a Tensor like X, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} on {x.device} (like X), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if x.dtype != acc:
        raise ValueError(f"out= needs X in float32 or float64 (the result is computed in {acc}), got {x.dtype}")
    if not out.is_contiguous() or out.data_ptr() == x.data_ptr():
        raise ValueError("out must be a contiguous tensor of its own (not X itself)")


def _finite(*stats: Tensor) -> None:
    """NaN/inf in X reach every statistic computed from it (a column mean, a sum): checking those
    costs nothing next to an isfinite pass over X."""
    if not all(bool(torch.isfinite(t).all()) for t in stats):
        raise ValueError("X contains NaN or inf (or values whose sums overflow); drop or impute them first")
