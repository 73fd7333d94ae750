"""kernels.topk_singular_values == reference (full svdvals) where the spectrum decays, its error
bound covers the truth where it does not, and the edge cases: low rank, zero, wide/tall, fp16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kernels.spectral as KS
import reference.spectral as RS
from correctness_tests.tolerances import REDUCTION, assert_close


def _matrix(m: int, n: int, values: torch.Tensor, seed: int, batch: tuple = ()) -> torch.Tensor:
    """U diag(values) V^T with Haar-random U (m x r), V (n x r), r = len(values)."""
    g = torch.Generator().manual_seed(seed)
    r = len(values)
    u = torch.linalg.qr(torch.randn(*batch, m, r, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(*batch, n, r, generator=g, dtype=torch.float64)).Q
    return ((u * values.double()) @ v.mT).float()


@given(m=st.integers(100, 260), n=st.integers(100, 260), k=st.integers(1, 12), ratio=st.floats(0.5, 0.9),
       batch=st.sampled_from([(), (3,)]), seed=st.integers(0, 2**16))
def test_decaying_spectrum_each_value_within_1e4_relative(m, n, k, ratio, batch, seed) -> None:
    """sigma_i = ratio^i: with q = k + max(k, 10) and 4 power iterations the k-th value's error
    scales like (sigma_q+1 / sigma_k)^9 <= (0.9^11)^9 ~ 3e-5 at worst here: 1e-4 relative (the
    iterations stop early only within SETTLED eps of that: the next test)."""
    values = ratio ** torch.arange(min(m, n), dtype=torch.float64)
    a = _matrix(m, n, values, seed, batch)
    got, err = KS.topk_singular_values(a, k, generator=torch.Generator().manual_seed(seed), return_error=True)
    want = RS.topk_singular_values(a, k)
    assert got.shape == want.shape == err.shape == (*batch, k)
    assert bool(((got - want).abs() <= 1e-4 * want).all()), ((got - want).abs() / want).max()
    assert bool((want - got <= err + 1e-6 * want[..., :1]).all()), "the bound covers the truth"
    if ratio <= 0.7:  # a steep spectrum is certified: the bound is informative, not just valid
        assert bool((err <= 1e-2 * want).all()), (err / want).max()


@given(m=st.integers(100, 260), n=st.integers(100, 260), k=st.integers(1, 12), ratio=st.floats(0.3, 0.97),
       low_rank=st.booleans(), seed=st.integers(0, 2**16))
def test_stopping_early_costs_at_most_settled_eps_an_iteration_skipped(m, n, k, ratio, low_rank, seed) -> None:
    """With the same test matrix, the values where the iterations settle (niter=None) are those of
    the iteration they stopped at (niter=j, bit for bit), and at most (4 - j) SETTLED eps (s_i +
    FLOOR s_1) under the values all 4 iterations give: the
    accuracy of the full run, which is torch.svd_lowrank's at niter=4. Low rank: a rank-6 matrix
    with its values past the rank at the rounding floor."""
    r = min(m, n, 6) if low_rank else min(m, n)
    a = _matrix(m, n, ratio ** torch.arange(r, dtype=torch.float64), seed)
    def run(niter: int | None) -> torch.Tensor:
        return KS.topk_singular_values(a, k, niter=niter, generator=torch.Generator().manual_seed(seed))
    got, full = run(None), run(KS.NITER)
    stopped_at = next(j for j in range(KS.NITER + 1) if torch.equal(run(j), got))
    eps = torch.finfo(torch.float32).eps
    behind = ((full - got) / (full + KS.FLOOR * full[0])).max().item()
    assert behind <= (KS.NITER - stopped_at) * KS.SETTLED * eps + 2 * eps, (stopped_at, behind)


def test_iterations_stop_where_the_spectrum_decays_and_not_where_it_is_flat() -> None:
    """512 x 512, top 10 (the perf test's matrix): 0.5^i settles after 1 iteration, 0.9^i after 3,
    0.95^i and a flat 1..0.5 spectrum run all 4; an explicit niter runs exactly that many."""
    def run(a: torch.Tensor, niter: int | None) -> torch.Tensor:
        return KS.topk_singular_values(a, 10, niter=niter, generator=torch.Generator().manual_seed(1))

    for ratio, stops in ((0.5, 1), (0.9, 3), (0.95, 4), (None, 4)):
        values = (torch.linspace(1, 0.5, 512, dtype=torch.float64) if ratio is None
                  else ratio ** torch.arange(512, dtype=torch.float64))
        a = _matrix(512, 512, values, 0)
        got = run(a, None)
        assert torch.equal(got, run(a, stops)), ratio
        assert all(not torch.equal(got, run(a, j)) for j in range(stops)), ratio


def test_iteration_0s_values_are_taken_only_where_iteration_1_can_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stopping rule's q x q SVDs, counted: 0.5^i takes iteration 1's and then 0's (its first
    rise can be settled) and stops; 0.9^i, whose first rise cannot be, takes only 1's, 2's and
    3's; a flat spectrum 1's (then no checks) and the last iteration's."""
    taken = []
    real = KS._values
    monkeypatch.setattr(KS, "_values", lambda r: taken.append(r) or real(r))
    for ratio, svds in ((0.5, 2), (0.9, 3), (None, 2)):
        values = (torch.linspace(1, 0.5, 512, dtype=torch.float64) if ratio is None
                  else ratio ** torch.arange(512, dtype=torch.float64))
        taken.clear()
        KS.topk_singular_values(_matrix(512, 512, values, 0), 10, generator=torch.Generator().manual_seed(1))
        assert len(taken) == svds, (ratio, len(taken))


@given(m=st.integers(100, 260), n=st.integers(100, 260), k=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_flat_spectrum_error_bound_covers_the_truth(m, n, k, seed) -> None:
    values = 1.0 / (1.0 + torch.arange(min(m, n), dtype=torch.float64) / min(m, n))  # 1 .. 0.5
    a = _matrix(m, n, values, seed)
    got, err = KS.topk_singular_values(a, k, generator=torch.Generator().manual_seed(seed), return_error=True)
    want = RS.topk_singular_values(a.double(), k)
    slack = 1e-5 * want[0]  # fp32 rounding of the estimate itself
    assert bool((got.double() <= want + slack).all()), "estimates never exceed the truth"
    assert bool((want - got.double() <= err.double() + slack).all()), (want - got, err)
    assert err.max() > 1e-3 * got[0], "a flat spectrum is flagged: the fast path is not certified there"


def test_low_rank_zero_wide_tall_and_full_k() -> None:
    exact_rank = _matrix(300, 200, torch.tensor([5.0, 3.0, 1.0]), 0)
    s, err = KS.topk_singular_values(exact_rank, 10, return_error=True)
    assert_close(s[:3], torch.tensor([5.0, 3.0, 1.0]), REDUCTION)
    assert bool((s[3:] <= 1e-5 * 5).all())
    assert bool((err <= 1e-4).all())
    zero = torch.zeros(2, 200, 150)
    s, err = KS.topk_singular_values(zero, 5, return_error=True)
    assert torch.equal(s, torch.zeros(2, 5))
    assert torch.equal(err, torch.zeros(2, 5))
    empty = torch.randn(0, 200, 200)  # an empty batch: (0, k), the iterations' checks skipped
    assert KS.topk_singular_values(empty, 10).shape == (0, 10)
    for m, n in ((120, 400), (400, 120)):  # wide and tall, decaying spectra
        a = _matrix(m, n, 0.8 ** torch.arange(120, dtype=torch.float64), m)
        assert_close(KS.topk_singular_values(a, 10), RS.topk_singular_values(a, 10), REDUCTION)
    a = torch.randn(130, 110)
    s, err = KS.topk_singular_values(a, 110, return_error=True)  # k = min(m, n): exact
    assert_close(s, torch.linalg.svdvals(a), REDUCTION)
    assert torch.equal(err, torch.zeros(110))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_computed_in_fp32(dtype) -> None:
    a = _matrix(256, 256, 0.8 ** torch.arange(256, dtype=torch.float64), 3).to(dtype)
    s = KS.topk_singular_values(a, 10)
    assert s.dtype == dtype
    want = torch.linalg.svdvals(a.float())[:10]
    assert_close(s.float(), want, REDUCTION, dtype=dtype)


def test_generator_makes_it_reproducible() -> None:
    a = torch.randn(300, 300)
    one = KS.topk_singular_values(a, 10, generator=torch.Generator().manual_seed(5))
    two = KS.topk_singular_values(a, 10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one, two)


@pytest.mark.parametrize("side", [KS, RS])
def test_bad_input_is_refused(side) -> None:
    a = torch.randn(20, 30)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 20\]"):
        side.topk_singular_values(a, 21)
    with pytest.raises(ValueError, match="k must be"):
        side.topk_singular_values(a, 0)
    with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
        side.topk_singular_values(torch.randn(5), 1)
    with pytest.raises(TypeError, match="floating-point"):
        side.topk_singular_values(torch.ones(4, 4, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="NaN or inf"):
        side.topk_singular_values(a.index_fill(0, torch.tensor([3]), float("nan")), 2)
    with pytest.raises(ValueError, match="oversample must be"):
        side.topk_singular_values(a, 2, oversample=-1)
    if side is KS:  # the reference's torch.linalg refuses it with torch's own words
        with pytest.raises(TypeError, match="A must be a dense tensor"):  # the randomized path took it before
            side.topk_singular_values(torch.randn(200, 200).to_sparse(), 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [(0, 0), (299, 199), (150, 7)])
def test_randomized_path_refuses_nan_and_inf(bad: float, where: tuple[int, int]) -> None:
    """The randomized path checks A @ G, not A: one bad entry anywhere, in a batch too, is refused."""
    a = torch.randn(3, 300, 200)
    a[1, where[0], where[1]] = bad
    for m in (a, a.mT):  # both orientations (the wide one is transposed first)
        with pytest.raises(ValueError, match="NaN or inf"):
            KS.topk_singular_values(m, 10)
        with pytest.raises(ValueError, match="NaN or inf"):
            KS.spectral_features(m)


@pytest.mark.parametrize("dtype, scales", [(torch.float32, (1e-30, 1e-20, 1e20, 1e30)),
                                           (torch.float64, (1e-170, 1e150))])
def test_the_error_bound_holds_at_any_scale(dtype, scales) -> None:
    """The bound scales with A: no square to underflow to a negative bound (tiny A) or overflow
    to inf or NaN (huge A); the values and bounds of c A are c times those of A."""
    a = _matrix(200, 200, 0.8 ** torch.arange(200, dtype=torch.float64), 4).to(dtype)
    g = torch.Generator()
    s1, e1 = KS.topk_singular_values(a, 3, generator=g.manual_seed(0), return_error=True)
    assert bool((e1 > 0).all())
    for c in scales:
        s, err = KS.topk_singular_values(a * c, 3, generator=g.manual_seed(0), return_error=True)
        assert bool(torch.isfinite(err).all() and (err > 0).all()), (c, err)
        assert_close(s.double() / c, s1.double(), REDUCTION, dtype=dtype)
        assert_close(err.double() / c, e1.double(), REDUCTION, dtype=dtype)
        want = torch.linalg.svdvals((a * c).double())[:3]
        assert bool((want - s.double() <= err.double() + 1e-5 * want[0]).all())


def test_a_finite_a_whose_product_overflows_is_told_apart_from_nan() -> None:
    huge = torch.randn(200, 200) * 1e37  # finite; A @ G passes float32's largest
    with pytest.raises(ValueError, match=r"A is finite, but A @ G overflows torch.float32.*float64"):
        KS.topk_singular_values(huge, 3)
    assert torch.isfinite(KS.topk_singular_values(huge.double(), 3)).all()


def test_layers_with_other_batch_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"weights' layers must share their leading \(batch\) dims"):
        KS.spectral_features([torch.randn(2, 120, 120), torch.randn(3, 120, 120)])


def test_features_of_a_known_spectrum() -> None:
    """diag(4, 2, 1, 0...): 10 values, their shares, gaps, entropy, s_1 / s_10, sum."""
    a = torch.diag(torch.tensor([4.0, 2.0, 1.0] + [0.0] * 9, dtype=torch.float64))
    f = KS.spectral_features(a)
    assert f.shape == (32,)
    s = torch.tensor([4.0, 2.0, 1.0] + [0.0] * 7, dtype=torch.float64)
    share = s / (7 + 1e-8)
    torch.testing.assert_close(f[:10], s)
    torch.testing.assert_close(f[10:20], share)
    torch.testing.assert_close(f[20:22], torch.tensor([0.5, 0.5], dtype=torch.float64), atol=1e-7, rtol=0)
    torch.testing.assert_close(f[29], -(share * torch.log(share + 1e-8)).sum())
    torch.testing.assert_close(f[30], torch.tensor(4.0 / 1e-8, dtype=torch.float64))
    torch.testing.assert_close(f[31], torch.tensor(7.0, dtype=torch.float64))


@given(r=st.integers(1, 16), shapes=st.lists(st.tuples(st.integers(4, 200), st.integers(4, 200)), min_size=1,
                                             max_size=3), seed=st.integers(0, 2**16))
def test_features_follow_values_that_match_reference_within_the_bound(r, shapes, seed) -> None:
    """LoRA-like layers (rank r update plus noise), batched. The features are the original's formulas
    applied to the kernel's values (checked exactly), and those values are the reference's within
    the returned error bound. Features that divide by noise-floor values (gaps past rank r, s_1 /
    s_10) are as uncertain as those values, so they are not compared with the reference."""
    g = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(2, m, r, generator=g) @ torch.randn(2, r, n, generator=g) / r
               + 1e-3 * torch.randn(2, m, n, generator=g)) for m, n in shapes]
    got = KS.spectral_features(layers, generator=torch.Generator().manual_seed(seed))
    want = RS.spectral_features(layers)
    assert got.shape == want.shape == (2, 32 * len(shapes))
    gen = torch.Generator().manual_seed(seed)
    for i, w in enumerate(layers):
        k = min(10, *w.shape[-2:])
        s, err = KS.topk_singular_values(w, k, generator=gen, return_error=True)
        s = KS._pad(s, 10)
        torch.testing.assert_close(got[:, 32 * i : 32 * i + 32], KS.features_from_values(s))
        true = want[:, 32 * i : 32 * i + 10]
        assert bool(((true - s).abs() <= KS._pad(err, 10) + 1e-5 * true[:, :1]).all())
        signal = slice(32 * i, 32 * i + min(r, k))  # the values above the noise floor
        assert_close(got[:, signal], want[:, signal], REDUCTION, scale=true[:, 0].max().item())


