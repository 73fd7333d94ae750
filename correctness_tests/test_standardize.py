"""kernels.Standardizer == scikit-learn's StandardScaler (reference.standardize): statistics,
transform, inverse, by the C passes (kernels._standardize) and by the torch ops; chunked
partial_fit == one fit; offsets, constant columns, n=1, fp16; no autograd graph kept by a fit,
transform differentiable in X; one test per refused input."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from correctness_tests.conftest import torch_threads
from correctness_tests.tolerances import ELEMENTWISE, REDUCTION, assert_as_accurate, assert_close
from kernels import standardize
from kernels.standardize import Standardizer
from reference.standardize import Standardizer as Reference

# How the CPU passes run, for the tests that draw it: in C (where kernels._standardize is built) or
# by torch ops, with rows per C chunk or torch block; None keeps the kernel's own (one at these
# sizes), 1 is one per row.
IN_C = [True, False] if standardize._c is not None else [False]
PATHS = [(c, rows) for c in IN_C for rows in (None, 1, 3, 64)]
Path = tuple[bool, int | None]


@contextlib.contextmanager
def passes(path: Path, x: torch.Tensor) -> Iterator[None]:
    """The CPU passes in C or in torch ops (``path[0]``), by chunks or blocks of ``path[1]`` rows of
    x's (N, D) in its accumulation dtype."""
    in_c, rows = path
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    with contextlib.ExitStack() as stack:
        if not in_c:
            stack.enter_context(mock.patch.object(standardize, "_c", None))
        if rows is not None:
            name = "CHUNK_BYTES" if in_c else "BLOCK_BYTES"
            stack.enter_context(mock.patch.object(standardize, name, rows * x.shape[1] * acc.itemsize))
            assert in_c or len(standardize._blocks(x, acc)) == -(-x.shape[0] // rows)
        assert standardize._in_c(x) == (in_c and x.dtype == acc)
        yield


@st.composite
def data(draw: st.DrawFn, dtypes=(torch.float32, torch.float64)) -> torch.Tensor:
    n, d = draw(st.integers(1, 300)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(dtypes))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    offset = draw(st.sampled_from([0.0, -50.0, 1e3, 1e6]))
    noise = draw(st.sampled_from([1e-2, 1.0, 100.0]))
    x = offset + noise * torch.randn(n, d, dtype=torch.float64)
    for j in draw(st.lists(st.integers(0, d - 1), max_size=3)):
        x[:, j] = offset + 7.0  # constant columns
    return x.to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
    assert_close(actual.double(), expected.double(), kind, dtype=dtype)


@given(data(), st.sampled_from(PATHS))
def test_fit_transform_inverse_equal_sklearn(x: torch.Tensor, path: Path) -> None:
    """Either path, any row chunking (one per row to one), gives sklearn's statistics and transform."""
    with passes(path, x):
        got, want = Standardizer().fit(x), Reference().fit(x)
        assert got.n_samples_seen_ == want.n_samples_seen_ == x.shape[0]
        _close(got.mean_, want.mean_, REDUCTION, x.dtype)
        _close(got.var_, want.var_, REDUCTION, x.dtype)
        _close(got.scale_, want.scale_, REDUCTION, x.dtype)
        z = got.transform(x)
        assert z.dtype == x.dtype and z.shape == x.shape
        # sklearn subtracts a mean rounded to X's dtype (1000.46 in fp32: 1.5e-4 off at unit scale), so
        # the transform is judged by sklearn in fp64 on the same values, and must be as accurate
        oracle = Reference().fit(x.double())
        _close(z, oracle.transform(x.double()), REDUCTION, x.dtype)
        if x.dtype == torch.float32:  # (sklearn in fp64 is no oracle for fp64 inputs: it rounds the same)
            assert_as_accurate(z, want.transform(x).to(x.dtype), oracle.transform(x.double()))
        _close(got.inverse_transform(z), x, REDUCTION, x.dtype)


@given(data(), st.lists(st.integers(1, 299), max_size=4), st.sampled_from(PATHS))
def test_chunked_partial_fit_equals_one_fit(x: torch.Tensor, cuts: list[int], path: Path) -> None:
    """partial_fit chunks (each passed as ``path`` says) equal one fit."""
    bounds = sorted({c for c in cuts if c < x.shape[0]} | {0, x.shape[0]})
    chunked = Standardizer()
    with passes(path, x):
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            chunked.partial_fit(x[a:b])
    whole = Standardizer().fit(x)
    assert chunked.n_samples_seen_ == x.shape[0]
    _close(chunked.mean_, whole.mean_, REDUCTION, x.dtype)
    _close(chunked.var_, whole.var_, REDUCTION, x.dtype)
    _close(chunked.transform(x), whole.transform(x), REDUCTION, x.dtype)


def test_large_offset_keeps_unit_noise_exact() -> None:
    """1e6 plus unit noise in fp32: a naive E[x^2] - E[x]^2 loses every digit of the variance."""
    torch.manual_seed(0)
    x = (1e6 + torch.randn(5000, 4, dtype=torch.float64)).float()
    s = Standardizer().fit(x)
    want = Reference().fit(x)
    _close(s.var_, want.var_, REDUCTION, torch.float32)
    _close(s.transform(x), Reference().fit(x.double()).transform(x.double()), ELEMENTWISE, torch.float32)


def test_small_variance_after_an_outlier_first_row_is_not_constant() -> None:
    """The review's case: the shift row is an outlier and the feature's variance small; sklearn
    keeps its scale (0.0105), and so must we (an fp32-eps rule had set it to 1)."""
    torch.manual_seed(0)
    x = 0.01 * torch.randn(100_000, 1)
    x[0] = 1.0
    got, want = Standardizer().fit(x), Reference().fit(x)
    _close(got.scale_, want.scale_, REDUCTION, torch.float32)
    assert got.scale_.item() < 0.02


def test_n1_and_constant_columns_get_scale_one() -> None:
    one = Standardizer().fit(torch.tensor([[3.0, -2.0]]))
    assert torch.equal(one.scale_, torch.ones(2)) and torch.equal(one.transform(torch.tensor([[3.0, -2.0]])),
                                                                   torch.zeros(1, 2))
    x = torch.cat([torch.full((10, 1), 1e6), torch.randn(10, 1)], 1)
    assert Standardizer().fit(x).scale_[0] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", PATHS)
def test_an_all_zero_column_gets_scale_one(path: Path, dtype: torch.dtype) -> None:
    """A column of zeros (var 0, mean 0: sklearn's test var <= n eps var + (n mean eps)^2 at
    equality) is constant: scale 1, var 0, and transformed to 0, as sklearn does, on every path."""
    x = torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0]], dtype=dtype)
    with passes(path, x):
        got, want = Standardizer().fit(x), Reference().fit(x)
        z = got.transform(x)
    assert got.scale_[0] == 1.0 and got.var_[0] == 0.0
    _close(got.scale_, want.scale_, REDUCTION, dtype)
    _close(got.var_, want.var_, REDUCTION, dtype)
    assert torch.equal(z[:, 0], torch.zeros(3, dtype=dtype))
    _close(z, want.transform(x), REDUCTION, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, 7])
