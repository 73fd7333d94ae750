"""Per-sample gradients, their Gram matrix and their norms, without a loop over samples.

Sample i's gradient is g_i = d/dtheta loss_fn(model(x_i[None]), y_i[None]): its own loss, as a
batch of one, so the result does not depend on the loss's reduction.

- ``nn.Linear`` layers (the class itself, running its own forward: not one set on the instance,
  which may compute anything) use the layer identity on their own weight and bias (a child
  module's parameters go through vmap): g_i(W) = sum_t b_it a_it^T, with a the layer input
  and b the gradient of the layer output (t runs over extra token dims and repeated calls).
  One batched forward and one backward to the layer outputs give every a and b
  (``kernels.layer_capture``, which checks the identity's assumptions on every call and falls
  back to vmap for the whole model when one fails: time-major layers, samples that mix, weights
  used outside their layer).
  Gram: <g_i(W), g_j(W)> = sum_{t,s} (a_it . a_js)(b_it . b_js) ("ghost" identity), no g_i built.
- Every other trainable parameter goes through ``torch.func.vmap(grad(...))`` with
  ``functional_call``, materialized (these are the only per-sample gradients a Gram builds).
  Conv2d included: its identity (unfold patches, batched matmul) measured slower than vmap on
  3x32x32 inputs (evidence/from-the-code.md).
- per_sample_grads uses the identity only when every trainable parameter has it: a model that
  mixes (identity pass + vmap pass) measured slower than one vmap pass. The Gram keeps the mix:
  ghost products spare it materializing the big Linear layers.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from kernels import checks, hugepages, nontemporal
from kernels._stateless import functional_call
from kernels.ghost import GhostTerms, qualified
from kernels.ghost import Plan as _Plan
from kernels.layer_capture import (
    BARE_LOSSES,
    Fallback,
    LossFn,
    capture,
    loss_parameters,
    own_parameters,
    refuse_loss_parameters,
)

RANDOMNESS = ("error", "different", "same")


def check_inputs(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                 randomness: str = "error", chunk_size: int | None = None) -> list[str]:
    """Validate a per-sample-gradient call; returns the trainable parameter names.

    Shared by the kernel and the reference so both refuse the same inputs the same way. NaN or
    inf in the inputs, floating targets or trainable parameters is refused (one host sync for
    all of them): every gradient it touches would be NaN.
    """
    return list(_trainable(model, loss_fn, inputs, targets, randomness, chunk_size))


def _trainable(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, randomness: str,
               chunk_size: int | None) -> dict[str, nn.Parameter]:
    """``check_inputs``' checks; the trainable parameters by name, in ``named_parameters`` order."""
    checks.module(model, "model")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, target) -> scalar, got {loss_fn!r}")
    checks.tensor(inputs, "inputs", min_ndim=1, shape="(B, ...)")
    checks.tensor(targets, "targets", min_ndim=1, shape="(B, ...)")
    if not inputs.is_floating_point():
        raise TypeError(f"inputs must be a floating-point tensor, got {inputs.dtype}; cast with .float() (integer "
                        "token ids: embed them before the call, detached; the embedding's own per-sample "
                        "gradients are then not computed)")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"batch size mismatch: inputs has {inputs.shape[0]} samples, targets has "
                         f"{targets.shape[0]}; pass one target per sample")
    checks.choice(randomness, "randomness", RANDOMNESS)
    if chunk_size is not None:
        checks.integer(chunk_size, "chunk_size", low=1)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in trainable]
    if not names:
        raise ValueError("model has no parameter with requires_grad=True: nothing to differentiate")
    for what, t in (("inputs", inputs), ("targets", targets)):
        # per-sample gradients here are of each sample's loss through the model, its batch given:
        # neither may be a trainable parameter itself or reach one through its graph
        reached = loss_parameters(t, (), model) if t.grad_fn is not None else [n for n, p in trainable if p is t]
        if reached:
            how = "carry an autograd graph reaching" if t.grad_fn is not None else "are"
            raise ValueError(f"{what} {how} model parameter(s) {reached[:3]} (computed from the model, e.g. an "
                             f"embedding, or the parameter itself): per-sample gradients through them are not "
                             f"computed; pass {what}.detach(), or compute them inside the model's forward")
    hooked = [n for n, p in trainable if p._backward_hooks]
    if hooked:
        raise ValueError(f"model parameter(s) {hooked[:3]} have gradient hooks (Tensor.register_hook): per-sample "
                         "gradients are the loss's own, which a hook on the batch gradient would not change "
                         "alike; remove the hooks for the call")
    for mname, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            raise ValueError(
                f"model.{mname} is a {type(m).__name__} using batch statistics (train mode): it "
                "mixes samples, so per-sample gradients are undefined and it cannot be vmapped; "
                "call model.eval() or replace it with GroupNorm")
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0 and randomness == "error":
            raise ValueError(
                f"model.{mname} is {type(m).__name__}(p={m.p}) in train mode: per-sample gradients "
                "are random; call model.eval(), or pass randomness='different' (own mask per "
                "sample) or 'same' (one mask shared by all samples)")
    params = dict(trainable)
    p0 = params[names[0]]
    if inputs.device != p0.device:
        raise ValueError(f"inputs are on {inputs.device} but model parameters on {p0.device}; "
                         "move both to one device")
    if inputs.dtype != p0.dtype:
        raise TypeError(f"inputs are {inputs.dtype} but model parameters are {p0.dtype}; "
                        f"cast inputs with .to({p0.dtype})")
    checks.finite({"inputs": inputs, "targets": targets, **{f"model parameter {n!r}": params[n] for n in names}},
                  hint="per-sample gradients of non-finite values are NaN; clean the batch or the model")
    return params


