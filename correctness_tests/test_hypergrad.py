"""kernels.darts_hypergradient against the exact hypergradient of the same unrolled step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from correctness_tests.tolerances import ELEMENTWISE, FINITE_DIFFERENCE, REDUCTION, assert_close
from kernels.hypergrad import darts_hypergradient, reweighted_loss
from reference.hypergrad import exact_hypergradient
from workloads.meta_reweight import MetaWeightNet


def _flat(ts: list[Tensor]) -> Tensor:
    return torch.cat([t.flatten() for t in ts])


def _rel(a: list[Tensor], b: list[Tensor]) -> float:
    return ((_flat(a) - _flat(b)).norm() / _flat(b).norm()).item()


def problem(dtype=torch.float64, hidden=16, batch=32, meta=20, lr=0.5, seed=0, act=nn.Tanh, held=True,
            reused=False):
    """A smooth MLP classifier stepped once on the Meta-Weight-Net loss: (model, inner, outer, W, theta).
    ``reused``: its hidden layer applied twice, one module under two names."""
    torch.manual_seed(seed)
    hidden_layers = [nn.Linear(5, hidden), act()]
    if reused:
        layer = nn.Linear(hidden, hidden)
        hidden_layers += [layer, act(), layer, act()]
    model = nn.Sequential(*hidden_layers, nn.Linear(hidden, 3)).to(dtype)
    w = MetaWeightNet().to(dtype)
    x, y = torch.randn(batch, 5, dtype=torch.float64).to(dtype), torch.randint(0, 3, (batch,))
    xm, ym = torch.randn(meta, 5, dtype=torch.float64).to(dtype), torch.randint(0, 3, (meta,))
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    l0 = F.cross_entropy(model(x), y, reduction="none").detach()
    inner = lambda f: reweighted_loss(F.cross_entropy(f(x), y, reduction="none"), w, l0 if held else None)
    outer = lambda f: F.cross_entropy(f(xm), ym)
    grads = torch.autograd.grad(inner(model), list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p -= lr * g
    return model, inner, outer, w, theta, lr


def test_truncation_error_falls_as_alpha_squared() -> None:
    """Central difference: error O(eps^2); fp64 so rounding stays out of the way."""
    model, inner, outer, w, theta, lr = problem()
    exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    errors = [_rel(darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, alpha=a, at=theta), exact)
              for a in (1e-1, 1e-2, 1e-3)]
    for big, small in zip(errors, errors[1:], strict=False):
        assert 50 < big / small < 200, errors  # 100x per decade of alpha
    assert errors[1] < 1e-4 and errors[2] < 1e-6


def test_fp32_within_the_difference_budget() -> None:
    """fp32 FD against the fp64 exact hypergradient: truncation plus rounding / eps."""
    model, inner, outer, w, theta, lr = problem(torch.float64)
    exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    model32, inner32, outer32, w32, theta32, _ = problem(torch.float32)
    fd = darts_hypergradient(model32, inner32, outer32, w32.parameters(), lr=lr, at=theta32)
    scale = _flat(exact).abs().max().item()
    for got, want in zip(fd, exact, strict=True):
        assert_close(got.double(), want, FINITE_DIFFERENCE, scale=scale, dtype=torch.float32)
    # truncation wins at large alpha, rounding / eps at small: the default 0.01 sits between
    # (measured 1.5e-3, 9.7e-5, 6.5e-4 of the largest element at alpha 0.1, 0.01, 0.001)
    err = {a: (_flat(darts_hypergradient(model32, inner32, outer32, w32.parameters(), lr=lr, alpha=a, at=theta32))
               .double() - _flat(exact)).abs().max().item() / scale for a in (1e-1, 1e-2, 1e-3)}
    assert err[1e-2] < err[1e-1] / 5 and err[1e-2] < err[1e-3] / 3, err


def test_eps_is_alpha_over_the_norm_of_v() -> None:
    """eps = alpha / |v| makes the perturbation alpha v / |v| independent of v's scale, so scaling
    the outer loss by c scales the result by c to rounding (with eps = alpha it would not: the
    truncation error would change with c)."""
    model, inner, outer, w, theta, lr = problem()
    one = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    big = darts_hypergradient(model, inner, lambda f: 1000.0 * outer(f), w.parameters(), lr=lr, at=theta)
    assert _rel([b / 1000.0 for b in big], one) < 1e-12


def test_bf16_v_pass_is_within_bf16_rounding() -> None:
    """autocast_dtype=bfloat16 computes v in bf16 (its direction off by bf16 rounding); the
    differences stay fp32."""
    model64, inner64, outer64, w64, theta64, lr = problem(torch.float64)
    exact = exact_hypergradient(model64, inner64, outer64, w64.parameters(), lr=lr, at=theta64)
    model, inner, outer, w, theta, _ = problem(torch.float32)
    fd = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta, autocast_dtype=torch.bfloat16)
    scale = _flat(exact).abs().max().item()
    for got, want in zip(fd, exact, strict=True):
        assert_close(got.double(), want, REDUCTION, scale=scale, dtype=torch.bfloat16)
    assert _rel(fd, exact) > 1e-4  # the bf16 pass did run: fp32 alone is ~1e-5 off


def test_reweighted_loss_is_the_weighted_mean() -> None:
    w = MetaWeightNet()
    losses = torch.rand(7, requires_grad=True)
    held = torch.rand(7)
    expected = (w(held[:, None])[:, 0] * losses).mean()
    torch.testing.assert_close(reweighted_loss(losses, w, held), expected)
    torch.testing.assert_close(reweighted_loss(losses, w), (w(losses.detach()[:, None])[:, 0] * losses).mean())
    (g,) = torch.autograd.grad(reweighted_loss(losses, w, held), losses)  # W's input carries no gradient
    torch.testing.assert_close(g, w(held[:, None])[:, 0].detach() / 7)


def test_weight_inputs_that_require_grad_carry_no_gradient() -> None:
    """weight_inputs=losses themselves (requiring grad): W's output is a constant of them, so
    d/dl = W(l) / B, with no term through W's input."""
    w = MetaWeightNet()
    losses = torch.rand(7, requires_grad=True)
    (g,) = torch.autograd.grad(reweighted_loss(losses, w, weight_inputs=losses), losses)
    assert_close(g, w(losses.detach()[:, None])[:, 0].detach() / 7, ELEMENTWISE)