def test_half_precision_accumulates_in_fp32(dtype, rows: int | None) -> None:
    """Statistics in fp32, and the transform computed in fp32 then cast, in one block or many."""
    x = (10 + 3 * torch.randn(20000, 6)).to(dtype)
    with passes((False, rows), x):  # the torch ops: the C passes take float32 and float64 only
        s = Standardizer().fit(x)
        z = s.transform(x)
    want = Reference().fit(x)  # the reference takes half precision too: computed in float64
    assert s.mean_.dtype == torch.float32
    _close(s.mean_, want.mean_, REDUCTION, torch.float32)
    _close(s.var_, want.var_, REDUCTION, torch.float32)
    assert z.dtype == dtype and want.transform(x).dtype == dtype
    torch.testing.assert_close(z, want.transform(x))
    torch.testing.assert_close(s.inverse_transform(z), want.inverse_transform(z))


def test_bad_input_is_refused() -> None:
    s = Standardizer()
    with pytest.raises(RuntimeError, match="not fitted"):
        s.transform(torch.randn(3, 2))
    s.fit(torch.randn(4, 3))
    with pytest.raises(ValueError, match="has 2 features, the standardizer was fitted on 3"):
        s.transform(torch.randn(4, 2))
    with pytest.raises(ValueError, match="has 4 features, the standardizer was fitted on 3"):
        s.partial_fit(torch.randn(4, 4))
    with pytest.raises(ValueError, match="has 2 features, the standardizer was fitted on 3"):
        s.inverse_transform(torch.randn(4, 2))
    assert s.fit(torch.randn(4, 3)) is s


