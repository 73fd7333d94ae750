"""The DARTS finite-difference hypergradient of one unrolled inner step, and the reweighted loss.

Bilevel problem: inner parameters theta (a classifier) trained on L_in(theta, w), outer
parameters w (a reweighting net) trained on L_out(theta). One unrolled inner step
theta' = theta - lr * grad_theta L_in(theta, w) makes L_out a function of w; its gradient is

    dL_out(theta')/dw = -lr * (d^2 L_in / dw dtheta)(theta, w) . v,    v = grad L_out(theta'),

and the mixed second derivative along v is a central difference of two inner gradients
(DARTS, Betty's ``darts`` with unroll 1):

    -lr * [grad_w L_in(theta + eps v, w) - grad_w L_in(theta - eps v, w)] / (2 eps),  eps = alpha / |v|.

Cost: one forward/backward of L_out for v, and two evaluations of grad_w L_in with theta held
as plain tensors (no autograd graph through the inner model: when L_in reaches w only through
weights of detached losses, the inner model runs forward only). The perturbed parameters go
through ``torch.func.functional_call``: the module's own parameters and buffers are never
touched (Betty perturbs them in place and adds eps v back, which leaves rounding behind).

Truncation error O(eps^2) (central difference) on smooth networks, rounding O(u |grad_w L_in| /
eps): alpha = 0.01 (Betty's default) balances them in fp32 (measured in
correctness_tests/test_hypergrad.py). On ReLU networks theta +- eps v crosses kinks and the error
falls only about as eps (evidence/from-the-code.md). The difference of two nearly equal
gradients is why the evaluations at theta +- eps v run with autocast disabled, whatever
``autocast_dtype`` does to the v pass, on parameters that must be fp32 or fp64 (in bf16 or fp16
theta +- eps v would round most of the perturbation away), and why both draw the same random
numbers (dropout: the RNG state before the first is restored for the second).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from kernels import checks
from kernels._stateless import functional_call
from kernels.distributed import active, all_mean_, unwrap

Forward = Callable[..., Tensor]  # the inner module's forward at some parameters
LossClosure = Callable[[Forward], Tensor]  # a scalar loss computed with that forward


def reweighted_loss(losses: Tensor, weight_net: nn.Module, weight_inputs: Tensor | None = None) -> Tensor:
    """mean_i W(l_i; w) * l_i for per-sample losses (B,), W = ``weight_net`` on (B, 1) inputs.

    W sees ``weight_inputs`` (default: ``losses.detach()``), so no gradient flows through W's
    input. A hypergradient closure MUST pass the losses at the unperturbed theta as
    ``weight_inputs``: with the default, the finite difference moves W's inputs too and computes
    another quantity (off by O(1) from the exact hypergradient, measured in the tests).
    NaN losses propagate to the result (no host sync per step); the engine refuses a NaN loss.
    """
    checks.tensor(losses, "losses", ndim=1, floating=True, nonempty=True, shape="(B,) (per-sample losses)")
    checks.module(weight_net, "weight_net")
    for p in weight_net.parameters():  # a device check costs no sync; the first parameter stands for all
        checks.same_device({"losses": losses, "weight_net's parameters": p})
        break
    if weight_inputs is not None:
        checks.tensor(weight_inputs, "weight_inputs", floating=True, shape=f"{tuple(losses.shape)}, like losses")
    inputs = losses.detach() if weight_inputs is None else weight_inputs.detach()
    if inputs.shape != losses.shape:
        raise ValueError(f"weight_inputs must match losses {tuple(losses.shape)}, got {tuple(inputs.shape)}")
    weights = weight_net(inputs.unsqueeze(1))
    if weights.shape not in ((len(losses), 1), (len(losses),)):
        raise ValueError(f"weight_net must return one weight per sample, (B, 1) or (B,) with B = {len(losses)}; "
                         f"got {tuple(weights.shape)}")
    return (weights.reshape(-1) * losses).mean()


def _closures(value: LossClosure | Sequence[LossClosure], name: str) -> list[LossClosure]:
    """One closure, or one per micro-batch (the loss is their mean: gradient accumulation)."""
    fns = [value] if callable(value) else list(value)
    if not fns or not all(callable(f) for f in fns):
        raise ValueError(f"{name} must be a loss closure f -> scalar, or a non-empty sequence of them "
                         f"(micro-batches); got {value!r} (an empty {name.split('_')[0]} set?)")
    return fns


def _mean_grad(fns: list[LossClosure], forward: Forward, wrt: list[Tensor], name: str) -> list[Tensor]:
    """grad of mean_j fns[j](forward) w.r.t. ``wrt``, one micro-batch graph alive at a time. The
    mean of per-micro-batch means is the batch mean only for equal micro-batches."""
    total = [torch.zeros_like(t) for t in wrt]
    for fn in fns:
        loss = fn(forward)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            raise ValueError(f"{name} must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
        if not loss.requires_grad:  # it reaches none of wrt (an un-reweighted micro-batch, a frozen weighting
            continue  # net): a zero term, where autograd would refuse the call
        grads = torch.autograd.grad(loss / len(fns), wrt, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt, strict=True)]
        torch._foreach_add_(total, grads)
    return total


def _size(v: list[Tensor]) -> float:
    """|v| over all of v's tensors, in float64: fp32 and bf16 squares stay inside its range; fp64
    ones that left it (values under 1e-154 or over 1e154) are taken over v's largest magnitude."""
    def size(scale: float) -> float:
        parts = [torch.linalg.vector_norm(t / scale if scale != 1.0 else t, dtype=torch.float64) for t in v]
        return scale * torch.linalg.vector_norm(torch.stack(parts)).item()

    norm = size(1.0)
    if norm == 0.0 or math.isinf(norm):
        big = torch.stack([t.detach().abs().amax().double() for t in v if t.numel()]).max().item()
        if 0.0 < big < math.inf:
            norm = size(big)
    return norm