def test_moving_the_weights_inputs_biases_the_difference() -> None:
    """W(l.detach()): the exact step has no gradient through W's input, but l's VALUE moves with
    theta; a difference that lets it move (Betty's literal evaluation) is off by O(1) at every alpha."""
    model, inner, outer, w, theta, lr = problem(held=False)
    exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    for alpha in (1e-1, 1e-2, 1e-3):
        fd = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, alpha=alpha, at=theta)
        assert _rel(fd, exact) > 0.1


def test_betty_point_is_first_order_in_lr() -> None:
    """at=None takes the mixed derivative at theta' (Betty): off by O(lr), shrinking with lr."""
    errors = []
    for lr in (0.5, 0.05):
        model, inner, outer, w, theta, _ = problem(lr=lr)
        exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
        errors.append(_rel(darts_hypergradient(model, inner, outer, w.parameters(), lr=lr), exact))
    assert errors[0] > 1e-3 and 5 < errors[0] / errors[1] < 20, errors


@settings(max_examples=12, deadline=None)
@given(hidden=st.integers(1, 24), batch=st.integers(2, 40), meta=st.integers(1, 30),
       lr=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
def test_matches_exact_on_random_problems(hidden: int, batch: int, meta: int, lr: float, seed: int) -> None:
    model, inner, outer, w, theta, lr = problem(hidden=hidden, batch=batch, meta=meta, lr=lr, seed=seed)
    exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    fd = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, alpha=1e-3, at=theta)
    scale = max(_flat(exact).abs().max().item(), 1e-300)
    for got, want in zip(fd, exact, strict=True):
        assert_close(got, want, FINITE_DIFFERENCE, scale=scale)


def test_micro_batches_average_to_the_whole_batch() -> None:
    model, _, _, w, theta, lr = problem()
    x, y = torch.randn(24, 5, dtype=torch.float64), torch.randint(0, 3, (24,))
    l0 = F.cross_entropy(model(x), y, reduction="none").detach()
    inner = lambda xs, ys, ls: lambda f: reweighted_loss(F.cross_entropy(f(xs), ys, reduction="none"), w, ls)
    outer = lambda xs, ys: lambda f: F.cross_entropy(f(xs), ys)
    whole = darts_hypergradient(model, inner(x, y, l0), outer(x, y), w.parameters(), lr=lr, at=theta)
    parts = darts_hypergradient(model, [inner(*c) for c in zip(x.chunk(4), y.chunk(4), l0.chunk(4), strict=True)],
                                [outer(*c) for c in zip(x.chunk(3), y.chunk(3), strict=True)], w.parameters(),
                                lr=lr, at=theta)
    for a, b in zip(parts, whole, strict=True):
        assert_close(a, b, REDUCTION, scale=_flat(whole).abs().max().item())