BAD_X = {
    "a list": ([[1.0, 2.0]], TypeError, r"X must be a torch\.Tensor of shape \(N, D\), got list"),
    "rank 1": (torch.randn(5), ValueError, r"X must be a tensor of shape \(N, D\), got shape \(5,\)"),
    "rank 3": (torch.randn(2, 3, 4), ValueError, r"X must be a tensor of shape \(N, D\), got shape \(2, 3, 4\)"),
    "int64": (torch.ones(3, 2, dtype=torch.int64), TypeError, "X must be a floating-point tensor, got torch.int"),
    "bool": (torch.ones(3, 2, dtype=torch.bool), TypeError, "X must be a floating-point tensor, got torch.bool"),
    "complex": (torch.ones(3, 2, dtype=torch.complex64), TypeError, "X must be a floating-point tensor"),
    "no samples": (torch.randn(0, 3), ValueError, r"X is empty \(shape \(0, 3\)\)"),
    "no features": (torch.randn(5, 0), ValueError, r"X is empty \(shape \(5, 0\)\)"),
}


@pytest.mark.parametrize("method", ["fit", "partial_fit", "transform", "inverse_transform", "fit_transform"])
@pytest.mark.parametrize("case", list(BAD_X))
def test_bad_x_is_refused_naming_x(case: str, method: str) -> None:
    x, error, message = BAD_X[case]
    s = Standardizer().fit(torch.randn(4, 3)) if method in ("transform", "inverse_transform") else Standardizer()
    with pytest.raises(error, match=message):
        getattr(s, method)(x)


def test_x_on_another_device_than_the_statistics_is_refused() -> None:
    s = Standardizer().fit(torch.randn(4, 3))
    for method in ("partial_fit", "transform", "inverse_transform"):
        with pytest.raises(ValueError, match="X on meta; the fitted statistics on cpu: move them to one device"):
            getattr(s, method)(torch.randn(4, 3, device="meta"))


NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


@pytest.mark.parametrize("method", ["fit", "partial_fit", "transform", "inverse_transform"])
@pytest.mark.parametrize("value", list(NON_FINITE))
@pytest.mark.parametrize("path", [(c, rows) for c in IN_C for rows in (None, 2)])
def test_nan_and_inf_are_refused_never_silent_statistics(method: str, value: str, path: Path) -> None:
    """scikit-learn skips NaN in fit and passes them through transform (and raises on inf): this
    class refuses both everywhere, with a message saying so, whichever row (and row block) holds them."""
    s = Standardizer().fit(torch.randn(6, 3))
    for row in (0, 4, 5):
        x = torch.randn(6, 3)
        x[row, 1] = NON_FINITE[value]
        with passes(path, x), pytest.raises(ValueError, match="NaN or inf in X; this Standardizer refuses NaN"):
            getattr(s, method)(x)


def test_a_result_that_overflows_its_dtype_is_refused() -> None:
    """fp16 X is standardized in fp32, then cast back: a value 1e5 deviations out is inf in fp16."""
    s = Standardizer().fit(torch.tensor([[0.0], [0.01], [-0.01]], dtype=torch.float16))
    with pytest.raises(ValueError, match="NaN or inf in X"):
        s.transform(torch.tensor([[1000.0]], dtype=torch.float16))


