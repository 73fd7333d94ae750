"""kernels.per_sample == reference.per_sample (== an fp64 oracle), and its refusals."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import kernels
import reference
from correctness_tests.conftest import requires_cuda
from correctness_tests.tolerances import (
    ELEMENTWISE,
    REDUCTION,
    assert_as_accurate,
    assert_close,
    assert_dicts_close,
)
from kernels import nontemporal
from kernels.models import MLP

FUNCS = ("per_sample_grads", "per_sample_grad_gram", "per_sample_grad_norms")
LOSSES = {
    "ce_mean": lambda o, t: F.cross_entropy(o.flatten(0, -2), t.flatten()),
    "ce_sum": lambda o, t: F.cross_entropy(o.flatten(0, -2), t.flatten(), reduction="sum"),
    "mse_mean": F.mse_loss,
    "mse_sum": lambda o, t: F.mse_loss(o, t, reduction="sum"),
}


class TokenMLP(nn.Module):
    """Linear layers over (B, T, D) tokens; ``norm`` adds a LayerNorm (no identity: vmap)."""

    def __init__(self, d_in: int, widths: list[int], classes: int, bias: bool, norm: bool) -> None:
        super().__init__()
        sizes = [d_in, *widths, classes]
        self.norm = nn.LayerNorm(d_in) if norm else nn.Identity()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class ConvNet(nn.Module):
    """Conv2d feeding a Linear. groups 1: both by the identity; groups 3 or padding 'same': the
    conv through vmap, the Linear by the identity (the hybrid path)."""

    def __init__(self, classes: int, bias: bool, stride: int = 1, padding: int | str = 0,
                 dilation: int = 1, groups: int = 1, size: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, stride, padding, dilation, groups, bias=bias)
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, 3, size, size)).numel()
        self.head = nn.Linear(flat, classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).flatten(1))


@st.composite
def problems(draw: st.DrawFn, dtypes=(torch.float32, torch.float64)) -> dict:
    """A model, a loss and a batch, all drawn: widths, depth, tokens, bias, dtype, layout."""
    arch = draw(st.sampled_from(["mlp", "tokens", "tokens_norm", "conv"]))
    batch = draw(st.integers(1, 64))
    classes = draw(st.integers(2, 6))
    bias = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    loss = draw(st.sampled_from(sorted(LOSSES)))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    if arch == "conv":
        size, dilation = draw(st.integers(5, 8)), draw(st.sampled_from([1, 2]))
        padding = draw(st.sampled_from([0, 1, "same"] if dilation == 1 else [0, 1]))
        stride = 1 if padding == "same" else draw(st.sampled_from([1, 2]))
        model = ConvNet(classes, bias, stride, padding, dilation, draw(st.sampled_from([1, 3])), size)
        shape = (batch, 3, size, size)
    else:
        widths = draw(st.lists(st.integers(1, 24), min_size=0, max_size=3))
        # LayerNorm over 1-3 features is ill-conditioned (x - mean is mostly rounding, then
        # scaled by 1/sqrt(var + eps)): no fp32 implementation, the loop included, is near fp64.
        d_in = draw(st.integers(4 if arch == "tokens_norm" else 1, 16))
        if arch == "mlp":
            model, shape = MLP([d_in, *widths, classes], bias=bias), (batch, d_in)
        else:
            tokens = draw(st.integers(1, 4))
            model = TokenMLP(d_in, widths, classes, bias, norm=arch == "tokens_norm")
            shape = (batch, tokens, d_in)
    model = model.to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    if draw(st.booleans()):  # non-contiguous inputs: a transposed copy's view
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    lead = shape[:-1] if arch.startswith("tokens") else (batch,)
    if loss.startswith("ce"):
        y = torch.randint(0, classes, lead)
    else:
        y = torch.randn(*lead, classes, dtype=dtype)
    return dict(model=model, loss_fn=LOSSES[loss], inputs=x, targets=y)


def _run(side, name: str, p: dict, **kw):
    return getattr(side, name)(p["model"], p["loss_fn"], p["inputs"], p["targets"], **kw)


@given(problems())
def test_per_sample_grads_match_reference(p: dict) -> None:
    assert_dicts_close(_run(kernels, FUNCS[0], p), _run(reference, FUNCS[0], p), ELEMENTWISE)


@given(problems())
def test_gram_and_norms_match_materialized(p: dict) -> None:
    gram, norms = _run(kernels, FUNCS[1], p), _run(kernels, FUNCS[2], p)
    assert_close(gram, _run(reference, FUNCS[1], p), REDUCTION)
    assert_close(norms, _run(reference, FUNCS[2], p), REDUCTION)
    flat = torch.cat([g.flatten(1) for g in _run(kernels, FUNCS[0], p).values()], dim=1)
    assert_close(gram, flat @ flat.T, REDUCTION, msg="ghost Gram vs kernel's own materialized E E^T")


def _to64(p: dict) -> dict:
    return dict(p, model=copy.deepcopy(p["model"]).double(), inputs=p["inputs"].double())


@given(problems(dtypes=(torch.float32,)))
def test_fp32_sides_close_to_fp64_oracle(p: dict) -> None:
    oracle = _to64(p)
    for name in FUNCS:
        opt, ref, exact = (_run(s, name, q) for s, q in ((kernels, p), (reference, p), (reference, oracle)))
        if isinstance(exact, dict):
            opt, ref, exact = (torch.cat([t.flatten() for t in d.values()]) for d in (opt, ref, exact))
        kind = ELEMENTWISE if name == FUNCS[0] else REDUCTION
        assert_close(opt, exact.to(opt.dtype), kind, msg=f"{name} vs fp64 oracle")
        assert_close(ref, exact.to(ref.dtype), kind, msg=f"reference {name} vs fp64 oracle")
        assert_as_accurate(opt, ref, exact)


@given(problems(dtypes=(torch.float64,)))
def test_sum_of_per_sample_grads_is_batch_grad(p: dict) -> None:
    """An oracle independent of the loop: sum_i g_i = grad of sum_i loss_i (batch-of-one losses)."""
    model, loss_fn, x, y = p["model"], p["loss_fn"], p["inputs"], p["targets"]
    total = sum(loss_fn(model(x[i : i + 1]), y[i : i + 1]) for i in range(x.shape[0]))
    names = [n for n, q in model.named_parameters()]
    batch_grads = torch.autograd.grad(total, list(model.parameters()))
    got = _run(kernels, FUNCS[0], p)
    for n, g in zip(names, batch_grads, strict=True):
        assert_close(got[n].sum(0), g, REDUCTION, msg=n)


def test_tolerance_catches_wrong_results() -> None:
    """Negative controls: the comparisons above can fail."""
    torch.manual_seed(0)
    model, x, y = MLP([8, 16, 4]), torch.randn(16, 8), torch.randint(0, 4, (16,))
    p = dict(model=model, loss_fn=F.cross_entropy, inputs=x, targets=y)
    ref = _run(reference, FUNCS[0], p)
    off = {n: g * (1 + 1e-3) for n, g in ref.items()}
    with pytest.raises(AssertionError):
        assert_dicts_close(off, ref, ELEMENTWISE)
    # The batch gradient broadcast to every sample is not a per-sample gradient.
    batch = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    fake = {n: g.expand(16, *g.shape) for n, g in zip(ref, batch, strict=True)}
    with pytest.raises(AssertionError):
        assert_dicts_close(fake, ref, ELEMENTWISE)
    small = ref["net.0.weight"] * 1e-6  # normwise atol: tiny values are compared as strictly
    with pytest.raises(AssertionError):
        assert_close(small * (1 + 1e-3), small, ELEMENTWISE)


def _both(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw) -> None:
    p = dict(model=model, loss_fn=F.cross_entropy, inputs=x, targets=y)
    got, want = _run(kernels, name, p, **kw), _run(reference, name, p, **kw)
    if isinstance(want, dict):
        assert_dicts_close(got, want, ELEMENTWISE)
    else:
        assert_close(got, want, REDUCTION)


class Tied(nn.Module):
    """One weight registered in two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class TiedAE(nn.Module):
    """A decoder reusing the encoder's weight through F.linear (no second module)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t())


class Reused(nn.Module):
    """One Linear called twice with different token counts (weight sharing across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 6)
        a = torch.tanh(self.layer(x))
        return self.head(a.sum(1) + self.layer(a.mean(1)))