def test_a_generator_or_a_layer_of_another_type_is_refused_by_name() -> None:
    """torch's randn said 'invalid combination of arguments' for a seed given as generator=, and a
    list with a non-tensor layer was told its layers' batch dims differ."""
    a = torch.randn(200, 150)
    with pytest.raises(TypeError, match="generator must be a torch.Generator .* got int"):
        KS.topk_singular_values(a, 10, generator=0)
    with pytest.raises(TypeError, match=r"weights\[1\] is a str, not a tensor"):
        KS.spectral_features([torch.randn(2, 5, 5), "x"])


def test_the_error_bound_is_sqrt_of_s_squared_plus_the_tail_squared_minus_s() -> None:
    """err_i = sqrt(s_i^2 + ||R||_F^2) - s_i, R = A - QB. With oversample 0, s holds all q values of
    B = Q^T A, so ||R||_F^2 = ||A||_F^2 - sum(s^2) (Q^T R = 0): the bound from A alone, in fp64."""
    a = torch.randn(200, 150, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s, err = KS.topk_singular_values(a, 5, oversample=0, niter=1, generator=torch.Generator().manual_seed(1),
                                     return_error=True)
    tail2 = a.square().sum() - s.square().sum()
    assert bool((err > 0).all())
    assert_close(err, (s.square() + tail2).sqrt() - s, REDUCTION)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_error_bound_covers_the_rounding_to_half_precision(dtype) -> None:
    """fp16/bf16 A is computed in fp32 and its values rounded back: the bound adds that rounding,
    which on a steep spectrum (3.3 x 0.5^i) is far larger than the fp32 estimate's own error."""
    a = _matrix(200, 150, 3.3 * 0.5 ** torch.arange(150, dtype=torch.float64), 5).to(dtype)
    s, err = KS.topk_singular_values(a, 5, generator=torch.Generator().manual_seed(0), return_error=True)
    assert s.dtype == err.dtype == dtype
    want = torch.linalg.svdvals(a.double())[:5]
    assert bool(((want - s.double()).abs() <= err.double()).all()), (want - s.double(), err)


def test_the_exact_path_takes_q_at_half_of_min_m_n() -> None:
    """q = k + max(k, 10): at 2q = min(m, n) (k = 25 of 120 x 100) the exact svdvals, error 0; at
    k = 24 (2q = 96) the randomized path, with a nonzero bound."""
    a = torch.randn(120, 100, generator=torch.Generator().manual_seed(0))
    s, err = KS.topk_singular_values(a, 25, generator=torch.Generator().manual_seed(1), return_error=True)
    assert torch.equal(s, torch.linalg.svdvals(a)[:25])
    assert torch.equal(err, torch.zeros(25))
    s, err = KS.topk_singular_values(a, 24, generator=torch.Generator().manual_seed(1), return_error=True)
    want = torch.linalg.svdvals(a.double())[:24]
    assert bool((err > 0).all())
    assert bool((want - s.double() <= err.double() + 1e-5 * want[0]).all()), "the bound covers the truth"


def test_features_of_a_full_known_spectrum_equal_reference() -> None:
    """diag(10, 9, ..., 1): no zero values, so every feature, s_1 / s_10 = 10 included, is compared."""
    a = torch.diag(torch.arange(10, 0, -1, dtype=torch.float64))
    f = KS.spectral_features(a)
    assert f.shape == (32,)
    assert_close(f, RS.spectral_features(a), REDUCTION)
    torch.testing.assert_close(f[30], torch.tensor(10 / (1 + 1e-8), dtype=torch.float64))