def test_a_refused_call_changes_nothing() -> None:
    """A partial_fit or fit that raises leaves the statistics as they were: a refused NaN first row
    does not become the shift of every later batch, and a refused fit does not erase the previous one."""
    x = torch.randn(8, 3, dtype=torch.float64)
    bad = x.clone()
    bad[0, 0] = float("nan")
    s = Standardizer()
    with pytest.raises(ValueError, match="NaN or inf"):
        s.partial_fit(bad)
    assert s.mean_ is None and s.n_samples_seen_ == 0
    s.partial_fit(torch.randn(5, 4, dtype=torch.float64))  # any width: nothing was fitted
    s.fit(x)
    want = Standardizer().fit(x)
    for method, refused in (("fit", bad), ("fit", torch.randn(0, 3)), ("partial_fit", bad),
                            ("partial_fit", torch.randn(5, 2, dtype=torch.float64))):
        with pytest.raises(ValueError):
            getattr(s, method)(refused)
        assert s.n_samples_seen_ == 8
        for name in ("mean_", "var_", "scale_"):
            assert torch.equal(getattr(s, name), getattr(want, name))


def test_a_fit_keeps_no_autograd_graph_and_transform_is_differentiable() -> None:
    """Fitting on a tensor that requires grad stores constants: the graph (and the leaf behind it)
    is freed. transform / inverse_transform are affine in X with those constants, so their
    gradients are 1 / scale_ and scale_ per feature."""
    w = torch.randn(50, 4, dtype=torch.float64, requires_grad=True)
    leaf = weakref.ref(w)
    s = Standardizer().fit(w * 3.0 + 1.0)
    del w
    gc.collect()
    assert leaf() is None, "the fitted statistics keep the input's graph alive"
    for name, value in vars(s).items():
        if isinstance(value, torch.Tensor):
            assert value.grad_fn is None and not value.requires_grad, name
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    s.transform(x).sum().backward()
    torch.testing.assert_close(x.grad, (1 / s.scale_).expand(7, 4))
    x.grad = None
    s.inverse_transform(x).sum().backward()
    torch.testing.assert_close(x.grad, s.scale_.expand(7, 4))
    assert all(v.grad is None for v in vars(s).values() if isinstance(v, torch.Tensor))