class FoldsBatch(nn.Module):
    """Folds tokens into the batch dim before a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.reshape(-1, 6)).reshape(x.shape[0], -1, 3).mean(1)


class TimeMajor(nn.Module):
    """Moves the batch to dim 1 before the Linear: with T == B dim 0 looks like a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.transpose(0, 1)).transpose(0, 1).mean(1)


class Mixes(nn.Module):
    """Subtracts the batch mean: samples mix, so the batch-of-one definition differs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.flatten(1))
        return h - 0.5 * h.mean(0, keepdim=True)


class InPlace(nn.Module):
    """ReLU(inplace=True) and += right after Linear outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x.flatten(1)))
        out = self.b(h)
        out += 1.0
        return out


class InPlaceTokens(nn.Module):
    """In-place ops on Linear outputs of (B, T, in) inputs, which are views of a matmul's result
    (an op on a view rebases its base), and on a view of one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(0.5)
        h[:, 0] += 1.0
        out = self.b(torch.tanh(h))
        out.mul_(2.0)
        return out.mean(1)


class Keyword(nn.Module):
    """Calls its Linear with input= and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(input=x.flatten(1))
        return h, h.sum(-1)


class Unused(nn.Module):
    """A Linear and a LayerNorm the forward never calls: their gradients are zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.unused, self.ln = nn.Linear(6, 3), nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x.flatten(1))


class TiedTranspose(nn.Module):
    """The tied decoder as usually written: F.linear(h, enc.weight.T)."""

    def __init__(self, attr: str = "T") -> None:
        super().__init__()
        self.enc, self.attr = nn.Linear(6, 3), attr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.enc(x)), getattr(self.enc.weight, self.attr))


class Shifts(nn.Module):
    """Adds each sample's predecessor: sample 0 is untouched, the others mix."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.cat([h[:1], h[1:] + h[:-1]])


class Reorders(nn.Module):
    """Samples 1 and 2 swap places before the Linear and back after: no sample mixes, but a layer
    row holds another sample (as a batch sorted by a key inside the model); first and last stay."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = torch.arange(len(x))
        if len(x) > 3:
            order[1], order[2] = 2, 1
        return self.fc(x[order])[order]  # the swap is its own inverse


class Anchored(nn.Module):
    """Every sample less sample 0 (``h - h[:1]``): sample 0 is zero in any batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(h - h[:1])


class FlipMixup(nn.Module):
    """A mixup with the batch flipped: the first and last samples mix with each other alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(0.7 * x + 0.3 * x.flip(0))


class BatchIndexedPosition(nn.Module):
    """The tutorial PositionalEncoding fed batch-first data: pe[:x.size(0)] indexes the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(16, 1, 6))
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 6)
        return self.fc(x + self.pe[: x.size(0)]).mean(1)


class UserHook(nn.Module):
    """A user forward hook doubles a Linear's output: the gradient is of the doubled output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)
        self.fc.register_forward_hook(lambda m, i, o: 2 * o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


class Gate(nn.Module):
    """A learned scalar gate (one parameter), the child module of a Linear below."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s * x


class ForwardOnTheInstance(nn.Module):
    """A Linear whose forward is set on the instance, as a wrapper library may: it uses the weight a
    second time through a child module's gate, so its output is not F.linear(x, W, b) and its
    weight's gradient is not the identity's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 5), nn.Linear(5, 3)
        fc = self.fc
        fc.gate = Gate()
        fc.forward = lambda x: F.linear(x, fc.weight, fc.bias) + fc.gate(F.linear(x, fc.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


class ChildOfLinear(nn.Module):
    """A Linear holding a child module whose parameter nn.Linear's forward never uses: the identity
    serves the Linear's weight and bias, the child's parameter gets its zero gradients elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 5), nn.Linear(5, 3)
        self.fc.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


class NoGradInside(nn.Module):
    """A Linear run under no_grad inside forward: its gradients are zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen_use, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = torch.tanh(self.frozen_use(x))
        return self.head(h)


class ViewsAcrossBatch(nn.Module):
    """Normalizes each token through a view that folds the batch dim (x.view(-1, d)): samples do
    not mix, but the view needs the input's rows contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 6)
        h = x.view(-1, 6)
        return self.fc((h / h.norm(dim=1, keepdim=True)).view(x.shape)).mean(1)


def _weight_norm() -> nn.Module:
    """Old-style weight_norm: the Linear's parameters are weight_g and weight_v."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        layer = nn.utils.weight_norm(nn.Linear(6, 4))
    with torch.no_grad():
        layer.weight_g.mul_(3.0)  # g != |v|: the layer's weight differs from v
    return nn.Sequential(nn.Flatten(), layer, nn.Tanh(), nn.Linear(4, 3))


class UnusedFirst(nn.Module):
    """A layer never called, registered before the one called: results come in the parameters'
    order, not with the called layers' first."""

    def __init__(self) -> None:
        super().__init__()
        self.unused, self.fc = nn.Linear(6, 2), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _ScaledLinear(nn.Linear):
    """A Linear subclass with a forward of its own (twice nn.Linear's output): its weight's gradient
    is 2 b a^T, not the identity's b a^T, so only nn.Linear itself takes the identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


# name: (model factory, input shape, identity kept for every Linear?)
def _stale_features() -> nn.Module:
    """A hidden layer grown from 6 to 8 units by swapping its weight and the next layer's, their
    in_features/out_features left stale: nn.Linear reads only the weight (the capture reshaped by
    the attributes: wrong shapes, Gram 0.25 off, or a reshape error)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].weight, model[0].bias = nn.Parameter(torch.randn(8, 6) / 3), nn.Parameter(torch.zeros(8))
    model[2].weight = nn.Parameter(torch.randn(3, 8) / 3)
    return model


AWKWARD = {
    "tied": (Tied, (5, 6), False),
    "tied_functional": (TiedAE, (5, 6), False),
    "reused_mixed_tokens": (Reused, (5, 4, 6), True),
    "reused_long_tokens": (Reused, (5, 40, 6), True),
    "folds_batch": (FoldsBatch, (5, 2, 6), False),
    "time_major_T_eq_B": (TimeMajor, (5, 5, 6), False),
    "mixes_samples": (Mixes, (5, 6), False),
    "in_place_after_linear": (InPlace, (5, 6), True),
    "in_place_after_linear_tokens": (InPlaceTokens, (5, 4, 6), True),
    "keyword_call_tuple_output": (Keyword, (5, 6), False),
    "unused_layers": (Unused, (5, 6), True),
    "weight_norm": (_weight_norm, (5, 6), True),
    "tied_functional_T": (TiedTranspose, (5, 6), False),
    "tied_functional_mT": (lambda: TiedTranspose("mT"), (5, 6), False),
    "shifts_neighbours": (Shifts, (5, 6), False),
    "batch_indexed_position": (BatchIndexedPosition, (5, 3, 6), False),
    # a batch of 2: the probe runs each sample alone (sample 1 is where these mix)
    "shifts_neighbours_B2": (Shifts, (2, 6), False),
    "batch_indexed_position_B2": (BatchIndexedPosition, (2, 3, 6), False),
    "mixes_samples_B2": (Mixes, (2, 6), False),
    # mixing or a reordering that a probe of the first and last samples together does not see
    "reorders_samples": (Reorders, (5, 6), False),
    "anchored_on_sample_0": (Anchored, (5, 6), False),
    "flip_mixup": (FlipMixup, (5, 6), False),
    "flip_mixup_B3": (FlipMixup, (3, 6), False),
    "views_across_batch": (ViewsAcrossBatch, (5, 3, 6), True),
    "user_forward_hook": (UserHook, (5, 6), True),
    "forward_on_the_instance": (ForwardOnTheInstance, (5, 6), True),  # the head keeps it
    "child_of_linear": (ChildOfLinear, (5, 6), True),
    "no_grad_inside_forward": (NoGradInside, (5, 6), False),
    "stale_features": (_stale_features, (5, 6), True),
    "unused_registered_first": (UnusedFirst, (5, 6), True),
    "linear_subclass": (lambda: nn.Sequential(_ScaledLinear(6, 5), nn.Tanh(), nn.Linear(5, 3)), (5, 6), True),
}
TIED_TO_INPUT = ("tied_functional", "tied_functional_T", "tied_functional_mT")


