"""Per-feature standardization on any device, with scikit-learn StandardScaler's semantics.

``mean_``, ``var_`` (ddof=0), ``scale_`` = sqrt(var_) with constant features given scale 1
(sklearn's test var <= n eps var + (n mean eps)^2, in float64 with float64's eps), and
``n_samples_seen_``. ``partial_fit`` merges batches with Chan et al.'s pairwise update, so
chunked fitting equals one fit up to rounding. Numerics: every batch is shifted by a fixed
reference row (a copy of the first sample seen) before the sums, so a large common offset (1e6
plus unit noise) never enters a sum of squares; fp16/bf16 inputs accumulate in fp32, fp64 in fp64.
On the CPU, fit and transform work through X in row blocks of about ``BLOCK_BYTES`` (2 MiB): each
block's passes run while it is in cache, so X is read from memory once per call (the block
statistics merged by the same Chan update) and the result written once. Where kernels._standardize
is built (a C compiler at install), float32 and float64 X on the CPU take its passes instead, each
one pass over X split over torch's threads: the statistics of chunks of about ``CHUNK_BYTES``
(each read twice while in cache, the corrected two-pass formula, the chunks merged in float64),
and the transform's three ops per element with the same rounding as torch's, so the same bits.

Autograd: the statistics are data, never part of a graph. ``fit``/``partial_fit`` read X
detached (fitting on a tensor that requires grad keeps neither its graph nor its storage alive),
and ``transform``/``inverse_transform`` are differentiable w.r.t. their input as the affine maps
they are, with the statistics as constants: d transform(X) / dX = 1 / scale_ per feature (unlike
BatchNorm in training mode, no gradient flows through the mean and variance).

Refused, with an error naming the argument: a non-tensor, a tensor not of rank 2, an integer,
bool or complex dtype, zero samples or zero features (as StandardScaler), a feature count or
device other than the fitted statistics', ``out=`` with an X that requires grad. NaN and inf:
StandardScaler ignores NaN in fit as missing values (per-feature sample counts) and passes them
through transform, and raises on inf; this class supports no missing values and refuses both,
in fit (checked on the merged statistics, which every value of X reaches: one sync per call)
and in transform / inverse_transform (checked on column sums of the result, one per row block,
and one sync; this also catches results that overflow, e.g. a cast back to fp16; a sum that
overflows where every value is finite is told apart by a look at the values). A feature that
varies by less than the square root of the accumulation dtype's smallest normal (1.1e-19 in
float32) is refused in fit: its squared deviations underflow, and its variance would read 0.
A call that raises leaves the standardizer as it was.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from kernels import checks, hugepages
from kernels._team import c_team

try:  # the one-pass CPU statistics and transform, compiled at install where there is a C compiler
    from kernels import _standardize as _c
except ImportError:
    _c = None

# Bytes of a row block on the CPU: a few times the per-core L2, well inside the last-level cache
# (evidence/standardize-blocks-zen3.txt).
BLOCK_BYTES = 2 << 20
# Bytes of a chunk of the C statistics, read twice in a row: inside any x86 core's L2 cache.
CHUNK_BYTES = 128 << 10

_NOT_FINITE = ("this Standardizer refuses NaN and inf (scikit-learn's StandardScaler would skip NaN as missing "
               "values and raise on inf): drop or impute them first; values whose squares or sums overflow "
               "the accumulation dtype are refused the same way")


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

    def _check(self, x: Tensor, name: str = "X", *, against_fit: bool = True) -> None:
        checks.tensor(x, name, ndim=2, floating=True, nonempty=True, shape="(N, D)")
        if against_fit and self._shift is not None:
            if x.shape[1] != self._shift.shape[0]:
                raise ValueError(f"{name} has {x.shape[1]} features, the standardizer was fitted on "
                                 f"{self._shift.shape[0]}")
            checks.same_device({name: x, "the fitted statistics": self._shift})

    def fit(self, X: Tensor) -> Standardizer:
        """Statistics of X (N, D) alone; the previous fit is kept if X is refused."""
        return self._merge(X, fresh=True)

    def partial_fit(self, X: Tensor) -> Standardizer:
        """Merge X (N, D) into the running statistics."""
        return self._merge(X, fresh=False)

    def _merge(self, X: Tensor, *, fresh: bool) -> Standardizer:
        fresh = fresh or self._shift is None
        self._check(X, against_fit=not fresh)
        X = X.detach()  # statistics are constants: no graph, whatever X requires
        acc = torch.float64 if X.dtype == torch.float64 else torch.float32
        if fresh:
            # a copy: .to() returns X's own row when no cast is needed, which would alias the
            # caller's tensor (edited in place later) and keep all of its storage alive
            shift = X[0].to(acc, copy=True)
            dmean0, m2_0, na = torch.zeros_like(shift), torch.zeros_like(shift), 0
        else:
            shift, dmean0, m2_0, na = self._shift, self._dmean, self._m2, self.n_samples_seen_
        mean_b, var_b = _moments(X, shift, acc)
        nb = X.shape[0]
        n = na + nb
        delta = mean_b - dmean0
        dmean = dmean0 + delta * (nb / n)
        m2 = m2_0 + var_b * nb + delta.square() * (na * nb / n)
        # every value of X reaches these (NaN and inf propagate through the means), and so does
        # any overflow of the merge: checked before anything is stored
        # The mirror of an overflow, read in the same sync: a column that varies (m2 or its mean
        # deviation nonzero) with a mean square under the dtype's smallest normal has squares that
        # flushed to subnormals or 0 (std 1e-25 in float32: var 0, scale 1, the column left
        # unscaled): refused, not misread.
        tiny = torch.finfo(acc).tiny
        found = checks.finite_extremes({"X": torch.stack((dmean, m2)), "m2": m2}, hint=_NOT_FINITE)
        lost = (m2 < n * tiny) & (m2.abs() + dmean.abs() != 0) if found["m2"][0] < n * tiny else None
        if lost is not None and bool(lost.any()):  # a constant column (m2 0, dmean 0) varies not
            feature = int(lost.nonzero()[0])
            raise ValueError(f"X's feature {feature} varies by less than the square root of {acc}'s "
                             f"smallest normal ({tiny ** 0.5:.3g}): its squared deviations underflow the {acc} "
                             "accumulation and its variance would be wrong; rescale X, or pass it in float64")
        self._shift, self._dmean, self._m2, self.n_samples_seen_ = shift, dmean, m2, n
        self.mean_ = shift + dmean
        self.var_ = m2 / n
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
        """(X - mean_) / scale_ in the accumulation dtype, returned in X's dtype; differentiable
        w.r.t. X (the statistics are constants). The mean is subtracted in two parts (shift,
        then the small rest): mean_ rounded to fp32 at 1e6 is 0.06 off, which would be 6% of
        unit-variance data. ``out``: a tensor like X (fp32 or fp64) to write the result into
        and return, e.g. the previous call's result: a fresh (N, D) result page-faults on every
        call under glibc's default malloc (in huge pages where Linux offers them:
        kernels.hugepages); not with an X that
        requires grad (out= arguments carry no gradient)."""
        acc = self._fitted(X)
        if out is not None:
            _check_out(X, out, acc, (self._shift, self._dmean, self.scale_, self.mean_, self.var_))
        if (torch.is_grad_enabled() and X.requires_grad) or checks.tangent(X):  # the differentiable path
            result = torch.sub(X.to(acc), self._shift).sub_(self._dmean).div_(self.scale_).to(X.dtype)
            _finite([result], acc, result)
            return result
        # a fresh result in huge pages: writing it faults 2 MiB at a time (kernels.hugepages)
        with (contextlib.nullcontext(out) if out is not None
              else hugepages.fresh(tuple(X.shape), like=X, site="Standardizer.transform")) as result:
            in_c = self._write(X, result, acc)
        if out is not None and in_c:  # written in place, as torch's out= ops count it: a saved out is stale
            torch.autograd.graph.increment_version(result)
        return result

    def _write(self, X: Tensor, result: Tensor, acc: torch.dtype) -> bool:
        """(X - mean_) / scale_ written into ``result`` (like X), refused where it is not finite;
        whether the C pass wrote it (torch's out= ops count their own writes)."""
        if _in_c(X, result, self._shift, self._dmean, self.scale_):  # one pass in C: the same bits as below
            if not _c.transform(X.detach().numpy(), result.numpy(), self._shift.numpy(), self._dmean.numpy(),
                                self.scale_.numpy(), c_team(X.numel(), _c.MAX_THREADS)):
                checks.refuse_nonfinite("X", hint=_NOT_FINITE)
            return True
        # row blocks written into the result: each block's arithmetic and its column sum (the
        # finiteness check) run on a block still in cache, X is read and the result written once
        blocks = _blocks(X, acc)
        # fp16/bf16: each block is computed in fp32 in one reused buffer, then cast into the result
        work = None if X.dtype == acc else torch.empty((blocks[0].stop, X.shape[1]), dtype=acc, device=X.device)
        sums = []
        for rows in blocks:
            block = result[rows] if work is None else work[: rows.stop - rows.start]
            torch.sub(X[rows], self._shift, out=block).sub_(self._dmean).div_(self.scale_)
            if work is not None:
                result[rows].copy_(block)
            sums.append(result[rows].sum(0, dtype=acc))
        _finite(sums, acc, result)
        return False

    def inverse_transform(self, X: Tensor) -> Tensor:
        """X * scale_ + mean_, returned in X's dtype; differentiable w.r.t. X."""
        acc = self._fitted(X)
        result = torch.mul(X.to(acc), self.scale_).add_(self._dmean).add_(self._shift).to(X.dtype)
        _finite([result], acc, result)
        return result

    def fit_transform(self, X: Tensor) -> Tensor:
        return self.fit(X).transform(X)


def _check_out(x: Tensor, out: Tensor, acc: torch.dtype, stats: tuple[Tensor, ...]) -> None:
    """``out`` a result buffer for X: like X, of its own memory, meeting neither X nor ``stats``."""
    checks.tensor(out, "out", shape="like X")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} on {x.device} (like X), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if x.dtype != acc:
        raise ValueError(f"out= needs X in the dtype the result is computed in, the fitted statistics' {acc}, got "
                         f"{x.dtype}; pass X.to({acc}), or transform without out=")
    if not out.is_contiguous() or _overlaps(out, x):
        raise ValueError("out must be a contiguous tensor of its own (not X itself, nor overlapping X's memory)")
    if any(_overlaps(out, t) for t in stats):
        raise ValueError("out must not overlap the fitted statistics (mean_, var_, scale_): pass one of its own")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("out= results carry no gradient and X requires grad: call transform(X) without out=, "
                         "or under torch.no_grad()")
    checks.writable(out, "out")


