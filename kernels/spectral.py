"""Top-k singular values by randomized range finding, with an a-posteriori error bound.

For A (..., m, n), tall after an optional transpose: Q spans A G for a Gaussian G (n, q), q = k +
oversample, refined by ``niter`` power iterations (re-orthonormalized each half step); the
singular values s_i of B = Q^T A (q x n) are the estimates. With R = A - QB, Q^T R = 0, so
A^T A = B^T B + R^T R and (Weyl) s_i <= sigma_i(A) <= sqrt(s_i^2 + ||R||_2^2). ``return_error``
returns, per value, sqrt(s_i^2 + ||R||_F^2) - s_i >= sigma_i - s_i >= 0: rigorous in exact
arithmetic (the computed values also carry their SVD's rounding, a few eps s_1, which neither
path's bound adds: the exact path's is 0), about ||R||_F^2 / (2 s_i) for values above the tail.
It is conservative (||R||_F counts all of the discarded tail, and the power iterations make the
values far more accurate than this bound), so it certifies a steep spectrum (0.7^i: 4e-4
relative on the 10th value) and flags a flat one, where the fast path is indeed inexact.

Defaults: q = 2k (at least 10 extra columns; Halko et al. advise 5-10) and up to 4 power
iterations, the best time/error trade measured on CPU; the exact ``svdvals`` when min(m, n) <=
``EXACT_BELOW`` = 96, where it measured faster, or q >= min(m, n) / 2 (evidence/from-the-code.md).
With ``niter`` left as None the iterations stop once the values settle. Each iteration's
estimates are the singular values of the q x q R factor of the QR it takes anyway; they only rise
(each is a lower bound), and the rises shrink geometrically.

- The rule: a rise is measured against s_i + ``FLOOR`` s_1 (relative for the leading values;
  values far under s_1 are known only to the rounding of A, about eps s_1, which no iteration
  resolves). The iterations stop when the last rise is at most ``SETTLED`` eps, or, from the
  third iteration, when the geometric remainder rise c / (1 - c) is, c being the ratio of the
  last two rises (under 1/2). In the fp32 runs measured, 0.5^i and rank-deficient matrices stop
  after 1 iteration, 0.9^i after 3, and flat spectra run all 4; in fp64 (eps 2e-16) they mostly
  run all 4. An explicit ``niter`` runs exactly that many.
- The bound: while the rises shrink, stopping after j iterations leaves each value at most
  (4 - j) SETTLED eps (s_i + FLOOR s_1) under what 4 would give. This is a convergence test, not
  a certificate: ``return_error``'s bound stays the rigorous one (it counts all of the discarded
  tail, so it cannot certify a value to 1e-6 on any but the steepest spectra).
- The cost: a q x q SVD per check and its host arithmetic (on CUDA, a sync per iteration). The
  first check is after iteration 1; iteration 0's values, against which its rise is measured,
  are taken only where the spectrum (s_q / s_k from iteration 1's values) says that rise can
  be settled already (a steep or rank-deficient spectrum). The checks stop where the spectrum
  says the values cannot settle before the last iteration, so a flat spectrum pays one.

A^T Q for a row-major A is computed as (Q^T A)^T: the same product in the layout MKL runs
1.4-1.5x faster for a tall-skinny Q, and its result is the column-major input the next QR takes
without a copy (a wide A, transposed to tall, the other way round).
fp16/bf16 input is computed in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from kernels import checks

EXACT_BELOW = 96  # min(m, n) at or under this: svdvals directly (measured crossover, module note)
NITER = 4  # the most subspace iterations by default (module note)
FLOOR = 1 / 16  # values under FLOOR s_1 have their rises measured against FLOOR s_1 (module note)
SETTLED = 8  # x eps: the largest rise, relative, after which the iterations stop (module note)
AT_ONCE = 100  # x SETTLED eps: the predicted first rise under which iteration 0's values are taken (_Watch)


def _check(a: Tensor, k: int, oversample: int | None, niter: int | None, finite: bool = True) -> None:
    """Refuse what has no top-k singular values. ``finite=False`` leaves the NaN/inf check to the
    caller: a pass over all of A would cost the randomized path a fifth of its time, and its first
    product A @ G carries any NaN or inf of A (``_check_finite``)."""
    checks.tensor(a, "A", min_ndim=2, floating=True, shape="(..., m, n)")
    checks.integer(k, "k", low=1, high=min(a.shape[-2:]))
    for name, v in (("oversample", oversample), ("niter", niter)):
        if v is not None:
            checks.integer(v, name, low=0, hint="or None for the default")
    if finite:
        _check_finite(a)


def _check_finite(t: Tensor, what: str = "A") -> None:
    checks.finite({what: t}, hint="singular values are undefined")


def _orthonormal(y: Tensor) -> Tensor:
    return torch.linalg.qr(y).Q


def _times(a: Tensor, x: Tensor) -> Tensor:
    """a @ x for a tall-skinny x, in the layout MKL runs faster (module note): directly where a's
    rows are contiguous, else as (x^T a^T)^T."""
    return a @ x if a.stride(-1) == 1 else (x.mT @ a.mT).mT


def _values(r: Tensor) -> Tensor:
    """The singular values of Q^T A (..., q), descending, from the R factor (..., q, q) of A^T Q's QR."""
    return torch.linalg.svdvals(r)