def _loss(o, t):
    o = o[0] if isinstance(o, tuple) else o
    return F.mse_loss(o, t) if o.shape == t.shape else F.cross_entropy(o, t)


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("case", sorted(AWKWARD))
def test_awkward_models_match_reference(name: str, case: str) -> None:
    """Where the Linear identity's assumptions fail, the kernel must notice and use vmap."""
    from kernels.layer_capture import Fallback, capture
    from kernels.per_sample import _plan

    torch.manual_seed(1)
    factory, shape, identity_kept = AWKWARD[case]
    model = factory().double()
    x = torch.randn(*shape, dtype=torch.float64)
    b = shape[0]
    y = torch.randn(b, 6, dtype=torch.float64) if case in TIED_TO_INPUT else torch.randint(0, 3, (b,))
    p = dict(model=model, loss_fn=_loss, inputs=x, targets=y)
    got, want = _run(kernels, name, p), _run(reference, name, p)
    if isinstance(want, dict):
        assert_dicts_close(got, want, ELEMENTWISE)
    else:
        assert_close(got, want, REDUCTION)
    names = [n for n, q in model.named_parameters() if q.requires_grad]
    layers = _plan(model, names, "error").linear
    try:
        kept = bool(layers) and capture(model, _loss, x, y, layers) is not None
    except Fallback:
        kept = False
    assert kept == identity_kept


@pytest.mark.parametrize("name", FUNCS)
def test_a_global_forward_hook_takes_vmap(name: str) -> None:
    """A global module forward hook runs before any module's own hooks, the capture's too, which
    recorded its output as the layer's (2*o: grads 0.5, Gram 0.75 off, silently): with one
    registered the identity is not taken, and the kernel equals the reference."""
    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    handle = register_module_forward_hook(lambda m, i, o: 2 * o if isinstance(m, nn.Linear) else None)
    try:
        _both(name, model, x, y)
    finally:
        handle.remove()


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
def test_what_neither_side_differentiates_alike_is_refused(side) -> None:
    """inputs or targets computed from a model parameter with the graph kept (an embedding looked up
    before the call: the kernel gave zeros for its weight, the reference refused by accident), or a
    parameter itself (the identity path does not walk torch's bare losses' graph), and
    gradient hooks on parameters (the reference's autograd applied them, the kernel's identity and
    vmap did not: 0.5 off): both sides refuse them, by name."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 6), nn.Linear(6, 3)
    model = nn.ModuleDict({"embed": embed, "head": head})
    model.forward = head.forward  # the embedding is looked up outside, before the call
    ids, y = torch.randint(0, 10, (5,)), torch.randint(0, 3, (5,))
    for name in FUNCS:
        with pytest.raises(ValueError, match=r"inputs carry an autograd graph reaching model parameter\(s\) "
                                             r"\['embed.weight'\]"):
            _run(side, name, dict(model=model, loss_fn=F.cross_entropy, inputs=embed(ids), targets=y))
    mlp = MLP([6, 5, 3])
    x = torch.randn(5, 6)
    for name in FUNCS:
        with pytest.raises(ValueError, match="targets carry an autograd graph"):
            _run(side, name, dict(model=mlp, loss_fn=F.mse_loss, inputs=x, targets=mlp(x)))
    # a parameter itself as the targets: a leaf, no graph to walk (torch's bare losses are not walked)
    square = nn.Linear(3, 3)
    for name in FUNCS:
        with pytest.raises(ValueError, match=r"targets are model parameter\(s\) \['weight'\]"):
            _run(side, name, dict(model=square, loss_fn=F.mse_loss, inputs=torch.randn(3, 3),
                                  targets=square.weight))
    handle = mlp.net[0].weight.register_hook(lambda g: 2 * g)
    for name in FUNCS:
        with pytest.raises(ValueError, match=r"\['net.0.weight'\] have gradient hooks"):
            _run(side, name, dict(model=mlp, loss_fn=F.cross_entropy, inputs=x, targets=torch.randint(0, 3, (5,))))
    handle.remove()
    _run(side, "per_sample_grads", dict(model=mlp, loss_fn=F.cross_entropy, inputs=x,
                                        targets=torch.randint(0, 3, (5,))))


@pytest.mark.parametrize("case", ["mixes_samples", "time_major_T_eq_B", "shifts_neighbours"])
def test_randomness_modes_keep_the_batch_of_one_definition(case: str) -> None:
    """No dropout at all, randomness='different': still the reference's gradients."""
    torch.manual_seed(2)
    factory, shape, _ = AWKWARD[case]
    p = dict(model=factory().double(), loss_fn=_loss, inputs=torch.randn(*shape, dtype=torch.float64),
             targets=torch.randint(0, 3, (5,)))
    for name in FUNCS:
        got, want = _run(kernels, name, p, randomness="different"), _run(reference, name, p)
        if isinstance(want, dict):
            assert_dicts_close(got, want, ELEMENTWISE)
        else:
            assert_close(got, want, REDUCTION)


@pytest.mark.parametrize("name", FUNCS)
def test_under_autocast_results_keep_the_parameter_dtype(name: str) -> None:
    """An autocast forward (bf16 activations) still gives fp32 gradients, close to the loop's
    under the same autocast, within the bf16 row of the table."""
    torch.manual_seed(6)
    model, x, y = MLP([12, 32, 4]), torch.randn(16, 12), torch.randint(0, 4, (16,))
    p = dict(model=model, loss_fn=F.cross_entropy, inputs=x, targets=y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = _run(kernels, name, p), _run(reference, name, p)
    if isinstance(want, dict):
        assert_dicts_close(got, want, ELEMENTWISE, dtype=torch.bfloat16)
    else:
        assert got.dtype == want.dtype == torch.float32
        assert_close(got, want, REDUCTION, dtype=torch.bfloat16)


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
def test_called_under_no_grad(side) -> None:
    torch.manual_seed(7)
    model, x, y = MLP([6, 8, 3]), torch.randn(5, 6), torch.randint(0, 3, (5,))
    want = reference.per_sample_grads(model, F.cross_entropy, x, y)
    with torch.no_grad():
        got = side.per_sample_grads(model, F.cross_entropy, x, y)
        gram = side.per_sample_grad_gram(model, F.cross_entropy, x, y)
    assert_dicts_close(got, want, ELEMENTWISE)
    assert gram.shape == (5, 5)


def test_perf_model_keeps_the_identity() -> None:
    """The benchmarked MLP must not trip a capture check (a false fallback would be slower)."""
    from kernels.layer_capture import capture
    from kernels.per_sample import _plan

    torch.manual_seed(0)
    for batch in (64, 256):
        model = MLP((784, 256, 256, 10))
        x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))
        layers = _plan(model, [n for n, _ in model.named_parameters()], "error").linear
        assert len(capture(model, F.cross_entropy, x, y, layers)) == 3