def test_a_micro_batch_that_does_not_reach_w_adds_zero() -> None:
    """An inner micro-batch that is not reweighted (its loss does not reach w) adds nothing to
    the hypergradient, as in the exact one (autograd refused the kernel's call before: the
    review's case); alone, it gives zeros. Under no_grad both sides give the same."""
    model, inner, outer, w, theta, lr = problem()
    xb, yb = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    plain = lambda f: F.cross_entropy(f(xb), yb)  # noqa: E731
    for closures in ([inner, plain], plain):
        exact = exact_hypergradient(model, closures, outer, w.parameters(), lr=lr, at=theta)
        fd = darts_hypergradient(model, closures, outer, w.parameters(), lr=lr, at=theta)
        scale = max(_flat(exact).abs().max().item(), 1e-30)
        for got, want in zip(fd, exact, strict=True):
            assert_close(got, want, FINITE_DIFFERENCE, scale=scale)
    assert all(bool((g == 0).all()) for g in fd)  # the plain micro-batch alone
    halved = darts_hypergradient(model, [inner, plain], outer, w.parameters(), lr=lr, at=theta)
    full = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    for a, b in zip(halved, full, strict=True):  # the mean of two micro-batches, one of them zero
        assert_close(a, b / 2, REDUCTION, scale=_flat(full).abs().max().item())
    with torch.no_grad():
        fd = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
        exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    for a, b in zip(fd, full, strict=True):
        assert torch.equal(a, b)
    for got, want in zip(fd, exact, strict=True):
        assert_close(got, want, FINITE_DIFFERENCE, scale=_flat(exact).abs().max().item())