class _Watch:
    """Each iteration's values against the last's, to stop the iterations once they settle (module
    note). The arithmetic on the few values (q per matrix) runs on the host in Python floats: as
    torch or numpy ops, each a dispatch, it would cost as much as the q x q SVD."""

    def __init__(self, r0: Tensor, k: int, niter: int) -> None:
        self.k, self.niter, self.rise = k, niter, math.inf
        self.tol = SETTLED * torch.finfo(r0.dtype).eps
        self.tiny = torch.finfo(r0.dtype).tiny  # a zero matrix: rise 0, not 0 / 0
        self.r0 = r0  # iteration 0's R factor: its values are taken only where iteration 1 may settle
        self.last: list[list[float]] | None = None  # the last iteration's values, q per matrix
        self.on = True

    def settled(self, values: Tensor, i: int) -> bool:
        """After iteration ``i`` (1-based): whether its rise ends the iterations."""
        every, k, tiny = _rows(values), self.k, self.tiny
        if self.last is None:  # iteration 1: its rise is measured only where it can be settled
            if not self._at_once(every):
                self.last = every
                self.on = self._can_settle(i)
                return False
            self.last = _rows(_values(self.r0))
        rise = max((now - before) / (now + FLOOR * new[0] + tiny)  # every value of every matrix
                   for new, old in zip(every, self.last, strict=True)
                   for now, before in zip(new[:k], old[:k], strict=True))
        self.last = every
        # the ratio of the last two rises; the first iteration's rise is the random start's transient
        c = rise / self.rise if i > 2 and self.rise > 0 else 1.0
        self.rise = rise
        if rise <= self.tol or (c < 0.5 and rise * c / (1 - c) <= self.tol):
            return True
        self.on = self._can_settle(i)
        return False

    def _at_once(self, values: list[list[float]]) -> bool:
        """Whether iteration 1 can have settled: iteration 0 leaves the k-th value about
        (s_q / s_k)^2 under its limit, relative, and its rise is measured against s_k + FLOOR s_1.
        Where that predicted rise exceeds ``AT_ONCE`` SETTLED eps (the margin:
        evidence/topk-settled-zen3.txt), iteration 0's values are not computed: its q x q SVD is
        saved, and a first rise that settled after all costs one more iteration, never accuracy."""
        k, tiny = self.k, self.tiny
        return max((s[-1] / (s[k - 1] + tiny)) ** 2 * min(1.0, s[k - 1] / (FLOOR * s[0] + tiny))
                   for s in values) <= AT_ONCE * self.tol

    def _can_settle(self, i: int) -> bool:
        """Whether the values can settle before the last iteration: the k-th value's error shrinks
        about c = (s_q / s_k)^4 an iteration, so from the rise of iteration ``i`` the remainder after
        iteration niter - 1 is about rise c^(niter - 1 - i) c / (1 - c). A flat spectrum (c >= 1/2)
        runs all iterations without further checks."""
        c = max(s[-1] / (s[self.k - 1] + self.tiny) for s in self.last) ** 4
        if c >= 0.5 or i >= self.niter - 1:
            return False
        if self.rise == math.inf:  # no rise measured yet
            return True
        return self.rise * c ** (self.niter - 1 - i) * c / (1 - c) <= self.tol