@pytest.mark.parametrize("name", FUNCS)
def test_frozen_parameters_are_skipped(name: str) -> None:
    torch.manual_seed(2)
    model = ConvNet(3, bias=True).double()
    model.conv.bias.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    x, y = torch.randn(7, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    _both(name, model, x, y)
    grads = kernels.per_sample_grads(model, F.cross_entropy, x, y)
    assert list(grads) == ["conv.weight", "head.bias"]


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_chunk_size_gives_same_result(chunk_size: int) -> None:
    torch.manual_seed(3)
    model = ConvNet(3, bias=True, groups=3).double()  # the conv through vmap, chunked
    x, y = torch.randn(7, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    _both(FUNCS[0], model, x, y, chunk_size=chunk_size)
    _both(FUNCS[1], model, x, y, chunk_size=chunk_size)


def test_empty_batch_gives_empty_results() -> None:
    model, x, y = MLP([5, 4, 3]), torch.randn(0, 5), torch.zeros(0, dtype=torch.long)
    grads = kernels.per_sample_grads(model, F.cross_entropy, x, y)
    assert {n: tuple(g.shape) for n, g in grads.items()} == {
        n: (0, *q.shape) for n, q in model.named_parameters()}
    assert kernels.per_sample_grad_gram(model, F.cross_entropy, x, y).shape == (0, 0)
    assert kernels.per_sample_grad_norms(model, F.cross_entropy, x, y).shape == (0,)
    assert {n: g.shape for n, g in reference.per_sample_grads(model, F.cross_entropy, x, y).items()} == {
        n: g.shape for n, g in grads.items()}


def test_zero_gradient_norms_are_zero_not_nan() -> None:
    model = MLP([4, 3, 2])
    for q in model.parameters():
        nn.init.zeros_(q)
    x, y = torch.randn(3, 4), torch.zeros(3, 2)
    norms = kernels.per_sample_grad_norms(model, F.mse_loss, x, y)
    assert torch.isfinite(norms).all()


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", FUNCS)
def test_bad_inputs_are_refused_clearly(side, name: str) -> None:
    fn = getattr(side, name)
    mlp, x, y = MLP([5, 4, 3]), torch.randn(4, 5), torch.randint(0, 3, (4,))
    bn = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"BatchNorm1d.*eval\(\).*GroupNorm"):
        fn(bn, F.cross_entropy, x, y)
    fn(bn.eval(), F.cross_entropy, x, y)  # running statistics: per-sample again
    stateless = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 3))
    stateless.eval()
    with pytest.raises(ValueError, match=r"BatchNorm1d using batch statistics"):  # eval() keeps no statistics
        fn(stateless, F.cross_entropy, x, y)
    with pytest.raises(ValueError, match=r"Dropout.*randomness="):
        fn(MLP([5, 4, 3], dropout=0.5), F.cross_entropy, x, y)
    fn(nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.0), nn.Linear(4, 3)), F.cross_entropy, x, y)  # p=0: not random
    with pytest.raises(ValueError, match="batch size mismatch"):
        fn(mlp, F.cross_entropy, x, y[:3])
    with pytest.raises(ValueError, match="batch size mismatch: inputs has 4 samples, targets has 8"):
        fn(mlp, F.cross_entropy, x, torch.cat([y, y]))
    with pytest.raises(ValueError, match=r"targets must be a tensor of shape \(B, \.\.\.\), got shape \(\)"):
        fn(mlp, F.cross_entropy, x, y[0])
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        fn(mlp, None, x, y)
    with pytest.raises(ValueError, match="NaN or inf in targets"):  # floating targets are read too
        fn(mlp, F.mse_loss, x, torch.full((4, 3), float("nan")))
    with pytest.raises(TypeError, match="floating-point"):
        fn(mlp, F.cross_entropy, x.long(), y)
    with pytest.raises(TypeError, match="inputs are torch.float64"):
        fn(mlp, F.cross_entropy, x.double(), y)
    with pytest.raises(TypeError, match="nn.Module"):
        fn(lambda t: t, F.cross_entropy, x, y)
    with pytest.raises(ValueError, match="randomness must be one of"):
        fn(mlp, F.cross_entropy, x, y, randomness="sometimes")
    with pytest.raises(ValueError, match="scalar per sample"):
        fn(mlp, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y)
    frozen = MLP([5, 4, 3]).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=True"):
        fn(frozen, F.cross_entropy, x, y)


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", FUNCS)
def test_finite_terms_whose_product_overflows_are_refused(side, name: str) -> None:
    """A layer input of 1e20 and an output gradient near 7e18, each finite in fp32: their product
    (the weight's per-sample gradient) is not."""
    fc = nn.Linear(1, 1)
    with torch.no_grad():
        fc.weight.fill_(1e-20), fc.bias.zero_()
    x, y = torch.tensor([[1e20], [1.0], [2.0]]), torch.tensor([[-1e19], [0.0], [0.0]])
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        getattr(side, name)(fc, F.mse_loss, x, y)
    small = torch.tensor([[1e8], [1.0], [2.0]]), torch.tensor([[-1e7], [0.0], [0.0]])
    got = getattr(side, name)(fc, F.mse_loss, *small)  # gradients near 1e15 (a Gram near 1e30): finite
    assert all(torch.isfinite(t).all() for t in (got.values() if isinstance(got, dict) else [got]))


# name: (layer input, output gradient per token, bias?, which per-sample gradient overflows)
TOKEN_SUMS = {
    "weight": (1.5e19, 1e19, True, "weight"),
    "weight_of_negative_inputs": (-1.5e19, 1e19, True, "weight"),
    "bias": (1e-3, 1e38, True, "bias"),
    "no_bias": (1e-3, 1e38, False, None),
}


@pytest.mark.parametrize("case", sorted(TOKEN_SUMS))
def test_token_sums_whose_product_overflows_are_refused(case: str) -> None:
    """Per token each product is finite in fp32 (1.5e19 x 1e19); summed over a sample's 4 tokens
    the weight's per-sample gradient (6e38, or -6e38 from negative inputs) is not. The bias's sum
    of 4 output gradients of 1e38 overflows alone, its weight's 4e35 finite; without a bias that
    weight is returned."""
    a, g, bias, overflows = TOKEN_SUMS[case]
    fc = nn.Linear(2, 1, bias=bias)
    with torch.no_grad():
        fc.weight.fill_(1e-30)
    x, y = torch.full((2, 4, 2), a), torch.zeros(2)

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (o * g).sum() + 0 * t.sum()

    for side in (kernels, reference):
        if overflows is None:
            got = side.per_sample_grads(fc, loss, x, y)
            assert list(got) == ["weight"] and bool(torch.isfinite(got["weight"]).all())
            continue
        with pytest.raises(FloatingPointError, match=f"NaN or inf in the per-sample gradient of '{overflows}'"):
            side.per_sample_grads(fc, loss, x, y)


