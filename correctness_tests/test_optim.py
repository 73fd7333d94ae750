"""kernels.adamw/sgd (torch optimizers, fused or foreach) == reference per-parameter loops, over 10 steps."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kernels
import reference
from correctness_tests.tolerances import ELEMENTWISE, assert_as_accurate, assert_close
from kernels import optim

STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@st.composite
def problems(draw: st.DrawFn, dtypes=(torch.float32, torch.float64, torch.bfloat16)) -> dict:
    """Parameter shapes (zero-size included), layouts, missing grads, groups and hyperparameters."""
    kind = draw(st.sampled_from(["adamw", "sgd"]))
    dtype = draw(st.sampled_from(dtypes))
    shapes = draw(st.lists(st.sampled_from([(7,), (3, 5), (4, 1, 6), (0,), (3, 0), (1,)]),
                           min_size=1, max_size=6))
    transposed = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    no_grad = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    groups = draw(st.integers(1, min(3, len(shapes))))
    if kind == "adamw":
        hyper = dict(lr=draw(st.sampled_from([1e-3, 1e-2])), betas=(0.9, draw(st.sampled_from([0.999, 0.99]))),
                     eps=1e-8, weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.1])))
    else:
        nesterov = draw(st.booleans())
        momentum = st.just(0.9) if nesterov else st.sampled_from([0.0, 0.9])
        hyper = dict(lr=draw(st.sampled_from([1e-2, 0.1])), momentum=draw(momentum),
                     dampening=0.0 if nesterov else draw(st.sampled_from([0.0, 0.1])),
                     weight_decay=draw(st.sampled_from([0.0, 1e-4])), nesterov=nesterov)
    return dict(kind=kind, dtype=dtype, shapes=shapes, transposed=transposed, no_grad=no_grad,
                groups=groups, hyper=hyper, seed=draw(st.integers(0, 2**16)))


def _params(p: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(p["seed"])
    out = []
    for shape, t in zip(p["shapes"], p["transposed"], strict=True):
        x = torch.randn(shape[::-1] if t else shape, generator=gen, dtype=torch.float64)
        x = x.permute(*reversed(range(x.ndim))) if t else x  # non-contiguous leaf when transposed
        out.append(x.to(dtype).requires_grad_())
    return out


def _run(side, p: dict, dtype: torch.dtype, steps: int = 10) -> tuple[list, torch.optim.Optimizer]:
    params = _params(p, dtype)
    n = p["groups"]
    groups = [{"params": params[i::n], "lr": p["hyper"]["lr"] * (i + 1)} for i in range(n)]
    opt = getattr(side, p["kind"])(groups, **p["hyper"])
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    for _ in range(steps):
        for q, skip in zip(params, p["no_grad"], strict=True):
            g = torch.randn(q.shape, generator=gen, dtype=torch.float64)
            q.grad = None if skip else g.to(dtype)
        opt.step()
    return params, opt


@given(problems())
def test_ten_steps_match_reference(p: dict) -> None:
    """Element by element, at the scale of the steps' terms: a value that cancels to 1e-3 (a
    parameter of size 1 stepped towards 0, a momentum of gradients of opposite signs) keeps
    their rounding, 1e-7 in fp32 after 10 steps, where its own size would allow 3e-8."""
    got, opt_k = _run(kernels, p, p["dtype"])
    want, opt_r = _run(reference, p, p["dtype"])
    # the terms of every step (parameters and gradients, drawn from N(0, 1)) are of size 1
    def scale(t: torch.Tensor) -> float:
        return max(1.0, t.detach().abs().max().item() if t.numel() else 0.0)

    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a.detach(), b.detach(), ELEMENTWISE, msg="parameter", scale=scale(b))
        sk, sr = opt_k.state.get(a, {}), opt_r.state.get(b, {})
        assert bool(sk) == bool(sr), "state exists on one side only"
        for key in STATE_KEYS[p["kind"]]:
            if key in sr:
                assert_close(sk[key], sr[key], ELEMENTWISE, msg=key, scale=scale(sr[key]))
        if "step" in sr:
            assert float(sk["step"]) == float(sr["step"])


@given(problems(dtypes=(torch.bfloat16,)))
def test_bf16_is_as_accurate_as_the_reference(p: dict) -> None:
    """Both bf16 sides against the same steps in fp64: the fused kernel (fp32 math inside) is
    no less accurate than the bf16 loop."""
    got, _ = _run(kernels, p, torch.bfloat16)
    want, _ = _run(reference, p, torch.bfloat16)
    exact, _ = _run(reference, p, torch.float64)
    for a, b, e in zip(got, want, exact, strict=True):
        if e.numel():
            assert_as_accurate(a.detach(), b.detach(), e.detach())


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_grad_layout_unlike_the_parameter(kind: str) -> None:
    """torch's fused step mis-indexes a grad whose strides differ from its parameter's; the
    kernel must not (the loop is the judge)."""
    def run(side) -> torch.Tensor:
        w = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).t().requires_grad_()
        opt = getattr(side, kind)([w], lr=0.1, **({"momentum": 0.9} if kind == "sgd" else {}))
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            w.grad = torch.randn(3, 5, generator=gen)  # contiguous, the parameter is not
            opt.step()
        return w.detach()

    assert_close(run(kernels), run(reference), ELEMENTWISE)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_cpu_choice_is_fused(kind: str) -> None:
    opt = getattr(kernels, kind)([torch.zeros(3, requires_grad=True)])
    assert opt.defaults["fused"] is True


@pytest.mark.parametrize(("kind", "fused"), [("adamw", True), ("sgd", False)])
def test_cuda_choice_is_fused_adamw_and_foreach_sgd(kind: str, fused: bool) -> None:
    """On CUDA, fused AdamW (guarded) and torch's foreach SGD (no guard to run), as measured: the
    choice is read from the parameters' device, so fake CUDA tensors show it without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        params = [torch.zeros(shape, device="cuda", requires_grad=True) for shape in ((4, 3), (3,))]
        opt = getattr(kernels, kind)(params)
        assert bool(opt.defaults["fused"]) is fused and bool(opt.defaults["foreach"]) is not fused
        assert len(opt._optimizer_step_pre_hooks) == (1 if fused else 0)
        strided = [torch.zeros(4, 6, device="cuda")[:, ::2]]  # fused never; foreach takes it
        assert optim.implementation(kind, strided) == ({} if fused else {"foreach": True})


