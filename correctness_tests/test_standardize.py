"""kernels.Standardizer == scikit-learn's StandardScaler (reference.standardize): statistics,
transform, inverse; chunked partial_fit == one fit; offsets, constant columns, n=1, fp16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from correctness_tests.tolerances import ELEMENTWISE, REDUCTION, assert_as_accurate, assert_close
from kernels.standardize import Standardizer
from reference.standardize import Standardizer as Reference


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


@given(data())
def test_fit_transform_inverse_equal_sklearn(x: torch.Tensor) -> None:
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


@given(data(), st.lists(st.integers(1, 299), max_size=4))
def test_chunked_partial_fit_equals_one_fit(x: torch.Tensor, cuts: list[int]) -> None:
    bounds = sorted({c for c in cuts if c < x.shape[0]} | {0, x.shape[0]})
    chunked = Standardizer()
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_fp32(dtype) -> None:
    x = (10 + 3 * torch.randn(20000, 6)).to(dtype)
    s = Standardizer().fit(x)
    want = Reference().fit(x.double())
    assert s.mean_.dtype == torch.float32
    _close(s.mean_, want.mean_, REDUCTION, torch.float32)
    _close(s.var_, want.var_, REDUCTION, torch.float32)
    assert s.transform(x).dtype == dtype


def test_bad_input_is_refused() -> None:
    s = Standardizer()
    with pytest.raises(RuntimeError, match="not fitted"):
        s.transform(torch.randn(3, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        s.fit(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        s.fit(torch.randn(5))
    with pytest.raises(TypeError, match="floating point"):
        s.fit(torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="no samples"):
        s.fit(torch.randn(0, 3))
    s.fit(torch.randn(4, 3))
    with pytest.raises(ValueError, match="has 2 features, the standardizer was fitted on 3"):
        s.transform(torch.randn(4, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        s.transform(torch.tensor([[1.0, float("inf"), 0.0]]))
    with pytest.raises(ValueError, match="NaN or inf"):
        s.partial_fit(torch.tensor([[1.0, float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="fitted statistics on cpu"):
        s.partial_fit(torch.randn(4, 3, device="meta"))
    assert s.fit(torch.randn(4, 3)) is s


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
                         (torch.empty(4, 20).T, "contiguous"), ([1.0], "must be a Tensor")):
        with pytest.raises((ValueError, TypeError), match=message):
            scaler.transform(x, out=out)
    with pytest.raises(ValueError, match="float32 or float64"):
        scaler16 = Standardizer().fit(x.half())
        scaler16.transform(x.half(), out=torch.empty_like(x.half()))