def _overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether the bytes a and b span meet (the passes read X while they write out); both nonempty."""
    def span(t: Tensor) -> tuple[int, int]:
        last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _blocks(x: Tensor, acc: torch.dtype) -> list[slice]:
    """Row ranges of about ``BLOCK_BYTES`` of x in the accumulation dtype on the CPU, where a
    block's later passes then read the cache instead of memory (and a neighbour's share of the
    last-level cache matters less); one block (all of x) on other devices, where each extra
    block would be extra kernel launches."""
    n, d = x.shape
    rows = n if x.device.type != "cpu" else max(1, BLOCK_BYTES // (d * acc.itemsize))
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _in_c(x: Tensor, *like: Tensor) -> bool:
    """Whether kernels._standardize takes x (N, D) (read detached) with the tensors ``like`` (the
    statistics, the result): built, plain float32 or float64 CPU tensors of one dtype, each at an
    address its dtype aligns, x's columns at unit stride; not under a torch.func transform or a
    trace (torch.compile, torch.export, torch.jit.trace: the torch ops trace, a C call would be
    recorded as a constant)."""
    if _c is None or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    # the address last: a torch.func wrapper (or a meta tensor) has no storage to ask
    return (x.dtype in (torch.float32, torch.float64) and (x.stride(1) == 1 or x.shape[1] == 1)
            and all(type(t) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(t)
                    and t.device.type == "cpu" and t.layout == torch.strided and t.dtype == x.dtype
                    and not t.is_neg() and t.data_ptr() % t.element_size() == 0 for t in (x, *like)))


def _moments(x: Tensor, shift: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Column mean and variance (ddof 0) of x - shift, x (N, D), in ``acc``. In C where ``_in_c``
    (module note), else by torch ops in two passes over each row block (its mean, then its squared
    deviations from it), the blocks merged by Chan et al.'s pairwise formula (exact in exact
    arithmetic; the tests draw the block size, down to a row). torch.var_mean over dim 0 is no
    substitute on the CPU: its reduction is strided (evidence/from-the-code.md)."""
    if _in_c(x, shift):
        mean, var = torch.empty((2, x.shape[1]), dtype=acc)
        rows = max(1, CHUNK_BYTES // (x.shape[1] * acc.itemsize))
        threads = c_team(x.numel(), _c.MAX_THREADS)
        _c.moments(x.detach().numpy(), shift.numpy(), mean.numpy(), var.numpy(), rows, threads)
        return mean, var
    blocks = _blocks(x, acc)
    work = torch.empty((blocks[0].stop, x.shape[1]), dtype=acc, device=x.device)  # one block, reused
    means, m2s = [], []
    for rows in blocks:
        d = torch.sub(x[rows], shift, out=work[: rows.stop - rows.start])
        means.append(d.mean(0))
        m2s.append(d.sub_(means[-1]).square_().sum(0))  # in place: the block is ours
    if len(blocks) == 1:
        return means[0], m2s[0] / x.shape[0]
    counts = torch.tensor([r.stop - r.start for r in blocks], dtype=acc, device=x.device).unsqueeze(1)
    means_, n = torch.stack(means), x.shape[0]
    mean = (means_ * counts).sum(0) / n
    m2 = torch.stack(m2s).sum(0) + ((means_ - mean).square() * counts).sum(0)
    return mean, m2 / n


def _finite(results: list[Tensor], acc: torch.dtype, result: Tensor) -> None:
    """NaN/inf in X (or an overflow) reach the sums of ``results`` (``result`` or its blocks' sums):
    one reduction per block, one sync, cheaper than an elementwise isfinite or aminmax pass over
    the result (docs/kernels/spectral.md). A sum of finite values near the dtype's largest can
    overflow too: only where one did is ``result`` itself read, exactly (its extremes), and refused
    if it is not finite (as the C pass, which tests each value, would)."""
    if checks.nonfinite({"X": torch.stack([r.detach().sum(dtype=acc) for r in results])}):
        checks.finite_extremes({"X": result}, hint=_NOT_FINITE)