def test_nonfinite_gradients_from_the_vmap_path_are_refused() -> None:
    """A Conv2d sends the whole model through vmap (module note): its per-sample gradients are read
    there. The loss adds sqrt(0 * out), 0 to the loss and NaN (0 x 1/sqrt(0)) to every gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    x, y = torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o, t) + o.mul(0).sqrt().sum()

    for side in (kernels, reference):
        with pytest.raises(FloatingPointError, match="NaN or inf in the per-sample gradient of '0.weight'"):
            side.per_sample_grads(model, loss, x, y)


@pytest.mark.skipif(nontemporal._nontemporal is None or not nontemporal._nontemporal.NONTEMPORAL,
                    reason="no streaming stores in this build")
def test_terms_the_streamed_write_read_are_refused_as_the_torch_read_refuses_them(monkeypatch) -> None:
    """With ``out=`` and the write streamed (a 1-byte cache: every result pays), the captured terms
    are checked from the C pass's reads (kernels.nontemporal.outer_all): a NaN output gradient
    and finite terms whose product overflows raise what the torch read raises, finite ones pass."""
    fc = nn.Linear(1, 1)
    with torch.no_grad():
        fc.weight.fill_(1e-20), fc.bias.zero_()
    small = torch.tensor([[1e8], [1.0], [2.0]]), torch.tensor([[-1e7], [0.0], [0.0]])
    big = torch.tensor([[1e20], [1.0], [2.0]]), torch.tensor([[-1e19], [0.0], [0.0]])

    def nan(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(o, t) + o.mul(0).sqrt().sum()  # 0 to the loss, NaN to every gradient

    def refusal(loss, x, y, out) -> str:
        with pytest.raises(FloatingPointError) as raised:
            kernels.per_sample_grads(fc, loss, x, y, out=out)
        return str(raised.value)

    out = kernels.per_sample_grads(fc, F.mse_loss, *small)
    torch_read = [refusal(nan, *small, out), refusal(F.mse_loss, *big, out)]
    reads = []
    real = nontemporal._nontemporal.outer_all
    monkeypatch.setattr(nontemporal, "last_level_cache", lambda: 1)
    monkeypatch.setattr(nontemporal._nontemporal, "outer_all",
                        lambda *args: reads.append(real(*args)) or reads[-1])
    assert [refusal(nan, *small, out), refusal(F.mse_loss, *big, out)] == torch_read
    assert "output gradients of layer ''" in torch_read[0] and "per-sample gradient of 'weight'" in torch_read[1]
    assert len(reads) == 2 and math.isnan(reads[0][0][0]) and reads[1][0] == pytest.approx((2e19, 1e20))
    got = kernels.per_sample_grads(fc, F.mse_loss, *small, out=out)
    assert len(reads) == 3
    assert_dicts_close(got, reference.per_sample_grads(fc, F.mse_loss, *small), ELEMENTWISE)


class _Unused(nn.Module):
    """A layer registered but never called: its per-sample gradients are zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.unused = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_out_for_a_layer_never_called_is_zeroed() -> None:
    """out= buffers holding an earlier call's values: a layer the forward never calls gets zeros
    written into its buffers, as the reference's gradients are."""
    torch.manual_seed(0)
    model, x, y = _Unused(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    out = {n: torch.full((5, *p.shape), 7.0) for n, p in model.named_parameters()}
    got = kernels.per_sample_grads(model, F.cross_entropy, x, y, out=out)
    assert all(got[n] is out[n] for n in out)
    assert_dicts_close(got, reference.per_sample_grads(model, F.cross_entropy, x, y), ELEMENTWISE)
    assert not got["unused.weight"].any() and not got["unused.bias"].any()


@pytest.mark.parametrize("name", FUNCS)
def test_a_loss_no_trainable_parameter_reaches_gives_zeros_of_their_own(name: str) -> None:
    """Every trainable parameter in a layer the forward never calls: per-sample gradients, Gram and
    norms are zeros on both sides (the reference's loss has no graph to differentiate), each a
    tensor the caller may write to (not a zero expanded), in the model's dtype (float64 here)."""
    torch.manual_seed(0)
    model, x, y = _Unused().double(), torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    model.fc.requires_grad_(False)
    got, want = _run(kernels, name, dict(model=model, loss_fn=F.cross_entropy, inputs=x, targets=y)), \
        _run(reference, name, dict(model=model, loss_fn=F.cross_entropy, inputs=x, targets=y))
    for t in got.values() if isinstance(got, dict) else [got]:
        assert not t.any() and t.dtype == torch.float64
        t.add_(1)  # its own memory: an expanded zero refuses an in-place write
    for t in want.values() if isinstance(want, dict) else [want]:
        assert not t.any()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, on the reentrant call
@pytest.mark.parametrize("name", FUNCS)
def test_a_reentrant_checkpoint_is_refused_with_what_works(name: str) -> None:
    """A Linear inside torch.utils.checkpoint(use_reentrant=True) runs under no_grad in the
    forward, so it goes through vmap, which cannot transform the checkpoint's Function."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.fc, self.head, self.reentrant = nn.Linear(6, 6), nn.Linear(6, 3), reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(lambda t: torch.tanh(self.fc(t)), x, use_reentrant=self.reentrant))

    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match=r"use_reentrant=False.*reference\.per_sample_grads"):
        getattr(kernels, name)(Checkpointed(True).double(), F.cross_entropy, x, y)
    model = Checkpointed(False).double()
    got, want = (getattr(side, name)(model, F.cross_entropy, x, y) for side in (kernels, reference))
    assert_dicts_close(got, want, ELEMENTWISE) if isinstance(want, dict) else assert_close(got, want, REDUCTION)


class WithAux(nn.Module):
    """Returns (logits, an auxiliary output): a tuple, so the per-sample gradients go through vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP([8, 16, 3])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out, out.tanh()


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("arch", ["mlp", "conv", "tuple_output"])
def test_a_loss_that_uses_a_parameter_itself_is_refused(name: str, arch: str) -> None:
    """Weight decay inside loss_fn: the reference's loop differentiates it, while the identity and
    torch.func differentiate the loss through the model's output only (before this check the
    kernel returned the first layer's gradients without the term, 0.35 off). Refused, naming the
    parameter; the same term on a detached weight contributes no gradient and is computed."""
    torch.manual_seed(0)
    if arch == "mlp":
        model, x = MLP([8, 16, 3]), torch.randn(5, 8)
    elif arch == "tuple_output":  # the loss reads the tuple's first tensor: refused as for a tensor output
        model, x = WithAux(), torch.randn(5, 8)
    else:
        model, x = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(32, 3)), torch.randn(5, 1, 6, 6)
    y = torch.randint(0, 3, (5,))
    first = next(model.parameters())
    fn = getattr(kernels, name)
    with pytest.raises(ValueError, match=r"loss_fn reaches model parameter\(s\) \['[^']*0\.weight'\] other than"):
        fn(model, lambda o, t: _loss(o, t) + 0.5 * first.pow(2).sum(), x, y)
    detached = lambda o, t: _loss(o, t) + 0.5 * first.detach().pow(2).sum()  # noqa: E731
    got, want = fn(model, detached, x, y), getattr(reference, name)(model, detached, x, y)
    if isinstance(want, dict):
        assert_dicts_close(got, want, ELEMENTWISE)
    else:
        assert_close(got, want, REDUCTION)


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
@pytest.mark.parametrize("randomness", ["different", "same"])
def test_dropout_randomness_modes(side, randomness: str) -> None:
    """Six copies of one sample: 'same' shares one dropout mask (equal gradients), 'different'
    draws one per sample (unequal gradients)."""
    torch.manual_seed(4)
    model = MLP([5, 32, 3], dropout=0.5)
    x, y = torch.randn(1, 5).expand(6, 5), torch.tensor([1] * 6)
    grads = side.per_sample_grads(model, F.cross_entropy, x, y, randomness=randomness)
    w = grads["net.0.weight"]
    assert w.shape == (6, 32, 5) and torch.isfinite(w).all()
    spread = max((w[i] - w[0]).abs().max() for i in range(1, 6)) / w[0].abs().max()
    identical = spread.item() < 1e-5  # rounding apart: vmap rows may differ in the last bit
    assert identical == (randomness == "same")
    for name in FUNCS[1:]:
        out = getattr(side, name)(model, F.cross_entropy, x, y, randomness=randomness)
        assert torch.isfinite(out).all()