def _check(inner: nn.Module, outer: list[Tensor], lr: float, alpha: float) -> list[tuple[str, Tensor]]:
    checks.module(inner, "inner")
    named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("inner has no parameters that require grad")
    low = [(n, p.dtype) for n, p in named if p.dtype not in (torch.float32, torch.float64)]
    if low:
        raise TypeError(f"inner parameter {low[0][0]!r} is {low[0][1]}: theta +- eps v needs fp32 or fp64 "
                        "parameters (in half precision the perturbation rounds away); keep the parameters "
                        "in fp32 and pass autocast_dtype=torch.bfloat16 for the v pass")
    if not outer or not all(isinstance(w, Tensor) and w.requires_grad for w in outer):
        raise ValueError("outer_params must be a non-empty iterable of tensors that require grad")
    # an outer parameter inside inner would be perturbed as theta and held fixed as w at once: its
    # hypergradient came back zero (DARTS's architecture weights kept in the model, say)
    mine = {id(p): n for n, p in inner.named_parameters()}
    inside = [(i, mine[id(w)]) for i, w in enumerate(outer) if id(w) in mine]
    if inside:
        i, name = inside[0]
        raise ValueError(f"outer_params[{i}] is inner's parameter {name!r}: outer parameters must live outside "
                         "inner (a weighting network's), since every inner parameter is perturbed as theta; "
                         "keep them in a module of their own, or freeze them in inner (requires_grad_(False)) "
                         "and pass a copy the inner loss reads")
    checks.same_device({**{f"inner parameter {n!r}": p for n, p in named},
                        **{f"outer_params[{i}]": w for i, w in enumerate(outer)}})
    checks.number(lr, "lr", low=0, low_open=True)
    checks.number(alpha, "alpha", low=0, low_open=True)
    return named


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def darts_hypergradient(
    inner: nn.Module,
    inner_loss: LossClosure | Sequence[LossClosure],
    outer_loss: LossClosure | Sequence[LossClosure],
    outer_params: Iterable[Tensor],
    *,
    lr: float,
    alpha: float = 0.01,
    at: Mapping[str, Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[Tensor]:
    """dL_out/dw through one unrolled inner SGD step of learning rate ``lr``, by finite differences.

    The step may carry momentum and weight decay (no dampening, no Nesterov): they do not depend
    on w, so the step's derivative is -lr d(grad_theta L_in)/dw whatever theta' they produced.

    inner: the inner model holding theta' (its parameters AFTER the inner step).
    inner_loss / outer_loss: closures ``f -> scalar`` where ``f(*args)`` is ``inner``'s forward at
        the parameters being evaluated, or sequences of them (micro-batches, averaged). L_in must
        reach theta only through ``f``: a stop-gradient input computed from theta (W's detached
        losses) must be precomputed at theta and captured, or the difference also differentiates
        through it (an O(1) bias that no eps removes; measured in the tests).
    outer_params: w, the tensors the result is the gradient of (requires_grad).
    at: theta, the inner parameters BEFORE the step, by name (only those that require grad).
        None: theta' itself, as Betty does (it keeps no copy), an O(lr) approximation.
    autocast_dtype: autocast for the v pass (torch.bfloat16, or None for fp32).
    Returns one tensor per outer parameter, shaped like it. Raises FloatingPointError when v or the
    result is not finite. The module's parameters, buffers and .grad fields are left as they were.

    Data parallel: ``inner`` wrapped in DistributedDataParallel (kernels.distributed) and each
    rank's closures on its own shard of the inner and meta batches (equal shards): v is averaged
    over the ranks before eps is taken, each rank's finite difference runs on its shard, and the
    differences are averaged, so every rank returns the hypergradient of the global batches.
    ``at`` is keyed by the wrapped module's names (``unwrap(inner).named_parameters()``).
    """
    if isinstance(outer_params, Tensor):  # list() would split it into rows, none of them in the graph
        raise TypeError("outer_params must be an iterable of tensors, got a Tensor; pass [w]")
    outer = list(outer_params)
    data_parallel = isinstance(inner, DistributedDataParallel) and active()
    inner = unwrap(inner)
    named = _check(inner, outer, lr, alpha)
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(f"autocast_dtype must be None or torch.bfloat16, got {autocast_dtype} (fp16 gradients of "
                         "the outer loss would need a loss scaler)")
    inner_fns, outer_fns = _closures(inner_loss, "inner_loss"), _closures(outer_loss, "outer_loss")
    names = [n for n, _ in named]
    after = [p.detach() for _, p in named]
    if at is None:
        before = after
    else:
        missing = [n for n in names if n not in at]
        if missing:
            raise ValueError(f"at is missing inner parameters {missing[:3]}{'...' if len(missing) > 3 else ''}")
        wrong = [n for n in names if not isinstance(at[n], Tensor)]
        if wrong:
            raise TypeError(f"at[{wrong[0]!r}] must be a tensor (the parameter before the step), got "
                            f"{type(at[wrong[0]]).__name__}")
        before = [at[n].detach() for n in names]
        bad = [n for n, b, a in zip(names, before, after, strict=True)
               if b.shape != a.shape or b.device != a.device or b.dtype != a.dtype]
        if bad:
            raise ValueError(f"at[{bad[0]!r}] must match the parameter's shape, dtype and device")
    buffers = {n: b.clone() for n, b in inner.named_buffers()}  # BN running stats: copies, left untouched

    def forward_at(values: list[Tensor]) -> Forward:
        state = {**dict(zip(names, values, strict=True)), **buffers}
        return lambda *args, **kwargs: functional_call(inner, state, args, kwargs)

    leaves = [a.detach().requires_grad_() for a in after]  # new leaves sharing the parameters' storage
    with torch.autocast(after[0].device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        v = _mean_grad(outer_fns, forward_at(leaves), leaves, "outer_loss")
    if data_parallel:
        all_mean_(v)  # v of the global meta batch: every rank perturbs along the same direction
    norm = _size(v)
    if not math.isfinite(norm):
        raise FloatingPointError(f"the outer loss's gradient v is not finite (|v| = {norm}); check the meta batch")
    if norm == 0.0:  # the outer loss is flat in theta': the hypergradient is exactly zero
        return [torch.zeros_like(w) for w in outer]
    eps = alpha / norm
    device = after[0].device
    with torch.autocast(device.type, enabled=False):
        # the same dropout masks at theta + eps v and theta - eps v: the first's draws are put back
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            plus = _mean_grad(inner_fns, forward_at(torch._foreach_add(before, v, alpha=eps)), outer, "inner_loss")
        minus = _mean_grad(inner_fns, forward_at(torch._foreach_add(before, v, alpha=-eps)), outer, "inner_loss")
    torch._foreach_sub_(plus, minus)
    torch._foreach_mul_(plus, -lr / (2 * eps))
    if data_parallel:
        all_mean_(plus)  # the mean of the shards' differences: the difference of the global inner loss
    checks.finite({f"the hypergradient of outer_params[{i}]": g for i, g in enumerate(plus)},
                  error=FloatingPointError, hint="the inner loss at theta +- eps v gave inf/NaN (check the held "
                                                 "weight inputs and the inner batch)")
    return plus