def _rows(values: Tensor) -> list[list[float]]:
    """(..., q) values on the host, q per matrix."""
    return values.detach().reshape(-1, values.shape[-1]).tolist()


def _power_iterations(a: Tensor, basis: Tensor, k: int, niter: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Subspace iterations Q <- orth(A orth(A^T Q)) from ``basis`` (..., m, q): ``niter`` of
    them, or up to ``NITER`` until the values settle when None. Returns the basis Q, Z = A^T Q =
    B^T (..., n, q) and the top-k singular values of B: those of Z's R factor (q x q), a QR of
    the tall Z in place of an SVD of the wide B (q x n)."""
    z = _times(a.mT, basis)  # Z = A^T Q
    w, r = torch.linalg.qr(z)
    watch = _Watch(r, k, NITER) if niter is None and r.numel() else None  # none in an empty batch
    for i in range(1, (NITER if niter is None else niter) + 1):
        basis = _orthonormal(_times(a, w))
        z = _times(a.mT, basis)
        w, r = torch.linalg.qr(z)
        if watch is not None and watch.on:
            values = _values(r)
            if watch.settled(values, i):
                return basis, z, values[..., :k]
    return basis, z, _values(r)[..., :k]


def topk_singular_values(A: Tensor, k: int, *, oversample: int | None = None, niter: int | None = None,
                         generator: torch.Generator | None = None,
                         return_error: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The k largest singular values of each matrix, descending: A (..., m, n) -> (..., k).

    ``return_error``: also (..., k) a rigorous bound on true - estimate for each value (0 when
    computed exactly; module note). ``generator`` seeds the random test matrix (device of A).
    """
    _check(A, k, oversample, niter, finite=False)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError("generator must be a torch.Generator (on A's device) or None, got "
                        f"{type(generator).__name__}")
    out_dtype = A.dtype
    a = A.float() if A.dtype in (torch.float16, torch.bfloat16) else A
    m, n = a.shape[-2:]
    q = k + (max(k, 10) if oversample is None else oversample)
    if min(m, n) <= EXACT_BELOW or 2 * q >= min(m, n):
        _check_finite(a)
        s = torch.linalg.svdvals(a)[..., :k]
        err = torch.zeros_like(s)
    else:
        if m < n:  # work with the tall orientation: the range finder's cost is in n
            a = a.mT
        g = torch.randn(*a.shape[:-2], a.shape[-1], q, dtype=a.dtype, device=a.device, generator=generator)
        y = _times(a, g)
        # every entry of A meets a nonzero Gaussian weight here: a NaN or inf in A makes y non-finite
        if checks.nonfinite({"y": y}):
            _check_finite(a)
            raise ValueError(f"A is finite, but A @ G overflows {a.dtype} (entries up to "
                             f"{a.detach().abs().amax().item():.3g}): pass A scaled down (its singular values "
                             "scale with it) or in float64")
        basis, z, s = _power_iterations(a, _orthonormal(y), k, niter)
        if not return_error:
            return s.to(out_dtype)
        r = a - basis @ z.mT
        # ||R||_F, R = A - Q B, over R's largest entry: the squares inside the norm neither underflow
        # (a tiny A) nor overflow (a huge one)
        big = r.abs().amax((-2, -1), keepdim=True)
        unit = r / big.clamp_min(torch.finfo(r.dtype).tiny)
        tail = (torch.linalg.matrix_norm(unit) * big[..., 0, 0]).unsqueeze(-1)
        # sqrt(s^2 + tail^2) - s as tail^2 / (hypot(s, tail) + s): no square to underflow or
        # overflow, no cancellation; 0 where both are
        h = torch.hypot(s, tail)
        err = torch.where(h > 0, tail * (tail / (h + s)), torch.zeros_like(s))
    if out_dtype != a.dtype:  # rounding to fp16/bf16 may cross the truth: widen the bound by it
        rounded = s.to(out_dtype)
        err = (err + (rounded.to(s.dtype) - s).abs()) * (1 + 2 * torch.finfo(out_dtype).eps)  # rounds up
        s = rounded
    return (s, err.to(out_dtype)) if return_error else s


def features_from_values(s: Tensor) -> Tensor:
    """The original's (weightspace-lora-for-diffusion) 3k + 2 features from top-k values s (..., k),
    zero-padded: s, s / sum(s), the gaps (s_i - s_i+1) / s_i, entropy of s / sum(s), s_1 / s_k, and
    sum(s) (its "nuclear norm", over the top k). Its 1e-8 guards are kept, so these equal its numbers."""
    norm = s / (s.sum(-1, keepdim=True) + 1e-8)
    entropy = -(norm * torch.log(norm + 1e-8)).sum(-1, keepdim=True)
    cond = s[..., :1] / (s[..., -1:] + 1e-8)
    gaps = (s[..., :-1] - s[..., 1:]) / (s[..., :-1] + 1e-8)
    return torch.cat([s, norm, gaps, entropy, cond, s.sum(-1, keepdim=True)], dim=-1)


def _pad(s: Tensor, k: int) -> Tensor:
    return torch.nn.functional.pad(s, (0, k - s.shape[-1])) if s.shape[-1] < k else s


def spectral_features(weights: Tensor | list[Tensor], k: int = 10, *,
                      generator: torch.Generator | None = None) -> Tensor:
    """Per matrix 3k + 2 features (32 for k = 10) from its top-k singular values (the spectral
    probe's). weights: (..., m, n) -> (..., 3k + 2), or a list of (B, m_l, n_l) layers ->
    (B, L * (3k + 2)), layers in order. Matrices with fewer than k values are zero-padded.
    Values at the noise floor (a rank-r update's s_r+1..s_k) come with the randomized error bound,
    and the features that divide by them (gaps there, s_1 / s_k) inherit it."""
    return features_with(lambda w, kk: topk_singular_values(w, kk, generator=generator), weights, k)


def features_with(values: Callable[[Tensor, int], Tensor], weights: Tensor | list[Tensor], k: int) -> Tensor:
    """``spectral_features`` with top-k values from ``values(A, k)`` (shared with the reference)."""
    if isinstance(weights, list | tuple):
        if not weights:
            raise ValueError("weights is an empty list; pass a (..., m, n) tensor or a list of (B, m_l, n_l) "
                             "layers")
        for i, w in enumerate(weights):
            if not isinstance(w, Tensor):
                raise TypeError(f"weights[{i}] is a {type(w).__name__}, not a tensor: pass weights as a "
                                "(..., m, n) tensor or a list of (B, m_l, n_l) layer tensors")
        leading = {tuple(w.shape[:-2]) for w in weights}
        if len(leading) > 1:
            raise ValueError("weights' layers must share their leading (batch) dims, got "
                             f"{sorted(map(str, leading))}; pass one (B, m_l, n_l) tensor a layer, one B")
        return torch.cat([features_with(values, w, k) for w in weights], dim=-1)
    checks.integer(k, "k", low=2)
    _check(weights, 1, None, None, finite=False)  # values() checks finiteness, once
    s = values(weights, min(k, min(weights.shape[-2:])))
    return features_from_values(_pad(s.to(torch.float64 if s.dtype == torch.float64 else torch.float32), k))