RESULT_HINT = ("the inputs and parameters are finite, so the loss or the model overflowed or divided by zero "
               "for some sample (e.g. log(0)); compute the loss in a stable form (log_softmax, cross_entropy) "
               "or in a wider dtype")


def check_result(named: dict[str, Tensor]) -> None:
    """Finite results from inputs check_inputs found finite, or FloatingPointError: the loss or
    the model overflowed or divided by zero for some sample (log(0), a softmax of inf)."""
    checks.finite(named, error=FloatingPointError, hint=RESULT_HINT)


def _plan(model: nn.Module, names: list[str], randomness: str) -> _Plan:
    if randomness != "error":
        # Live dropout: the identity's checks compare forwards, which random masks make differ,
        # so vmap (torch.func's own randomness handling) does everything.
        return _Plan(names, {}, names)
    # how many modules own each parameter: a layer registered under two names is one owner (its
    # calls are the identity's repeated calls), a parameter tied into two modules has two
    counts: dict[int, int] = {}
    modules = list(model.named_modules())
    for _, m in modules:
        for _, p in own_parameters(m):
            counts[id(p)] = counts.get(id(p), 0) + 1
    linear, covered = {}, set()
    for mname, m in modules:
        if not _has_identity(m):
            continue
        own = own_parameters(m)  # a child module's parameters are not the identity's
        if any(p.requires_grad for _, p in own) and all(counts[id(p)] == 1 for _, p in own):  # tied: vmap
            linear[mname] = m
            covered.update(qualified(mname, n) for n, _ in own)
    return _Plan(names, linear, [n for n in names if n not in covered])


def _has_identity(m: nn.Module) -> bool:
    """A plain Linear computing nn.Linear's own forward (none set on the instance, as a wrapper may
    set one that uses the weight again or a child module) whose own parameters are its weight and
    bias (weight_norm's g/v are not)."""
    if type(m) is not nn.Linear:  # most modules: nothing more to look at
        return False
    own = {n for n, _ in own_parameters(m)}
    return own <= {"weight", "bias"} and isinstance(m.weight, nn.Parameter) and "forward" not in vars(m)


def _terms(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, plan: _Plan,
           outputs: list[Tensor] | None = None) -> tuple[_Plan, dict[str, tuple[Tensor, Tensor]]]:
    """Captured (A, G) per identity layer in the weight's dtype (an autocast forward captures
    them in bf16/fp16), or an all-vmap plan when a capture check fails. ``outputs``: capture's."""
    if not plan.linear:
        return plan, {}
    try:
        terms = capture(model, loss_fn, inputs, targets, plan.linear, outputs)
    except Fallback:
        return _Plan(plan.names, {}, plan.names), {}
    dtypes = {n: plan.linear[n].weight.dtype for n in terms}
    return plan, {n: (a.to(dtypes[n]), g.to(dtypes[n])) for n, (a, g) in terms.items()}