def test_leaves_the_module_untouched() -> None:
    """Parameters, BatchNorm running statistics and .grad are as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    w = MetaWeightNet()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model(x).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    darts_hypergradient(model, lambda f: reweighted_loss(F.cross_entropy(f(x), y, reduction="none"), w),
                        lambda f: F.cross_entropy(f(x), y), w.parameters(), lr=0.1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(p.grad is None for p in w.parameters())


def test_a_layer_registered_twice_keeps_its_parameters() -> None:
    """One Linear applied twice under two names in the inner model: both the kernel and the
    reference leave the model holding its own Parameters (torch's functional_call, left to itself,
    put the perturbed tensors in their place), and they agree, as on any other model."""
    model, inner, outer, w, theta, lr = problem(reused=True)
    own = dict(model.named_parameters(remove_duplicate=False))
    fd = darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    assert all(q is own[n] for n, q in model.named_parameters(remove_duplicate=False))
    exact = exact_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)
    assert all(q is own[n] for n, q in model.named_parameters(remove_duplicate=False))
    scale = _flat(exact).abs().max().item()
    for got, want in zip(fd, exact, strict=True):
        assert_close(got, want, FINITE_DIFFERENCE, scale=scale)


def test_flat_outer_loss_gives_zero_and_nan_is_refused() -> None:
    model, inner, _, w, theta, lr = problem()
    zero = darts_hypergradient(model, inner, lambda f: f(torch.zeros(1, 5, dtype=torch.float64)).sum() * 0,
                               w.parameters(), lr=lr, at=theta)
    assert all(bool((g == 0).all()) for g in zero)
    with pytest.raises(FloatingPointError, match="not finite"):
        darts_hypergradient(model, inner, lambda f: f(torch.full((1, 5), math.nan, dtype=torch.float64)).sum(),
                            w.parameters(), lr=lr, at=theta)


def test_bad_input_is_refused() -> None:
    model, inner, outer, w, theta, lr = problem()
    with pytest.raises(ValueError, match="empty outer set"):
        darts_hypergradient(model, inner, [], w.parameters(), lr=lr)
    with pytest.raises(ValueError, match="one weight per sample"):
        reweighted_loss(torch.rand(8), nn.Linear(1, 2))
    with pytest.raises(ValueError, match=r"losses must be a tensor of shape \(B,\) \(per-sample losses\)"):
        reweighted_loss(torch.rand(8, 2), w)
    with pytest.raises(ValueError, match="one device"):
        darts_hypergradient(model, inner, outer, MetaWeightNet().to("meta").parameters(), lr=lr)
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, alpha=math.inf)
    with pytest.raises(ValueError, match="at is missing"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at={})
    with pytest.raises(TypeError, match=r"at\['0.weight'\] must be a tensor"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at={**theta, "0.weight": [[0.0]]})
    with pytest.raises(ValueError, match="scalar"):
        darts_hypergradient(model, inner, lambda f: f(torch.zeros(2, 5, dtype=torch.float64)), w.parameters(),
                            lr=lr)
    with pytest.raises(ValueError, match="outer_params"):
        darts_hypergradient(model, inner, outer, [], lr=lr)
    with pytest.raises(ValueError, match="autocast_dtype"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, autocast_dtype=torch.float16)
    with pytest.raises(TypeError, match="inner must be a torch.nn.Module"):
        darts_hypergradient(lambda x: x, inner, outer, w.parameters(), lr=lr)


@pytest.mark.parametrize("scale", [1e-40, 1e-25, 1e40, 1e-170, 1e170])
def test_v_of_any_size_is_measured_in_float64(scale: float) -> None:
    """eps = alpha / |v|: |v| taken in fp32 read 0 for a small fp64 v (the result zeros, as if
    the outer loss were flat) and inf for a large one (refused as not finite); an fp64 v of 1e-170
    (1e170) has squares that underflow (overflow) fp64 itself, so its norm is taken over its
    largest magnitude. The results are compared at their own scale."""
    model, inner, outer, w, theta, lr = problem()
    scaled = lambda f: scale * outer(f)  # noqa: E731
    exact = exact_hypergradient(model, inner, scaled, w.parameters(), lr=lr, at=theta)
    got = darts_hypergradient(model, inner, scaled, w.parameters(), lr=lr, at=theta)
    size = _flat(exact).abs().max()
    assert size > 0
    assert _rel([g / size for g in got], [e / size for e in exact]) < 1e-4


def test_at_of_another_dtype_or_shape_is_refused() -> None:
    """theta given in fp64 for fp32 parameters (or of another shape) is refused by name, before any
    product of mismatched dtypes."""
    model, inner, outer, w, theta, lr = problem(torch.float32)
    for n, bad in (("0.weight", theta["0.weight"].double()), ("2.bias", theta["2.bias"][:2])):
        with pytest.raises(ValueError, match=rf"at\['{n}'\] must match the parameter's shape, dtype and device"):
            darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at={**theta, n: bad})
    wide = {n: t.double() for n, t in theta.items()}
    with pytest.raises(ValueError, match=r"at\['0.weight'\] must match the parameter's shape, dtype and device"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=wide)


def test_live_dropout_draws_the_same_masks_at_both_points() -> None:
    """Different masks at theta +- eps v would add their difference / (2 eps) to the result."""
    model, inner, outer, w, theta, lr = problem()
    drop = nn.Dropout(0.5).train()
    held = lambda f: inner(lambda x: drop(f(x)))  # noqa: E731
    results = []
    for a in (1e-2, 1e-4):  # one mask draw for both: the results differ by the truncation only
        torch.manual_seed(7)
        results.append(_flat(darts_hypergradient(model, held, outer, w.parameters(), lr=lr, alpha=a, at=theta)))
    assert ((results[0] - results[1]).norm() / results[0].norm()).item() < 1e-3  # no 1/alpha noise


def test_a_tensor_as_outer_params_and_half_precision_inner_parameters_are_refused() -> None:
    model, inner, outer, w, theta, lr = problem()
    with pytest.raises(TypeError, match=r"got a Tensor; pass \[w\]"):
        darts_hypergradient(model, inner, outer, w.net[0].weight, lr=lr, at=theta)
    model, inner, outer, w, theta, lr = problem(torch.bfloat16)
    with pytest.raises(TypeError, match=r"inner parameter '0.weight' is torch.bfloat16.*fp32 or fp64"):
        darts_hypergradient(model, inner, outer, w.parameters(), lr=lr, at=theta)


def test_outer_params_inside_the_inner_model_are_refused() -> None:
    """DARTS's architecture weights kept as a parameter of the inner model, passed as outer_params:
    each was perturbed as theta and held fixed as w at once, and its hypergradient came back zero
    (0.0113 exact); alone it raised autograd's 'does not require grad'."""
    model, inner, outer, w, theta, lr = problem()
    model.alpha = nn.Parameter(torch.zeros(2, dtype=next(model.parameters()).dtype))
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    for outer_params in ([model.alpha, *w.parameters()], [model.alpha]):
        with pytest.raises(ValueError, match=r"outer_params\[0\] is inner's parameter 'alpha'"):
            darts_hypergradient(model, inner, outer, outer_params, lr=lr, at=theta)