def test_a_fit_keeps_no_reference_to_x() -> None:
    """The shift row is a copy: X edited in place later changes nothing, and X can be freed."""
    x = 5.0 + torch.randn(40, 3)
    fresh = Standardizer().fit(x.clone())
    s = Standardizer().fit(x)
    probe = torch.randn(10, 3)
    x.add_(100.0)
    torch.testing.assert_close(s.transform(probe), fresh.transform(probe), rtol=0, atol=0)
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transform_into_out(dtype: torch.dtype) -> None:
    """transform(X, out=buf) writes the same values into buf and returns it, call after call."""
    scaler = Standardizer()
    buf = None
    for seed in range(2):
        x = 7.0 + 2.0 * torch.randn(50, 6, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        want = scaler.fit(x).transform(x)
        buf = torch.full_like(x, float("nan")) if buf is None else buf
        got = scaler.transform(x, out=buf)
        assert got is buf
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_out_is_refused() -> None:
    x = torch.randn(20, 4)
    scaler = Standardizer().fit(x)
    for out, message in ((x[:10].clone(), "must be"), (x.double(), "must be"), (x, "of its own"),
                         (torch.empty(4, 20).T, "contiguous"), ([1.0], "out must be a torch.Tensor")):
        with pytest.raises((ValueError, TypeError), match=message):
            scaler.transform(x, out=out)
    # memory X also spans, through another tensor of the same buffer: the C pass would read X
    # while writing out
    shared = torch.randn(30, 4).numpy()
    with pytest.raises(ValueError, match="nor overlapping X's memory"):
        scaler.transform(torch.from_numpy(shared[:20]), out=torch.from_numpy(shared[10:]))
    with pytest.raises(ValueError, match="out must not overlap the fitted statistics"):
        scaler.transform(x[:1], out=scaler.scale_.view(1, 4))
    pair = torch.randn(40, 4)  # two halves of one storage that do not meet: taken
    assert torch.equal(scaler.transform(pair[:20], out=pair[20:]), scaler.transform(pair[:20]))
    with pytest.raises(ValueError, match=r"the fitted statistics' torch.float32, got torch.float16"):
        scaler16 = Standardizer().fit(x.half())
        scaler16.transform(x.half(), out=torch.empty_like(x.half()))
    with pytest.raises(ValueError, match=r"the fitted statistics' torch.float64, got torch.float32"):
        Standardizer().fit(x.double()).transform(x, out=torch.empty_like(x))  # the review's self-contradiction
    with pytest.raises(TypeError, match="X must be a dense tensor, got layout torch.sparse_coo"):
        Standardizer().fit(x.to_sparse())  # torch's own error named aten::as_strided


def test_out_with_an_x_that_requires_grad_is_refused() -> None:
    x = torch.randn(20, 4, requires_grad=True)
    scaler = Standardizer().fit(x)
    with pytest.raises(ValueError, match="out= results carry no gradient and X requires grad"):
        scaler.transform(x, out=torch.empty(20, 4))
    with torch.no_grad():
        buf = scaler.transform(x, out=torch.empty(20, 4))
    torch.testing.assert_close(buf, scaler.transform(x).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("path", [(c, None) for c in IN_C])
def test_squares_that_overflow_are_refused(path: Path) -> None:
    """fp32 values 3e19 apart have finite means and squares past fp32's range: refused, not inf."""
    x = torch.tensor([[0.0], [3e19], [-3e19], [1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])  # both row loops
    with passes(path, x), pytest.raises(ValueError, match="NaN or inf in X"):
        Standardizer().fit(x)
    with passes(path, x), pytest.raises(ValueError, match="NaN or inf in X"):
        Standardizer().fit(x[:3])


@pytest.mark.parametrize("path", [(c, None) for c in IN_C])
def test_squares_that_underflow_are_refused(path: Path) -> None:
    """The mirror of an overflow: fp32 values 1e-25 apart square to 0 (var 0, scale 1: the column
    left unscaled, 1e25 off scikit-learn's scale, silently); at 1e-18 the squares stay normal and
    the scale is scikit-learn's. A constant column still fits (scale 1), and float64 holds 1e-25."""
    torch.manual_seed(0)
    noise = torch.randn(64, 1)
    for dtype in (torch.float32, torch.bfloat16):
        with passes(path, noise), pytest.raises(ValueError, match="feature 1 varies by less than"):
            Standardizer().fit(torch.cat([noise, 1e-25 * noise], 1).to(dtype))
    small = 1e-18 * noise
    with passes(path, small):
        _close(Standardizer().fit(small).scale_, Reference().fit(small).scale_, REDUCTION, torch.float32)
    assert Standardizer().fit(torch.full((8, 2), 3.0)).scale_.tolist() == [1.0, 1.0]
    tiny64 = (1e-25 * noise).double()
    _close(Standardizer().fit(tiny64).scale_, Reference().fit(tiny64).scale_, REDUCTION, torch.float64)


@pytest.mark.parametrize("path", [(c, None) for c in IN_C])
def test_squares_that_underflow_are_refused_though_their_sum_is_normal(path: Path) -> None:
    """The underflow bound is on the mean square (m2 < n tiny), not on m2: fp32 deviations of
    +-2^-64 square to tiny / 4 (subnormal), and 6 of them sum to m2 = 1.5 tiny, over tiny but
    under 7 tiny; std 0.93 x 2^-64, under sqrt(tiny) = 2^-63: refused."""
    d = 2.0**-64
    x = torch.tensor([[0.0], [d], [-d], [d], [-d], [d], [-d]])
    tiny = torch.finfo(torch.float32).tiny
    assert tiny < 6 * d * d < 7 * tiny  # the case: m2 between tiny and n tiny
    with passes(path, x), pytest.raises(ValueError, match="feature 0 varies by less than"):
        Standardizer().fit(x)


@pytest.mark.parametrize("path", [(c, None) for c in IN_C])
def test_a_finite_x_whose_result_overflows_is_refused(path: Path) -> None:
    """A scale of 1e-10 takes X = 1e30 to 1e40, past fp32's range: refused, never inf."""
    fit = torch.tensor([[1e-10], [-1e-10]] * 4)
    with passes(path, fit), pytest.raises(ValueError, match="NaN or inf in X"):
        Standardizer().fit(fit).transform(torch.tensor([[0.0]] * 8 + [[1e30]]))


@pytest.mark.parametrize("path", [(c, rows) for c in IN_C for rows in (None, 3)])
def test_a_finite_result_whose_sums_overflow_is_kept_on_every_path(path: Path) -> None:
    """Values of 1e37 stay finite standardized, though a block's column sum passes fp32's largest:
    kept on every path (the C pass tests each value; the torch ops' sums, where one overflows,
    have the values read), and the same bits on each."""
    s = Standardizer().fit(torch.randn(100, 2, generator=torch.Generator().manual_seed(0)))
    x = torch.full((100, 2), 1e37)
    with passes(path, x):
        got = s.transform(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, (x - s.mean_) / s.scale_)
    bad = x.clone()
    bad[57, 1] = float("inf")
    with passes(path, bad), pytest.raises(ValueError, match="NaN or inf in X"):
        s.transform(bad)


needs_c = pytest.mark.skipif(standardize._c is None, reason="kernels._standardize is not built (no C compiler)")


@needs_c
@given(data())
def test_the_c_passes_equal_the_torch_ops(x: torch.Tensor) -> None:
    """The C statistics equal the torch ops' within the reduction tolerance, and its transform gives
    the same bits with the same statistics."""
    c = Standardizer().fit(x)
    with passes((False, None), x):
        ops = Standardizer().fit(x)
        want = c.transform(x)
    for name in ("mean_", "var_", "scale_"):
        _close(getattr(c, name), getattr(ops, name), REDUCTION, x.dtype)
    assert torch.equal(c.transform(x), want)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_c_passes_split_over_any_team(dtype: torch.dtype) -> None:
    """Rows split over 1 to 7 threads (and more threads than rows): the statistics within the
    reduction tolerance of float64's, the transform torch's bits."""
    x = (3.0 + torch.randn(301, 37, dtype=torch.float64)).to(dtype)
    shift = x[0].clone()
    truth = x.double() - shift.double()
    dmean, scale = truth.mean(0).to(dtype), truth.std(0).to(dtype)
    want = ((x - shift) - dmean) / scale  # torch's three ops
    for threads, chunk in ((1, 1), (2, 16), (3, 64), (7, 1000), (256, 5)):
        mean, var = torch.empty((2, 37), dtype=dtype)
        standardize._c.moments(x.numpy(), shift.numpy(), mean.numpy(), var.numpy(), chunk, threads)
        _close(mean, truth.mean(0), REDUCTION, dtype)
        _close(var, truth.var(0, unbiased=False), REDUCTION, dtype)
        out = torch.empty_like(x)
        stats = (shift.numpy(), dmean.numpy(), scale.numpy())
        assert standardize._c.transform(x.numpy(), out.numpy(), *stats, threads)
        assert torch.equal(out, want)


@needs_c
def test_strided_x() -> None:
    """Rows at any stride take the C passes; columns at another stride take the torch ops; both
    give what a contiguous copy gives."""
    wide = 5.0 + torch.randn(200, 60)
    for x, in_c in ((wide[:, 5:45], True), (wide[::3, :1], True), (wide.T[:40].T, True), (wide[:, ::2], False)):
        assert standardize._in_c(x) == in_c
        dense = x.contiguous()
        got, want = Standardizer().fit(x), Standardizer().fit(dense)
        _close(got.var_, want.var_, REDUCTION, torch.float32)
        assert torch.equal(got.transform(x), got.transform(dense))


@needs_c
def test_the_c_module_refuses_what_it_cannot_take() -> None:
    moments, transform = standardize._c.moments, standardize._c.transform
    x, v = torch.randn(8, 3).numpy(), torch.zeros(3).numpy()
    calls = {
        "int buffer": (lambda: moments(x.astype("int32"), v, v, v, 4, 1), TypeError, "x must be a float32"),
        "mixed formats": (lambda: moments(x, v.astype("float64"), v, v, 4, 1), TypeError,
                          "every buffer must hold x's format"),
        "columns strided": (lambda: moments(torch.randn(8, 6)[:, ::2].numpy(), v, v, v, 4, 1), ValueError,
                            "unit stride"),
        "short statistics": (lambda: moments(x, v[:2], v, v, 4, 1), ValueError, "x's 3 columns, got 2"),
        "no chunk": (lambda: moments(x, v, v, v, 0, 1), ValueError, "chunk must be 1..16777216 rows"),
        "a huge chunk": (lambda: moments(x, v, v, v, 2**63 - 1, 2), ValueError, "chunk must be 1..16777216 rows"),
        "no threads": (lambda: transform(x, x.copy(), v, v, v, 0), ValueError, "threads must be 1..256"),
        "out's shape": (lambda: transform(x, x[:4].copy(), v, v, v, 1), ValueError, "out must have x's shape"),
    }
    for call, error, message in calls.values():
        with pytest.raises(error, match=message):
            call()


@needs_c
def test_the_team_split_through_the_standardizer() -> None:
    """X large enough for two threads of torch's team (``c_team``): the statistics equal the torch
    ops', and a NaN in the second thread's rows is refused in fit and in transform."""
    x = 3.0 + torch.randn(4000, 40)
    with torch_threads(2):
        assert standardize.c_team(x.numel(), standardize._c.MAX_THREADS) == 2
        got = Standardizer().fit(x)
        with passes((False, None), x):
            want = Standardizer().fit(x)
        _close(got.var_, want.var_, REDUCTION, torch.float32)
        bad = x.clone()
        bad[3999, 7] = float("nan")
        for call in (lambda: Standardizer().fit(bad), lambda: got.transform(bad)):
            with pytest.raises(ValueError, match="NaN or inf in X"):
                call()


@pytest.mark.parametrize("fit_dtype, x_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_x_of_another_float_dtype_than_the_fit(fit_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    """A fit in one dtype and a transform or partial_fit in the other take the torch ops (the C
    passes take one dtype throughout): the transform is the torch ops' bits, the merged
    statistics sklearn's."""
    x = 2.0 + torch.randn(50, 6, dtype=torch.float64)
    got = Standardizer().fit(x.to(fit_dtype))
    z = got.transform(x.to(x_dtype))
    with passes((False, None), x):
        assert torch.equal(z, got.transform(x.to(x_dtype)))
    got.partial_fit(x.to(x_dtype))
    want = Reference().fit(torch.cat([x.to(fit_dtype).double(), x.to(x_dtype).double()]))
    _close(got.var_, want.var_, REDUCTION, torch.float32)


def test_x_and_out_at_unaligned_addresses() -> None:
    """float32 at an odd byte address (a buffer the user wrapped) takes the torch ops, and gives
    what an aligned copy gives."""
    def unaligned(n: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(4 * n + 1), dtype=torch.float32, offset=1, count=n)

    x = unaligned(4000).view(1000, 4).copy_(5.0 + torch.randn(1000, 4))
    assert x.data_ptr() % 4 and not standardize._in_c(x)
    dense = x.clone()
    got, want = Standardizer().fit(x), Standardizer().fit(dense)
    _close(got.var_, want.var_, REDUCTION, torch.float32)
    out = unaligned(4000).view(1000, 4)
    assert torch.equal(got.transform(x, out=out), got.transform(dense))
    assert torch.equal(got.transform(dense, out=out), got.transform(dense))  # X aligned, out not


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")  # still in use
def test_a_traced_transform_replays_on_new_x() -> None:
    """torch.jit.trace records the torch ops, not the C pass (a constant to the tracer)."""
    s = Standardizer().fit(3.0 + torch.randn(100, 5))
    with torch.no_grad():
        traced = torch.jit.trace(lambda t: s.transform(t), (torch.randn(100, 5),), check_trace=False)
        y = torch.randn(100, 5)
        assert torch.equal(traced(y), s.transform(y))


def test_torch_func_over_fit_and_transform() -> None:
    """torch.func.grad through fit and transform takes the torch ops (a wrapper has no storage for
    the C passes) and gives autograd's gradient."""
    x = 3.0 + torch.randn(50, 4, dtype=torch.float64)

    def loss(t: torch.Tensor) -> torch.Tensor:
        s = Standardizer().fit(t)
        return s.transform(t).square().sum() + s.mean_.sum()

    got = torch.func.grad(loss)(x)
    leaf = x.clone().requires_grad_(True)
    loss(leaf).backward()
    torch.testing.assert_close(got, leaf.grad)


def test_out_written_in_c_is_seen_by_autograd_and_bad_outs_are_refused() -> None:
    """A saved out= overwritten by transform: the backward that needs it must refuse, on the C
    pass as on the torch ops (its version counter); an out needing grad, or an inference tensor
    outside inference mode, is refused before anything is written."""
    x = torch.randn(64, 8)
    s = Standardizer().fit(x)
    out, w = torch.zeros(64, 8), torch.ones(8, requires_grad=True)
    z = (out[0] * w).sum()
    s.transform(x, out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    with pytest.raises(ValueError, match="out requires grad"):
        s.transform(x, out=torch.zeros(64, 8, requires_grad=True))
    with torch.inference_mode():
        frozen = torch.zeros(64, 8)
    with pytest.raises(ValueError, match="out is an inference tensor"):
        s.transform(x, out=frozen)


def test_forward_mode_ad_through_transform() -> None:
    """The C pass would drop a tangent: a dual X takes the differentiable torch ops (d/dX = 1/scale_)."""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(64, 8)
    s = Standardizer().fit(x)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(s.transform(fwAD.make_dual(x, torch.ones_like(x)))).tangent
    assert got is not None
    torch.testing.assert_close(got, (1 / s.scale_).expand(64, 8))


def test_nan_is_refused_on_the_differentiable_path() -> None:
    """An X that requires grad, a dual X (forward-mode AD) or torch.func.jvp take the torch ops:
    a NaN there is refused as on the other paths."""
    import torch.autograd.forward_ad as fwAD

    s = Standardizer().fit(torch.randn(5, 2))
    bad = torch.tensor([[float("nan"), 1.0]])
    with pytest.raises(ValueError, match="NaN or inf in X; this Standardizer refuses NaN"):
        s.transform(bad.clone().requires_grad_(True))
    with fwAD.dual_level(), pytest.raises(ValueError, match="NaN or inf in X; this Standardizer refuses NaN"):
        s.transform(fwAD.make_dual(bad, torch.ones_like(bad)))
    with pytest.raises(ValueError, match="NaN or inf in X; this Standardizer refuses NaN"):
        torch.func.jvp(s.transform, (bad,), (torch.ones_like(bad),))


@needs_c
@pytest.mark.parametrize("chunk", [5, 1000, 4096])
def test_the_c_statistics_of_data_far_from_the_shift_keep_their_digits(chunk: int) -> None:
    """Data 1e3 and 1e5 away from the shift (a later partial_fit's batch, an outlier shift row), unit
    noise, float32: the corrected two-pass formula takes back the rounding of each chunk's float32
    mean, in the mean (as accurate as float64's rounded once) and in the variance (reduction
    tolerance), a whole chunk and a last chunk cut short alike."""
    torch.manual_seed(0)
    for offset in (1e3, 1e5):
        x = (offset + torch.randn(4096, 3, dtype=torch.float64)).float()
        shift = torch.zeros(3)
        truth = x.double() - shift.double()
        mean, var = torch.empty((2, 3))
        standardize._c.moments(x.numpy(), shift.numpy(), mean.numpy(), var.numpy(), chunk, 1)
        assert_as_accurate(mean, truth.mean(0).float(), truth.mean(0))
        _close(var, truth.var(0, unbiased=False), REDUCTION, torch.float32)