@requires_cuda
@pytest.mark.parametrize("name", FUNCS)
def test_cuda_matches_cpu_reference(name: str) -> None:
    torch.manual_seed(5)
    model, x, y = MLP([12, 16, 4]).double(), torch.randn(9, 12, dtype=torch.float64), torch.randint(0, 4, (9,))
    want = getattr(reference, name)(model, F.cross_entropy, x, y)
    got = getattr(kernels, name)(model.cuda(), F.cross_entropy, x.cuda(), y.cuda())
    if isinstance(want, dict):
        assert_dicts_close({n: g.cpu() for n, g in got.items()}, want, ELEMENTWISE)
    else:
        assert_close(got.cpu(), want, REDUCTION)


def test_layers_are_dispatched_as_documented() -> None:
    """Linear -> identity; Conv2d, LayerNorm, tied weights -> vmap; randomness modes -> one pass."""
    from kernels.per_sample import _plan

    def plan(model: nn.Module, randomness: str = "error"):
        p = _plan(model, [n for n, q in model.named_parameters() if q.requires_grad], randomness)
        return sorted(p.linear), p.other

    assert plan(MLP([4, 5, 3])) == (["net.0", "net.2"], [])
    assert plan(ConvNet(3, bias=True)) == (["head"], ["conv.weight", "conv.bias"])
    assert plan(Tied()) == ([], ["a.weight", "a.bias", "b.bias"])
    assert plan(_weight_norm()) == (["3"], ["1.bias", "1.weight_g", "1.weight_v"])
    assert plan(_FrozenBias()) == (["fc", "head", "unused"], [])  # a frozen bias: its weight keeps the identity
    assert plan(MLP([4, 5, 3]), "same") == ([], ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"])
    hybrid = ConvNet(3, bias=False)
    assert plan(hybrid, "different") == ([], ["conv.weight", "head.weight"])  # one pass, one mask


@given(problems())
def test_ghost_sum_grad_and_dots_match_materialized(p: dict) -> None:
    """kernels.ghost: sum_i g_i and <v, g_i> from the captured terms (Linear layers over tokens and
    repeated calls included), against the loop's materialized per-sample gradients."""
    from kernels.per_sample import ghost_terms

    want = _run(reference, FUNCS[0], p)
    terms = ghost_terms(p["model"], p["loss_fn"], p["inputs"], p["targets"])
    assert_dicts_close(terms.sum_grad(), {n: g.sum(0) for n, g in want.items()}, REDUCTION)
    v = {n: torch.randn_like(g[0]) for n, g in want.items()}
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    v_flat = torch.cat([t.flatten() for t in v.values()])
    # a dot product's rounding scales with |v| |g_i|, not with the (possibly cancelled) result
    assert_close(terms.dots(v), flat @ v_flat, REDUCTION, scale=(v_flat.norm() * flat.norm(dim=1).max()).item())


class _FrozenBias(nn.Module):
    """A Linear whose bias alone is frozen, and a layer never called whose bias is frozen too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head, self.unused = nn.Linear(6, 5), nn.Linear(5, 3), nn.Linear(6, 2)
        self.fc.bias.requires_grad_(False)
        self.unused.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


def _frozen_bias_problem(shape: tuple[int, ...]) -> dict:
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    return dict(model=_FrozenBias().double(), loss_fn=LOSSES["ce_mean"], inputs=x,
                targets=torch.randint(0, 3, shape[:-1]))


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("shape", [(5, 6), (5, 4, 6)], ids=["one_row", "tokens"])
def test_a_frozen_bias_is_left_out_beside_its_trainable_weight(name: str, shape: tuple[int, ...]) -> None:
    """fc's weight trains and its bias does not: the identity takes fc with the weight's term alone
    (the bias's b_i . b_j is not part of g_i), on one row a sample and over tokens."""
    p = _frozen_bias_problem(shape)
    got, want = _run(kernels, name, p), _run(reference, name, p)
    if isinstance(want, dict):
        assert list(got) == ["fc.weight", "head.weight", "head.bias", "unused.weight"]
        assert_dicts_close(got, want, ELEMENTWISE)
    else:
        assert_close(got, want, REDUCTION)


@pytest.mark.parametrize("shape", [(5, 6), (5, 4, 6)], ids=["one_row", "tokens"])
def test_ghost_terms_skip_frozen_parameters_and_rows_slice_every_term(shape: tuple[int, ...]) -> None:
    """kernels.ghost beyond the Gram: sum_grad and dots cover exactly the trainable parameters (a
    frozen bias left out, a layer never called summed to zeros), and rows(s) are the terms of the
    batch x[s] (each sample's own captured terms, outputs and count)."""
    from kernels.per_sample import ghost_terms

    p = _frozen_bias_problem(shape)
    want = _run(reference, FUNCS[0], p)
    terms = ghost_terms(p["model"], p["loss_fn"], p["inputs"], p["targets"])
    sums = terms.sum_grad()
    assert_dicts_close({n: sums[n] for n in want}, {n: g.sum(0) for n, g in want.items()}, REDUCTION)
    assert set(sums) == set(want) and not sums["unused.weight"].any()
    v = {n: torch.randn_like(g[0]) for n, g in want.items()}
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    v_flat = torch.cat([t.flatten() for t in v.values()])
    assert_close(terms.dots(v), flat @ v_flat, REDUCTION, scale=(v_flat.norm() * flat.norm(dim=1).max()).item())
    part = dict(p, inputs=p["inputs"][1:4], targets=p["targets"][1:4])
    rows, alone = terms.rows(slice(1, 4)), ghost_terms(part["model"], part["loss_fn"], part["inputs"],
                                                       part["targets"])
    assert rows.batch == 3
    assert_close(rows.outputs, alone.outputs, ELEMENTWISE)
    assert_close(rows.gram(), alone.gram(), REDUCTION)
    assert_close(rows.norms(), alone.norms(), REDUCTION)
    assert_dicts_close(rows.sum_grad(), alone.sum_grad(), REDUCTION)


def test_norms_of_a_gradient_that_cancels_are_finite() -> None:
    """A loss of the difference of a sample's two tokens, one ulp apart: its weight gradient
    g (a_1 - a_2)^T nearly vanishes, and the ghost sum of its T^2 products, |a|^2 |g|^2 (1 - 1 - 1 + 1),
    rounds to either sign. Below zero it must not become NaN (refused as a non-finite result): 64
    such samples, each about a third of the time negative before the square root."""
    torch.manual_seed(0)
    first = torch.randn(64, 1, 5)
    x, y = torch.cat([first, first * (1 + 1e-7)], 1), torch.randn(64, 3)
    norms = kernels.per_sample_grad_norms(nn.Linear(5, 3), lambda o, t: F.mse_loss(o[:, 0] - o[:, 1], t), x, y)
    assert norms.shape == (64,) and bool((norms >= 0).all())


# -- out=: the result written into given tensors ------------------------------------------------

def _out_like(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(g, float("nan")) for n, g in grads.items()}


@pytest.mark.parametrize("model", [MLP((6, 5, 3)), nn.Sequential(nn.LayerNorm(6), MLP((6, 5, 3)))],
                         ids=["identity", "vmap"])
def test_out_is_filled_and_returned(model: nn.Module) -> None:
    """The same dict and tensors come back, equal to a fresh call, on two calls with different
    inputs (a buffer reused from the previous step), on the identity and the vmap path."""
    torch.manual_seed(0)
    out = None
    for step in range(2):
        x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
        want = kernels.per_sample_grads(model, F.cross_entropy, x, y)
        out = out if out is not None else _out_like(want)
        ptrs = {n: t.data_ptr() for n, t in out.items()}
        got = kernels.per_sample_grads(model, F.cross_entropy, x, y, out=out)
        assert got is out and {n: t.data_ptr() for n, t in got.items()} == ptrs, f"step {step}"
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)


def test_out_with_an_empty_batch_is_returned_as_is() -> None:
    model = MLP((6, 5, 3))
    out = {n: p.new_zeros((0, *p.shape)) for n, p in model.named_parameters()}
    assert kernels.per_sample_grads(model, F.cross_entropy, torch.randn(0, 6), torch.zeros(0, dtype=torch.int64),
                                    out=out) is out


def test_bad_out_is_refused_clearly() -> None:
    model = MLP((6, 5, 3))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    good = _out_like(kernels.per_sample_grads(model, F.cross_entropy, x, y))
    first = next(iter(good))
    buffer = np.zeros(150, dtype=np.float32)
    cases = {
        "out must be a dict": [good[first]],
        "missing": {n: t for n, t in good.items() if n != first},
        r"must be \(4, 5, 6\) torch.float32": {**good, first: good[first][:3]},
        "torch.float64": {**good, first: good[first].double()},
        "contiguous": {**good, first: good[first].transpose(1, 2).contiguous().transpose(1, 2)},
        "share memory": {**good, "net.2.weight": good[first].view(-1)[:60].view(4, 3, 5)},
        # two storages over one buffer (numpy slices that overlap): their start addresses differ
        r"share memory: out\['net.0.weight'\] and out\['net.2.weight'\] do": {
            **good, first: torch.from_numpy(buffer[:120]).view(4, 5, 6),
            "net.2.weight": torch.from_numpy(buffer[90:]).view(4, 3, 5)},
        "requires grad": {**good, first: good[first].clone().requires_grad_()},
        r"unexpected \['extra'\]": {**good, "extra": torch.zeros(4)},
        r"on cpu \(batch, \*param.shape\), got \(4, 5, 6\) torch.float32 on meta": {
            **good, first: good[first].to("meta")},
    }
    with torch.inference_mode():
        cases["inference tensor"] = {**good, first: torch.zeros_like(good[first])}
    for message, out in cases.items():
        with pytest.raises((ValueError, TypeError), match=message):
            kernels.per_sample_grads(model, F.cross_entropy, x, y, out=out)


@pytest.mark.parametrize("case", ["ce", "ce ignored", "nll", "mse", "mse (B,)", "l1"])
def test_batched_per_sample_losses_equal_vmaps(case: str) -> None:
    """torch's bare losses take a batched path in the capture (layer_capture.per_sample_losses):
    the same (B,) as the generic vmap of each sample's own loss, NaN included where vmap gives it
    (an ignored target's sample is 0/0 alone, where reduction="none" gives 0)."""
    from torch.func import vmap

    from kernels.layer_capture import per_sample_losses

    g = torch.Generator().manual_seed(0)
    o = torch.randn(6, 5, generator=g, dtype=torch.float64)
    fn, t = {
        "ce": (F.cross_entropy, torch.randint(0, 5, (6,), generator=g)),
        "ce ignored": (F.cross_entropy, torch.tensor([0, -100, 2, 3, 4, 1])),
        "nll": (F.nll_loss, torch.randint(0, 5, (6,), generator=g)),
        "mse": (F.mse_loss, torch.randn(6, 5, generator=g, dtype=torch.float64)),
        "mse (B,)": (F.mse_loss, None),
        "l1": (F.l1_loss, torch.randn(6, 5, generator=g, dtype=torch.float64)),
    }[case]
    if case == "mse (B,)":
        o, t = o[:, 0], torch.randn(6, generator=g, dtype=torch.float64)
    want = vmap(lambda a, b: fn(a.unsqueeze(0), b.unsqueeze(0)))(o, t)
    got = per_sample_losses(fn, o, t)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert bool(got[1].isnan()) == (case == "ce ignored")


class _CalledTwice(nn.Module):
    """One Linear called twice (legal: T = 2 rows per sample), or also read by F.linear outside it."""

    def __init__(self, outside: bool) -> None:
        super().__init__()
        self.a, self.b, self.outside = nn.Linear(6, 6), nn.Linear(6, 3), outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))
        return out + F.linear(x, self.a.weight)[:, :3] if self.outside else out