def _vmap_grads(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                names: list[str], randomness: str, chunk_size: int | None) -> dict[str, Tensor]:
    """Per-sample gradients of ``names`` by vmap(grad); other parameters held constant. A loss_fn
    of the user's own is first run on sample 0's output (one more forward of one sample, its RNG
    state kept), to refuse one that reaches a parameter other than through the output, which
    functional_call would differentiate without that term."""
    if loss_fn not in BARE_LOSSES:
        on = inputs.device
        with torch.random.fork_rng(devices=[] if on.type == "cpu" else [on], device_type=on.type):
            out = model(inputs[:1])
            loss = loss_fn(out, targets[:1])
        if isinstance(loss, Tensor):  # a tuple or dict output too: every tensor in it ends the walk
            refuse_loss_parameters(loss_parameters(loss, out, model))
    params = dict(model.named_parameters())
    diff = {n: params[n].detach() for n in names}
    const = {n: p.detach() for n, p in params.items() if n not in diff}
    buffers = dict(model.named_buffers())

    def loss_one(d: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, (d, const, buffers), (x.unsqueeze(0),))
        loss = loss_fn(out, y.unsqueeze(0))
        if loss.ndim != 0:
            raise ValueError(f"loss_fn must return a scalar per sample, got shape {tuple(loss.shape)}")
        return loss

    try:
        return vmap(grad(loss_one), in_dims=(None, 0, 0), randomness=randomness,
                    chunk_size=chunk_size)(diff, inputs, targets)
    except RuntimeError as e:
        if "setup_context" not in str(e):
            raise
        raise ValueError("model calls an autograd.Function torch.func cannot transform (one without "
                         "setup_context, such as torch.utils.checkpoint(..., use_reentrant=True)), on a path "
                         "its per-sample gradients take through vmap; use checkpoint(..., use_reentrant=False), "
                         "or reference.per_sample_grads (a loop of backward passes)") from e


def _empty(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].new_zeros((0, *params[n].shape)) for n in names}