def test_sgd_momentum_with_dampening_is_not_fused() -> None:
    """Its first step's buffer (the gradient) is no zero buffer's update: torch's default runs it."""
    w = torch.zeros(3, requires_grad=True)
    assert not kernels.sgd([w], momentum=0.9, dampening=0.1).defaults["fused"]
    assert not kernels.sgd([{"params": [w], "dampening": 0.1}], momentum=0.9).defaults["fused"]
    assert kernels.sgd([w], momentum=0.0, dampening=0.1).defaults["fused"]


def test_dampening_in_a_later_group_is_stepped_as_the_reference_steps_it() -> None:
    """Dampening set only in the second group: no group is fused (the fused step cannot take it),
    and both groups step as the reference's do."""
    def run(side) -> list[torch.Tensor]:
        torch.manual_seed(0)
        a, b = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
        opt = side.sgd([{"params": [a]}, {"params": [b], "dampening": 0.5}], lr=0.1, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            ((a * torch.arange(3.0)).sum() + (b ** 2).sum()).backward()
            opt.step()
        return [a, b] if side is reference else [a, b, opt]

    a, b, opt = run(kernels)
    assert not opt.defaults["fused"]
    for got, want in zip((a, b), run(reference), strict=True):
        assert_close(got.detach(), want.detach(), ELEMENTWISE, msg="parameter")


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_grad_scaler_skips_steps_with_inf_gradients(side, kind: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    opt = getattr(side, kind)([w], lr=0.1, **({"momentum": 0.9} if kind == "sgd" else {}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(5, 4)
    scaler.scale((x @ w).square().mean()).backward()
    scaler.step(opt)  # a finite step first, so the state exists
    scaler.update()
    before = w.detach().clone()
    state_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[w].items()}
    opt.zero_grad()
    scaler.scale((x @ w).square().mean() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(w.detach(), before, atol=0, rtol=0)
    for k, v in state_before.items():
        assert torch.equal(torch.as_tensor(opt.state[w][k]), torch.as_tensor(v)), k
    assert scaler.get_scale() == 2.0**9  # the skipped step halved the scale


def test_bad_inputs_are_refused_clearly() -> None:
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError, match="iterable of tensors"):
        kernels.adamw(w)
    with pytest.raises(ValueError, match="empty"):
        kernels.sgd([])
    with pytest.raises(TypeError, match="floating-point"):
        kernels.adamw([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got float -1.0"):
        kernels.adamw([w], lr=-1.0)


INF, NAN = float("inf"), float("nan")
BAD_HYPERPARAMETERS = [  # (kind, keywords, error, message): torch 2.14.1 accepts the first 13 silently
    ("adamw", dict(lr=True), ValueError, "lr must be a finite number >= 0, got bool True"),
    ("adamw", dict(lr=INF), ValueError, "lr must be a finite number >= 0, got float inf"),
    ("sgd", dict(lr=INF), ValueError, "lr must be a finite number >= 0, got float inf"),
    ("sgd", dict(lr=NAN), ValueError, "lr must be a finite number >= 0, got float nan"),
    ("adamw", dict(eps=INF), ValueError, "eps must be a finite number > 0, got float inf"),
    ("adamw", dict(eps=0.0), ValueError, "eps must be a finite number > 0, got float 0.0"),
    ("adamw", dict(weight_decay=INF), ValueError, "weight_decay must be a finite number >= 0"),
    ("sgd", dict(weight_decay=NAN), ValueError, "weight_decay must be a finite number >= 0"),
    ("sgd", dict(momentum=1.5), ValueError, r"momentum must be .* in \[0, 1\), got float 1.5 \(a factor of 1 or"),
    ("sgd", dict(momentum=INF), ValueError, r"momentum must be a finite number in \[0, 1\), got float inf"),
    ("sgd", dict(dampening=-0.5), ValueError, r"dampening must be a finite number in \[0, 1\], got float -0.5"),
    ("sgd", dict(nesterov=1, momentum=0.9), TypeError, "nesterov must be True or False, got int 1"),
    ("adamw", dict(betas=(0.9, 0.99, 0.999)), ValueError, r"betas must be a pair"),  # torch dropped the third
    ("adamw", dict(lr="1e-3"), ValueError, "lr must be a finite number >= 0, got str '1e-3'"),  # torch: TypeError
    ("adamw", dict(lr=-1e-3), ValueError, "lr must be a finite number >= 0"),
    ("adamw", dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be a finite number in \[0, 1\), got float 1"),
    ("adamw", dict(betas=(NAN, 0.999)), ValueError, r"betas\[0\] must be .* in \[0, 1\), got float nan"),
    ("adamw", dict(betas=(True, 0.999)), ValueError, r"betas\[0\] must be .* in \[0, 1\), got bool True"),
    ("adamw", dict(betas=0.9), ValueError, r"betas must be a pair \(beta1, beta2\) of numbers in \[0, 1\)"),
    ("sgd", dict(momentum=-0.1), ValueError, r"momentum must be a finite number in \[0, 1\), got float -0.1"),
    ("sgd", dict(nesterov=True), ValueError, "nesterov=True needs momentum > 0 and dampening 0; got momentum 0.0"),
]


@pytest.mark.parametrize(("kind", "keywords", "error", "message"), BAD_HYPERPARAMETERS,
                         ids=[f"{k}-{next(iter(kw))}={v!r}" for k, kw, *_ in BAD_HYPERPARAMETERS
                              for v in [next(iter(kw.values()))]])
def test_bad_hyperparameters_are_refused_by_name(kind: str, keywords: dict, error: type, message: str) -> None:
    """Every hyperparameter a finite number in its range (not a bool), each error naming it,
    before any step; torch let the first 13 through (an inf or NaN lr steps the parameters to NaN)."""
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(error, match=message):
        getattr(kernels, kind)([w], **keywords)


@pytest.mark.parametrize(("kind", "override", "error", "message"), [
    ("adamw", {"lr": INF}, ValueError, r"params\[1\]\['lr'\] must be a finite number >= 0, got float inf"),
    ("sgd", {"lr": True}, ValueError, r"params\[1\]\['lr'\] must be a finite number >= 0, got bool True"),
    ("adamw", {"betas": (0.9, 1.5)}, ValueError, r"params\[1\]\['betas'\]\[1\] must be a finite number in \[0, 1"),
    ("adamw", {"eps": 0}, ValueError, r"params\[1\]\['eps'\] must be a finite number > 0"),
    ("sgd", {"momentum": -1.0}, ValueError, r"params\[1\]\['momentum'\] must be a finite number in \[0, 1\)"),
    ("sgd", {"weight_decay": NAN}, ValueError, r"params\[1\]\['weight_decay'\] must be a finite number"),
    ("sgd", {"nesterov": "yes"}, TypeError, r"params\[1\]\['nesterov'\] must be True or False"),
    ("sgd", {"momentum": 0.0, "nesterov": True}, ValueError,
     r"nesterov=True needs momentum > 0 and dampening 0; params\[1\] runs with momentum 0.0"),
    ("sgd", {"dampening": 0.5, "nesterov": True}, ValueError,
     r"nesterov=True needs momentum > 0 and dampening 0; params\[1\] runs with momentum 0.9 and dampening 0.5"),
    ("sgd", {"fused": True}, ValueError, r"params\[1\]\['fused'\]=True: kernels.sgd chooses the implementation"),
    ("adamw", {"foreach": False}, ValueError, r"params\[1\]\['foreach'\]=False: kernels.adamw chooses"),
    ("adamw", {"maximize": True}, ValueError, r"params\[1\]\['maximize'\]=True: kernels.adamw runs without"),
    ("adamw", {"amsgrad": True}, ValueError, r"params\[1\]\['amsgrad'\]=True: kernels.adamw runs without"),
    ("sgd", {"maximize": True}, ValueError, r"params\[1\]\['maximize'\]=True: kernels.sgd runs without"),
], ids=["adamw-lr", "sgd-lr", "betas", "eps", "momentum", "weight_decay", "nesterov", "nesterov-momentum",
        "nesterov-dampening", "fused", "foreach", "maximize", "amsgrad", "sgd-maximize"])
def test_bad_group_overrides_are_refused_by_group(kind: str, override: dict, error: type, message: str) -> None:
    """A parameter-group dict's own hyperparameters are checked as the keywords are (torch checks
    none of them: ``{"lr": inf}`` in a group stepped to NaN); a group's own implementation
    (``{"fused": True}`` skipped the layout guard: 0.87 off on a strided view) or torch-only variant
    (``maximize``, which the reference ignored: 0.87 apart) is refused."""
    groups = [{"params": [torch.zeros(3, requires_grad=True)]},
              {"params": [torch.zeros(2, requires_grad=True)], **override}]
    with pytest.raises(error, match=message):
        getattr(kernels, kind)(groups, **({"momentum": 0.9} if kind == "sgd" else {}))


def test_good_hyperparameters_are_stored_as_floats() -> None:
    """Edges inside the ranges are accepted; numpy scalars are stored as Python floats (a
    checkpoint's JSON holds those), tensors as given (torch's capturable steps read them)."""
    import numpy as np

    w = torch.zeros(3, requires_grad=True)
    opt = kernels.adamw([{"params": [w], "lr": np.float32(0.5), "betas": (0, np.float64(0.5))}], lr=0, eps=1e-30,
                        weight_decay=0)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], opt.defaults["lr"]) == (0.5, (0.0, 0.5), 0.0)
    assert type(group["lr"]) is float and all(type(b) is float for b in group["betas"])
    lr = torch.tensor(0.01)
    assert kernels.adamw([w], lr=lr).defaults["lr"] is lr
    opt = kernels.sgd([w], lr=0.1, momentum=0.0, dampening=1.0, nesterov=False)
    assert opt.defaults["dampening"] == 1.0


def test_generator_inside_a_group_and_named_parameters() -> None:
    model = torch.nn.Linear(3, 2)
    assert len(kernels.adamw([{"params": model.parameters(), "lr": 0.1}]).param_groups[0]["params"]) == 2
    assert len(kernels.sgd(model.named_parameters()).param_groups[0]["params"]) == 2
    w = torch.zeros(3, requires_grad=True)  # a group's params may be one tensor, as torch takes it
    for make in (kernels.sgd, kernels.adamw):
        (got,) = make([{"params": w}], lr=0.1).param_groups[0]["params"]
        assert got is w
        with pytest.raises(TypeError, match="got a set"):
            make([{"params": {w}}], lr=0.1)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_state_laid_out_unlike_its_parameter(kind: str) -> None:
    """Steps on a conv, then the model goes channels_last (its optimizer state does not), then
    more steps: the fused kernel must still match torch's for-loop."""
    import copy

    def run(make) -> torch.Tensor:
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3)
        opt = make(conv.parameters())
        gen = torch.Generator().manual_seed(1)
        for step in range(6):
            if step == 3:
                conv.to(memory_format=torch.channels_last)
            for p in conv.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return copy.deepcopy(conv.weight.detach()).contiguous()

    hyper = dict(lr=0.1, **({"momentum": 0.9} if kind == "sgd" else {}))
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    got = run(lambda ps: getattr(kernels, kind)(ps, **hyper))
    want = run(lambda ps: cls(ps, foreach=False, **hyper))
    assert_close(got, want, ELEMENTWISE)


def test_strided_view_parameter_is_not_fused() -> None:
    base = torch.randn(4, 6)
    view = base[:, ::2].requires_grad_()  # no dense layout of its own
    opt = kernels.sgd([view], lr=0.1, momentum=0.9)
    assert not opt.defaults["fused"]


def test_sparse_gradient_is_refused_clearly() -> None:
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = kernels.sgd(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradient"):
        opt.step()


def test_step_hooks_fire_once() -> None:
    torch.optim.AdamW([torch.zeros(2, requires_grad=True)])  # torch patches its class's step
    w = torch.zeros(3, requires_grad=True)
    opt, calls = kernels.adamw([w]), []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    w.grad = torch.ones(3)
    opt.step()
    assert calls == ["pre", "post"]


def test_closure_grads_are_aligned() -> None:
    w = torch.randn(5, 3).t().requires_grad_()
    opt = kernels.sgd([w], lr=0.1, momentum=0.9)
    ref_w = w.detach().clone().requires_grad_()
    ref_opt = reference.sgd([ref_w], lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        g = torch.randn(3, 5, generator=gen)

        def closure(p=w, g=g):
            p.grad = g.clone()  # contiguous grad for a transposed parameter
            return torch.tensor(0.0)

        opt.step(closure)
        ref_w.grad = g.clone()
        ref_opt.step()
    assert_close(w.detach(), ref_w.detach(), ELEMENTWISE)


def _scaled_steps(make, fill: float) -> torch.Tensor:
    """A GradScaler run whose first step overflows (skipped), then three finite steps; a freed
    block of ``fill`` lies where the first step's buffers may be allocated."""
    torch.manual_seed(0)
    w = torch.randn(64, 32, requires_grad=True)
    opt, scaler, x = make([w]), torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.randn(8, 64)
    junk = torch.full((64, 32), fill)
    del junk
    for k in range(4):
        opt.zero_grad()
        loss = (x @ w).square().mean() * (float("inf") if k == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return w.detach()


@pytest.mark.parametrize("fill", [1e6, float("nan")])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_after_a_skipped_first_step(fill: float, nesterov: bool) -> None:
    """torch's fused SGD made its momentum buffers uninitialised on a first step the scaler
    skipped (the weights went to 1e26 or NaN): the run equals torch's default SGD's."""
    hyper = dict(lr=0.01, momentum=0.9, nesterov=nesterov)
    got = _scaled_steps(lambda ps: kernels.sgd(ps, **hyper), fill)
    want = _scaled_steps(lambda ps: torch.optim.SGD(ps, foreach=False, **hyper), fill)
    assert_close(got, want, ELEMENTWISE)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd_momentum_for_a_parameter_whose_first_gradient_comes_later(weight_decay: float) -> None:
    """A layer unfrozen after step 1: its momentum starts at its first gradient, as torch's
    default SGD and the reference start it (torch's fused SGD raised a TypeError)."""
    def run(make) -> list[torch.Tensor]:
        torch.manual_seed(0)
        a, b = torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)
        opt, gen = make([a, b]), torch.Generator().manual_seed(1)
        for k in range(4):
            a.grad = torch.randn(3, 4, generator=gen)
            b.grad = None if k < 2 else torch.randn(5, generator=gen)
            opt.step()
        return [a.detach(), b.detach()]

    hyper = dict(lr=0.1, momentum=0.9, weight_decay=weight_decay)
    for side in (kernels.sgd, reference.sgd):
        got, want = run(lambda ps, side=side: side(ps, **hyper)), run(lambda ps: torch.optim.SGD(ps, **hyper))
        assert_close(got[0], want[0], ELEMENTWISE)
        assert_close(got[1], want[1], ELEMENTWISE)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_deep_copy_keeps_the_layout_guard(kind: str) -> None:
    """torch's __getstate__ leaves step hooks out: a copy of the optimizer must still align a
    contiguous grad to its transposed parameter (without the guard: 4.17 off in SGD)."""
    import copy

    def run(make) -> torch.Tensor:
        w = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).t().requires_grad_()
        opt, gen = make([w]), torch.Generator().manual_seed(2)
        for _ in range(10):
            w.grad = torch.randn(3, 5, generator=gen)
            opt.step()
        return w.detach()

    hyper = dict(lr=0.1, **({"momentum": 0.9} if kind == "sgd" else {}))
    original = getattr(kernels, kind)([torch.zeros(1, requires_grad=True)], **hyper)
    assert isinstance(copy.deepcopy(original), torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)

    def copied(ps):
        opt = copy.deepcopy(getattr(kernels, kind)(ps, **hyper))
        opt.param_groups[0]["params"] = ps  # the copy's own parameter copies replaced by the run's
        return opt

    assert_close(run(copied), run(lambda ps: getattr(reference, kind)(ps, **hyper)), ELEMENTWISE)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_group_added_later_is_checked_and_fused_only_where_it_can_be(kind: str) -> None:
    """add_param_group on a fused optimizer: a strided view or a complex parameter (which the
    fused step mis-steps, 0.3-6 off, or half-steps before raising) is refused before anything
    changes, as is a bad hyperparameter; a dense group steps as torch's."""
    w = torch.randn(4, 3, requires_grad=True)
    opt = getattr(kernels, kind)([w], lr=0.1)
    view, complex_ = torch.randn(4, 6)[:, ::2].requires_grad_(), torch.randn(3, dtype=torch.complex64)
    for bad in (view, complex_.requires_grad_()):
        with pytest.raises(ValueError, match="param_group cannot take the fused step"):
            opt.add_param_group({"params": [bad]})
    with pytest.raises(ValueError, match=r"param_group\['lr'\]"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": float("inf")})
    assert len(opt.param_groups) == 1
    extra = torch.randn(2, 5, requires_grad=True)
    opt.add_param_group({"params": extra, "lr": 0.05})
    ref = extra.detach().clone().requires_grad_()
    ref_opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)([ref], lr=0.05)
    for p in (extra, ref):
        p.grad = torch.ones(2, 5)
    w.grad = torch.ones(4, 3)
    opt.step()
    ref_opt.step()
    assert_close(extra.detach(), ref.detach(), ELEMENTWISE)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_tensor_listed_twice_is_refused(kind: str) -> None:
    """The fused step counted a tensor listed twice twice before either update (AdamW 4e-2 off
    the reference in 3 steps, with only torch's warning); across groups torch refuses it too."""
    w = torch.zeros(3, requires_grad=True)
    for params in ([w, w], [{"params": [w]}, {"params": [w], "lr": 0.1}]):
        with pytest.raises(ValueError, match="lists a tensor more than once"):
            getattr(kernels, kind)(params)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_complex_parameters_step_as_the_reference(kind: str) -> None:
    """A complex parameter steps as its (real, imaginary) pairs, in torch's class and in the
    reference (whose AdamW squared g itself: a complex second moment, 0.22 off)."""
    def run(side) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(3, dtype=torch.complex64, generator=gen).requires_grad_()
        opt = getattr(side, kind)([w], lr=0.1, **({"momentum": 0.9} if kind == "sgd" else {}))
        for _ in range(5):
            w.grad = torch.randn(3, dtype=torch.complex64, generator=gen)
            opt.step()
        return torch.view_as_real(w.detach()), torch.view_as_real(opt.state[w][STATE_KEYS[kind][-1]])

    for got, want in zip(run(kernels), run(reference), strict=True):
        assert_close(got, want, ELEMENTWISE)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_loaded_state_dict_is_checked_and_keeps_the_implementation(kind: str) -> None:
    """torch's load_state_dict puts the saved groups' hyperparameters in place of the groups'
    own: they are checked as the constructor's are (a torch AdamW saved with eps=0 stepped to
    NaN), the implementation stays this optimizer's (a fused torch checkpoint must not fuse a
    strided view), and the layout guard is registered once however often a state is loaded."""
    torch_class = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    hyper = {"momentum": 0.9} if kind == "sgd" else {}
    view = torch.randn(4, 6)[:, ::2].requires_grad_()
    opt = getattr(kernels, kind)([view], lr=0.1, **hyper)
    saved = torch_class([torch.zeros(4, 3, requires_grad=True)], lr=0.1, fused=True, **hyper).state_dict()
    for _ in range(3):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["fused"] is opt.defaults["fused"] is None  # a strided view: torch's default
    dense = getattr(kernels, kind)([torch.zeros(4, 3, requires_grad=True)], lr=0.1, **hyper)
    for _ in range(3):
        dense.load_state_dict(saved)
    assert dense.param_groups[0]["fused"] is True and len(dense._optimizer_step_pre_hooks) == 1
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["lr"] = float("inf")
    with pytest.raises(ValueError, match=r"state_dict\['param_groups'\]\[0\]\['lr'\] must be a finite number"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 0.1  # nothing loaded
    if kind == "adamw":
        zero_eps = torch_class([torch.zeros(4, 3, requires_grad=True)], eps=0.0).state_dict()
        with pytest.raises(ValueError, match=r"\['eps'\] must be a finite number > 0"):
            opt.load_state_dict(zero_eps)

    def run(side) -> torch.Tensor:  # a strided view stepped after the load, as the reference steps it
        w = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))[:, ::2].requires_grad_()
        o = getattr(side, kind)([w], lr=0.1, **hyper)
        o.load_state_dict(torch_class([torch.zeros(4, 3, requires_grad=True)], lr=0.1, **hyper).state_dict())
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            w.grad = torch.randn(4, 3, generator=gen)
            o.step()
        return w.detach()

    assert_close(run(kernels), run(reference), ELEMENTWISE)


def test_numbers_the_step_cannot_hold_in_float32_are_refused() -> None:
    """eps 1e-50 is 0 in float32 (a zero gradient then steps by 0/0 = NaN), lr 1e39 inf; both
    hold in float64, where float64 parameters step."""
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"eps=1e-50 rounds to 0\.0 in float32"):
        kernels.adamw([w], eps=1e-50)
    with pytest.raises(ValueError, match=r"lr=1e\+39 rounds to inf in float32"):
        kernels.sgd([w], lr=1e39)
    with pytest.raises(ValueError, match=r"params\[0\]\['eps'\]=1e-50"):
        kernels.adamw([{"params": [w], "eps": 1e-50}])
    kernels.adamw([torch.zeros(3, dtype=torch.float64, requires_grad=True)], eps=1e-50)  # float64 holds it
    with pytest.raises(ValueError, match=r"lr=1e\+39 rounds to inf in float32"):  # a tensor lr by its value
        kernels.sgd([w], lr=torch.tensor(1e39, dtype=torch.float64))
    # a float64 parameter beside a float32 one does not lift the check; weight decay is checked too
    with pytest.raises(ValueError, match=r"lr=1e\+39 rounds to inf in float32"):
        kernels.adamw([torch.zeros(3, dtype=torch.float64, requires_grad=True), w], lr=1e39)
    with pytest.raises(ValueError, match=r"weight_decay=1e\+39 rounds to inf in float32"):
        kernels.adamw([w], weight_decay=1e39)