@pytest.mark.parametrize("autocast", [False, True])
def test_weight_use_check_reads_the_graph_under_autocast(autocast: bool) -> None:
    """Under autocast a weight's bf16 copy is cached and shared by its calls: repeated calls keep
    the identity, and a use outside the layer that reads the same cached copy is still caught."""
    from kernels.layer_capture import Fallback, capture

    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    for outside in (False, True):
        model = _CalledTwice(outside)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if outside:
                with pytest.raises(Fallback, match="a: its weight is used outside"):
                    capture(model, F.cross_entropy, x, y, {"a": model.a, "b": model.b})
            else:
                terms = capture(model, F.cross_entropy, x, y, {"a": model.a, "b": model.b})
                assert terms["a"][0].shape == (5, 2, 6) and terms["b"][0].shape == (5, 1, 6)


class _NeverCalled(nn.Module):
    """A Linear whose weight is only ever read by F.linear: the module itself is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(F.linear(x, self.fc.weight, self.fc.bias)))


class _SharedInput(nn.Module):
    """Two layers reading the same input (under autocast, one cached bf16 copy of a leaf x)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def _registered_twice(kind: str) -> tuple[nn.Module, set[str]]:
    """A model with one layer applied twice under two names, and the layers the identity takes:
    the Linear itself ("linear"), or a LayerNorm between Linears, whose parameters vmap takes."""
    if kind == "linear":
        layer = nn.Linear(6, 6)
        return nn.Sequential(layer, nn.Tanh(), layer, nn.Tanh(), nn.Linear(6, 3)).double(), {"0", "4"}
    norm = nn.LayerNorm(6)
    return nn.Sequential(nn.Linear(6, 6), norm, nn.Linear(6, 6), norm, nn.Linear(6, 3)).double(), {"0", "2", "4"}


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("kind", ["linear", "layernorm"])
def test_a_layer_registered_twice_keeps_its_parameters(name: str, kind: str) -> None:
    """One layer applied twice under two names (nn.Sequential(layer, ..., layer, ...)): one owner of
    its parameters, so a Linear keeps the identity with its two calls; vmap's path (the LayerNorm's
    parameters) leaves the model holding its own Parameters (torch's functional_call, left to
    itself, puts its tensors in their place, and the reference's call then computes from those);
    kernels and reference agree."""
    from kernels.per_sample import _plan

    torch.manual_seed(0)
    model, identity = _registered_twice(kind)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    assert set(_plan(model, [n for n, _ in model.named_parameters()], "error").linear) == identity
    own = dict(model.named_parameters(remove_duplicate=False))
    _both(name, model, x, y)  # kernels, then the reference
    assert all(q is own[n] for n, q in model.named_parameters(remove_duplicate=False))


def test_a_layer_never_called_owns_its_parameters() -> None:
    """Its weight used by F.linear elsewhere: vmap, and the reference's gradients (the first graph
    check gave it zero gradients, 3.83 off in sum)."""
    from kernels.layer_capture import Fallback, capture

    torch.manual_seed(0)
    model, x, y = _NeverCalled(), torch.randn(5, 6), torch.randint(0, 3, (5,))
    with pytest.raises(Fallback, match="fc: its weight is used outside"):
        capture(model, F.cross_entropy, x, y, {"fc": model.fc, "out": model.out})
    assert_dicts_close(kernels.per_sample_grads(model, F.cross_entropy, x, y),
                       reference.per_sample_grads(model, F.cross_entropy, x, y), ELEMENTWISE)