def check_out(params: dict[str, nn.Parameter], batch: int, out: dict[str, Tensor]) -> None:
    """``out`` of ``per_sample_grads``: one (B, *param.shape) tensor per trainable parameter (``params``,
    by name), in the parameter's dtype and device, contiguous, and no two sharing memory."""
    if not isinstance(out, dict):
        raise TypeError(f"out must be a dict {{name: Tensor(B, *param.shape)}}, got {type(out).__name__}")
    names = list(params)
    if set(out) != set(names):
        raise ValueError(f"out must have exactly the trainable parameters' names; missing "
                         f"{sorted(set(names) - set(out))}, unexpected {sorted(set(out) - set(names))}")
    for n in names:
        t, p = out[n], params[n]
        want = (batch, *p.shape)
        if not isinstance(t, Tensor) or tuple(t.shape) != want or t.dtype != p.dtype or t.device != p.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"out[{n!r}] must be {want} {p.dtype} on {p.device} (batch, *param.shape), got {got}")
        if not t.is_contiguous():
            raise ValueError(f"out[{n!r}] must be contiguous")
    shared = checks.overlapping(out)
    if shared is not None:
        raise ValueError(f"out's tensors must not share memory: out[{shared[0]!r}] and out[{shared[1]!r}] do; "
                         "pass a tensor of its own for each (e.g. the previous call's result)")
    for n, t in out.items():
        checks.writable(t, f"out[{n!r}]")


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                     chunk_size: int | None = None, randomness: str = "error",
                     out: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Gradient of each sample's own loss: ``{name: Tensor(B, *param.shape)}``.

    inputs (B, ...) floating, targets (B, ...); B = 0 gives (0, *param.shape) tensors. Parameters
    with requires_grad=False are skipped. NaN or inf in the inputs or parameters is refused
    (ValueError); a non-finite gradient from finite ones raises FloatingPointError.
    ``chunk_size`` bounds how many samples vmap processes at once (non-Linear layers only).
    ``randomness`` is torch.func's: 'error' refuses active dropout; 'different' or 'same'.
    ``out``: tensors to write the result into (the same dict is returned), e.g. the previous
    call's result: the B x P result is then not allocated afresh on every call, which under
    glibc's default malloc page-faults every page of it (in huge pages where Linux offers them:
    kernels.hugepages).
    """
    params = _trainable(model, loss_fn, inputs, targets, randomness, chunk_size)
    names = list(params)
    if out is not None:
        check_out(params, inputs.shape[0], out)
    if inputs.shape[0] == 0:
        return out if out is not None else _empty(model, names)
    plan = _plan(model, names, randomness)
    if plan.other:  # identity + vmap passes measured slower than one vmap pass (module note)
        plan = _Plan(names, {}, names)
    plan, terms = _terms(model, loss_fn, inputs, targets, plan)
    with torch.autocast(inputs.device.type, enabled=False):  # gradients in the weights' dtype
        result, read = _from_terms(plan, terms, inputs.shape[0], out)
    # Checked where it is cheap: an identity layer's gradient is a sum of T products of its
    # captured terms, so the terms are read rather than the B x P result (a pass over it is a
    # measurable share of the call), or their largest magnitudes taken from the streamed write
    # that read them (``read``); vmap's gradients are read.
    checked: dict[str, Tensor | tuple[float, float]] = {
        f"the captured {k} of layer {m!r}": (-read[m][i], read[m][i]) if m in read else t
        for m, (a, g) in terms.items() for i, (k, t) in enumerate((("inputs", a), ("output gradients", g)))}
    if plan.other:
        grads = _vmap_grads(model, loss_fn, inputs, targets, plan.other, randomness, chunk_size)
        for n, g in grads.items():
            result[n] = g if out is None else out[n].copy_(g)
            checked[f"the per-sample gradient of {n!r}"] = result[n]
    found = checks.finite_extremes(checked, error=FloatingPointError, hint=RESULT_HINT)
    check_result(_may_overflow(terms, found, result))
    return out if out is not None else {n: result[n] for n in names}


def _may_overflow(terms: dict[str, tuple[Tensor, Tensor]], found: dict[str, tuple[float, float]],
                  result: dict[str, Tensor]) -> dict[str, Tensor]:
    """The identity layers' gradients that finite terms could still overflow, by name: where T
    max|a| max|g| (the weight's) or T max|g| (the bias's) passes the dtype's largest value."""
    risky = {}
    for m, (a, _) in terms.items():
        top = torch.finfo(a.dtype).max
        big_a, big_g = (max(map(abs, found.get(f"the captured {k} of layer {m!r}", (0.0, 0.0))))
                        for k in ("inputs", "output gradients"))
        for n, bound in (("weight", a.shape[1] * big_a * big_g), ("bias", a.shape[1] * big_g)):
            if qualified(m, n) in result and bound > top:
                risky[f"the per-sample gradient of {qualified(m, n)!r}"] = result[qualified(m, n)]
    return risky