@pytest.mark.parametrize("autocast", [False, True])
def test_an_input_shared_by_two_layers_keeps_the_identity(autocast: bool) -> None:
    """x a leaf that requires grad, read by two layers: autocast's cached copy of x belongs to
    neither, so neither is flagged."""
    from kernels.layer_capture import capture

    model = _SharedInput()
    x, y = torch.randn(5, 6, requires_grad=True), torch.randint(0, 3, (5,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        terms = capture(model, F.cross_entropy, x, y, {"a": model.a, "b": model.b})
    assert set(terms) == {"a", "b"}


@pytest.mark.parametrize("name", FUNCS)
def test_a_batch_of_one_whose_output_loses_its_batch_dim(name: str) -> None:
    """``fc(x).squeeze()`` at B=1 returns (C,), not (1, C): the batched pass cannot give its
    per-sample losses, so vmap computes them (it raised a vmap error about a 0-d tensor)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    loss = lambda o, t: F.cross_entropy(o.reshape(-1, 3), t.reshape(-1))  # noqa: E731
    squeezed = lambda x: model(x).squeeze()  # noqa: E731
    wrapped = nn.Sequential()
    wrapped.fc, wrapped.forward = model, squeezed
    x, y = torch.randn(1, 4, dtype=torch.float64), torch.tensor([2])
    got, want = (getattr(side, name)(wrapped, loss, x, y) for side in (kernels, reference))
    assert_dicts_close(got, want, ELEMENTWISE) if isinstance(want, dict) else assert_close(got, want, REDUCTION)


class _MixesSlightly(nn.Module):
    """Subtracts a small multiple of the batch mean: samples mix, by far more than rounding."""

    def __init__(self, amount: float) -> None:
        super().__init__()
        self.fc, self.head, self.amount = nn.Linear(6, 6), nn.Linear(6, 3), amount

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(h - self.amount * h.mean(0, keepdim=True))


@pytest.mark.parametrize(("dtype", "amount"), [(torch.float32, 1e-4), (torch.float64, 1e-9)])
def test_the_probe_sees_samples_that_mix_by_ten_thousand_ulps(dtype, amount: float) -> None:
    """The probe's bound is min(64 eps, sqrt(eps)) normwise: mixing of ~1e4 ulps (fp32 gradients 1e-4
    off, past ELEMENTWISE) is seen and goes to vmap, which the reference agrees with."""
    from kernels.layer_capture import Fallback, capture

    torch.manual_seed(0)
    model, x, y = _MixesSlightly(amount).to(dtype), torch.randn(5, 6, dtype=dtype), torch.randint(0, 3, (5,))
    with pytest.raises(Fallback, match="the probe samples give other layer inputs or outputs"):
        capture(model, F.cross_entropy, x, y, {"fc": model.fc, "head": model.head})
    assert_dicts_close(kernels.per_sample_grads(model, F.cross_entropy, x, y),
                       reference.per_sample_grads(model, F.cross_entropy, x, y), ELEMENTWISE)


class _InfAtThree(nn.Module):
    """Adds 1 / (len(x) - 3) to its output: +inf for the probe's batch of 3, finite for the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x)) + 1 / x.new_tensor(len(x) - 3)


def test_a_probe_output_of_inf_is_not_close_to_a_finite_batch() -> None:
    """An error bound scaled by the probe's largest value would be inf, and any error within it: an
    inf value is not close, so the identity is not taken on a batch the probe did not reproduce."""
    from kernels.layer_capture import Fallback, capture

    torch.manual_seed(0)
    model, x, y = _InfAtThree().double(), torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(Fallback, match="the probe samples give other layer inputs or outputs"):
        capture(model, F.cross_entropy, x, y, {"fc": model.fc, "head": model.head})
    _both("per_sample_grads", model, x, y)


class _DepthByBatch(nn.Module):
    """Calls its Linear a second time in batches of more than 3: the probe's batch of 3 calls it once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(self.fc(torch.tanh(h)) if len(x) > 3 else h)


def test_a_probe_that_calls_the_layers_differently_takes_vmap() -> None:
    from kernels.layer_capture import Fallback, capture

    torch.manual_seed(0)
    model, x, y = _DepthByBatch().double(), torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(Fallback, match="the probe samples call the layers differently"):
        capture(model, F.cross_entropy, x, y, {"fc": model.fc, "head": model.head})
    _both("per_sample_grads", model, x, y)


class _ScalesItsInputLater(nn.Module):
    """Scales the Linear's input in place after the call: the captured input is no longer the one used."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        out = self.fc(h)
        h.mul_(3.0)
        return out + h[:, :3]


@pytest.mark.parametrize("side", [kernels, reference], ids=["kernels", "reference"])
def test_an_input_modified_in_place_after_the_call_is_not_captured(side) -> None:
    """The capture refuses it (its version counter moved); vmap then meets autograd's own refusal."""
    from kernels.layer_capture import Fallback, capture

    torch.manual_seed(0)
    model, x, y = _ScalesItsInputLater(), torch.randn(5, 6), torch.randint(0, 3, (5,))
    with pytest.raises(Fallback, match="fc: its input was modified in place after the call"):
        capture(model, F.cross_entropy, x, y, {"fc": model.fc})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        side.per_sample_grads(model, F.cross_entropy, x, y)


class _StoresItsActivation(nn.Module):
    """Keeps its first Linear's output on the model, for a loss_fn that reads it (an activity penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = self.fc(x)
        return self.head(torch.tanh(self.h))


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_a_loss_that_reads_an_activation_stored_on_the_model_is_refused_by_the_capture(batch: int) -> None:
    """The loss reaches fc's parameters through model.h, past the model's output: the identity would
    leave that term's gradient out. The probe's forwards run before the batch's, so model.h is the
    batch's when the loss reads it (run after, they left their own graph-less h: gradients silently
    off), and after a call the model holds what a forward of the batch leaves."""
    from kernels.layer_capture import capture

    torch.manual_seed(0)
    model, x, y = _StoresItsActivation(), torch.randn(batch, 6), torch.randint(0, 3, (batch,))
    loss = lambda o, t: F.cross_entropy(o, t) + model.h.pow(2).mean()  # noqa: E731
    with pytest.raises(ValueError, match=r"loss_fn reaches model parameter\(s\) \['fc.weight', 'fc.bias'\]"):
        capture(model, loss, x, y, {"fc": model.fc, "head": model.head})
    for name in FUNCS:
        with pytest.raises(ValueError, match="an activation the forward stored on the model"):
            getattr(kernels, name)(model, loss, x, y)
        getattr(kernels, name)(model, F.cross_entropy, x, y)
        assert model.h.shape == (batch, 6)


def test_functional_call_leaves_a_layer_registered_twice_its_own_tensors() -> None:
    """kernels._stateless.functional_call (vmap's path) puts back every parameter and buffer slot the
    call left changed, also when the call raises."""
    from kernels._stateless import functional_call

    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(norm, nn.Tanh(), norm)
    own = dict(norm.named_parameters()) | dict(norm.named_buffers())
    new = {n: t.detach() + 1 for n, t in [*model.named_parameters(), *model.named_buffers()]}
    functional_call(model, new, (torch.randn(3, 4),))
    assert all(t is own[n] for n, t in [*norm.named_parameters(), *norm.named_buffers()])
    with pytest.raises(RuntimeError):
        functional_call(model, new, (torch.randn(3, 5),))  # 5 features for 4
    assert all(t is own[n] for n, t in [*norm.named_parameters(), *norm.named_buffers()])