def _from_terms(plan: _Plan, terms: dict[str, tuple[Tensor, Tensor]], batch: int,
                into: dict[str, Tensor] | None = None) -> tuple[dict[str, Tensor], dict[str, tuple[float, float]]]:
    """Per-sample gradients of the identity layers, written into ``into``'s tensors when given;
    and, by layer, the largest |a| and |g| of its terms where the streamed write read them all
    (``nontemporal.outer_all``; NaN where one was NaN)."""
    out: dict[str, Tensor] = {}
    into = into or {}
    # a result larger than the CPU's last-level cache cannot stay cached for its reader: its
    # outer products are written by streaming stores, which skip reading each line first
    stream = nontemporal.pays(sum(batch * plan.linear[n].weight.numel() * plan.linear[n].weight.element_size()
                                  for n, (a, _) in terms.items()
                                  if plan.linear[n].weight.requires_grad and a.shape[1] == 1))
    given: dict[str, tuple[Tensor, Tensor, Tensor]] = {}  # by layer: one-row products into out=, written together
    for mname, (a, g) in terms.items():
        weight, bias = qualified(mname, "weight"), qualified(mname, "bias")
        m = plan.linear[mname]
        if m.weight.requires_grad:
            # One row per sample (T = 1): the outer product g_i a_i^T as a broadcast multiply, one
            # sequential write of (B, out, in), which a K=1 bmm is not on every CPU; rows (T > 1):
            # (B, out, T) @ (B, T, in) by bmm (measured in docs/kernels/per_sample.md).
            # A fresh result in huge pages: writing it faults 2 MiB at a time (kernels.hugepages),
            # the way its calls' times chose for this kind of write (T rows by bmm, or one row).
            w, site = into.get(weight), f"per_sample_grads T={a.shape[1]}"
            if w is not None and a.shape[1] == 1:
                given[mname] = (g.transpose(1, 2), a, w)
            else:
                with (contextlib.nullcontext(w) if w is not None
                      else hugepages.fresh((batch, *m.weight.shape), like=a, site=site)) as w:
                    if a.shape[1] == 1:
                        out[weight] = nontemporal.outer(g.transpose(1, 2), a, w, stream=stream)
                    else:
                        out[weight] = torch.bmm(g.transpose(1, 2), a, out=w)
        if m.bias is not None and m.bias.requires_grad:
            # one row: g_i itself, copied (a sum over one row is a slower copy)
            b, one = into.get(bias), g[:, 0] if g.shape[1] == 1 else None
            if one is not None:
                out[bias] = b.copy_(one) if b is not None else one.clone()
            else:
                out[bias] = torch.sum(g, dim=1, out=b) if b is not None else g.sum(dim=1)
    written, reads = nontemporal.outer_all(list(given.values()), stream=stream)
    out.update((qualified(mname, "weight"), w) for mname, w in zip(given, written, strict=True))
    read = {} if reads is None else {mname: (big_a, big_g) for (mname, (_, _, w)), (big_g, big_a)
                                     in zip(given.items(), reads, strict=True) if w.numel()}
    for mname, m in plan.linear.items():  # layers never called get zero gradients
        if mname not in terms:
            for n, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    z = into.get(qualified(mname, n))
                    out[qualified(mname, n)] = z.zero_() if z is not None else p.new_zeros((batch, *p.shape))
    return out, read


def ghost_terms(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                chunk_size: int | None = None, randomness: str = "error",
                names: list[str] | None = None) -> GhostTerms:
    """Validate, then capture what Gram products of the batch's per-sample gradients need.
    inputs (B, ...) with B >= 1. ``names``: the trainable names ``check_inputs`` returned for
    exactly these arguments, from a caller that ran it (the check is a pass over the inputs)."""
    if names is None:
        names = check_inputs(model, loss_fn, inputs, targets, randomness, chunk_size)
    outputs: list[Tensor] = []
    plan, terms = _terms(model, loss_fn, inputs, targets, _plan(model, names, randomness), outputs)
    grads = _vmap_grads(model, loss_fn, inputs, targets, plan.other, randomness, chunk_size) if plan.other else {}
    return GhostTerms(plan, terms, grads, inputs.shape[0], inputs.new_zeros(()), outputs[0] if outputs else None)


def _from_ghost(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, chunk_size: int | None,
                randomness: str, norms: bool) -> Tensor:
    """The Gram matrix (B, B), or (``norms``) the per-sample norms (B,), from one capture, checked finite."""
    names = check_inputs(model, loss_fn, inputs, targets, randomness, chunk_size)
    if inputs.shape[0] == 0:
        return inputs.new_zeros((0,) if norms else (0, 0))
    terms = ghost_terms(model, loss_fn, inputs, targets, chunk_size=chunk_size, randomness=randomness, names=names)
    result = terms.norms() if norms else terms.gram()
    check_result({"the per-sample gradients' norms" if norms else "the Gram matrix": result})
    return result


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def per_sample_grad_gram(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                         chunk_size: int | None = None, randomness: str = "error") -> Tensor:
    """G (B, B) with G[i, j] = <g_i, g_j> over all trainable parameters; B = 0 gives (0, 0).
    Non-finite inputs, parameters or results are refused as in ``per_sample_grads``.

    Linear layers by the ghost identity, no per-sample gradient built; other layers materialized.
    """
    return _from_ghost(model, loss_fn, inputs, targets, chunk_size, randomness, norms=False)


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                          chunk_size: int | None = None, randomness: str = "error") -> Tensor:
    """|g_i| (B,) over all trainable parameters: the square root of the Gram's diagonal;
    B = 0 gives (0,). Non-finite inputs, parameters or results are refused as in ``per_sample_grads``."""
    return _from_ghost(model, loss_fn, inputs, targets, chunk_size, randomness, norms=True)
