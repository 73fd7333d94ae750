"""One batched pass that captures every Linear layer's inputs and output gradients, checked.

The Linear identity g_i(W) = sum_t b_it a_it^T holds only under assumptions a forward hook
cannot see, so each is checked and any failure raises ``Fallback`` (the caller then uses vmap,
which needs none of them):

- the layer sees the batch in dim 0 and samples do not mix: a probe forward of the first and
  last samples must reproduce their layer inputs (shape and value) and model outputs. This
  catches time-major layers (T, B, d), cross-sample ops such as ``h - h.mean(0)``, a shift
  between neighbours, position encodings indexed by the batch, functional dropout. Mixing
  that leaves both probed samples unchanged is not seen: samples must be independent;
- the weight is used by its own module's call only: a TorchFunctionMode watches every op of the
  forward for the watched parameters (tied or functionally reused weights);
- a captured input is not modified in place later (its version counter is compared);
- in-place ops after the layer (``ReLU(inplace=True)``, ``out += x``) would rebase the layer
  output, so the hook hands the rest of the model a clone and keeps the original; it runs
  before user forward hooks, and a layer called under no_grad is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap
from torch.overrides import TorchFunctionMode

LossFn = Callable[[Tensor, Tensor], Tensor]


class Fallback(Exception):
    """The identity's assumptions do not hold for this model and batch: use vmap."""


def _tensors(obj: object) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _WatchParams(TorchFunctionMode):
    """Flags any op on a watched parameter outside its owning module's own call."""

    def __init__(self, owners: dict[int, nn.Module]) -> None:
        super().__init__()
        self.owners, self.active, self.outside = owners, [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Property reads count when they give a tensor (.T, .mT, .data); .shape, .dtype do not.
        if not self.outside and (getattr(func, "__name__", "") != "__get__" or isinstance(out, Tensor)):
            for t in _tensors((args, kwargs)):
                owner = self.owners.get(id(t))
                if owner is not None and (not self.active or self.active[-1] is not owner):
                    self.outside = True
        return out


def _all_close(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """Each (a, b) equal up to rounding: same shape, normwise error within min(64 eps, sqrt(eps))
    of the dtype. Batched and single-sample forwards of an MLP differed by 2-6 eps (fp32, fp64)
    and 0 (bf16); a tight bound errs towards vmap (slower), never towards a wrong result.
    One device sync for all pairs."""
    pairs = [(a, b) for a, b in pairs if b.numel()]
    if any(a.shape != b.shape for a, b in pairs):
        return False
    if not pairs:
        return True
    inf = float("inf")
    err = torch.stack([torch.linalg.vector_norm(a - b, inf, dtype=torch.float64) for a, b in pairs])
    scale = torch.stack([torch.linalg.vector_norm(b, inf, dtype=torch.float64) for _, b in pairs])
    info = [torch.finfo(b.dtype) for _, b in pairs]
    tol = torch.tensor([min(64 * f.eps, f.eps**0.5) for f in info], dtype=torch.float64, device=err.device)
    tiny = torch.tensor([f.tiny for f in info], dtype=torch.float64, device=err.device)
    return bool((err <= tol * torch.maximum(scale, tiny)).all())


def _record(layers: dict[str, nn.Module], seen: dict[str, list], batch: int | None,
            watch: _WatchParams | None) -> list:
    """Register hooks that append (input, version, output) per call; returns the handles."""

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if watch is not None:
            watch.active.append(mod)

    def post(name: str):
        def fn(mod: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
            if watch is not None:
                watch.active.pop()
            x = args[0] if args else kwargs["input"]
            if batch is not None and (x.shape[0] != batch or out.shape[0] != batch):
                raise Fallback(f"{name}: batch not in dim 0")
            if batch is not None and not out.requires_grad:
                raise Fallback(f"{name}: called under no_grad (or a reentrant checkpoint)")
            seen[name].append((x.detach(), x._version, out))
            return out.clone()
        return fn

    handles = []
    for name, m in layers.items():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        # prepend: see the layer's own output, before any user hook changes it
        handles.append(m.register_forward_hook(post(name), with_kwargs=True, prepend=True))
    return handles


def _forward(model: nn.Module, x: Tensor, layers: dict[str, nn.Module], batch: int | None,
             watch: _WatchParams | None) -> tuple[object, dict[str, list]]:
    seen: dict[str, list] = {name: [] for name in layers}
    handles = _record(layers, seen, batch, watch)
    try:
        if watch is None:
            return model(x), seen
        with watch:
            return model(x), seen
    finally:
        for h in handles:
            h.remove()


def _probe(model: nn.Module, inputs: Tensor, outputs: Tensor, layers: dict[str, nn.Module],
           seen: dict[str, list]) -> None:
    """The first and last samples, run as a batch of their own (one forward), must reproduce
    their batched model outputs and every layer input: the last one catches shifts between
    neighbours and batch-indexed additions such as ``pe[:x.size(0)]``. B=2: sample 0 alone."""
    idx = [0, inputs.shape[0] - 1] if inputs.shape[0] > 2 else [0]
    with torch.no_grad():
        out_p, seen_p = _forward(model, inputs[idx], layers, None, None)
    if not isinstance(out_p, Tensor) or any(len(seen_p[n]) != len(seen[n]) for n in layers):
        raise Fallback("the probe samples call the layers differently")
    pairs = [(outputs.detach()[idx], out_p)]
    pairs += [(c[0][idx], cp[0]) for n in layers for c, cp in zip(seen[n], seen_p[n], strict=True)]
    if not _all_close(pairs):
        raise Fallback("the probe samples give other layer inputs or outputs: the batch is not in "
                       "dim 0, samples mix, or the forward is random")


def per_sample_losses(loss_fn: LossFn, outputs: Tensor, targets: Tensor) -> Tensor:
    """(B,): ``loss_fn(outputs[i:i+1], targets[i:i+1])`` for every sample i, through vmap; for
    torch's own mean-reduced losses called bare, their ``reduction="none"`` values averaged over
    each sample's elements, which is the same number in one batched call (vmap runs the loss's
    Python decomposition, forward and backward)."""
    unreduced = _unreduced(loss_fn, outputs, targets)
    if unreduced is not None:
        return unreduced
    return vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)


def _unreduced(loss_fn: LossFn, outputs: Tensor, targets: Tensor) -> Tensor | None:
    """The batched per-sample losses of ``per_sample_losses`` where ``loss_fn`` allows them, else None."""
    if loss_fn is F.cross_entropy or loss_fn is F.nll_loss:
        # class indices (B,) against scores (B, C); a sample whose target is the default
        # ignore_index has mean 0/0 (NaN) alone, as vmap gives it, where "none" gives 0
        if outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            losses = loss_fn(outputs, targets, reduction="none")
            return torch.where(targets == -100, float("nan"), losses)
    elif loss_fn is F.mse_loss or loss_fn is F.l1_loss:
        if outputs.shape == targets.shape and outputs.ndim >= 1:  # no broadcasting: each sample its own
            return loss_fn(outputs, targets, reduction="none").reshape(outputs.shape[0], -1).mean(1)
    return None


def capture(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
            layers: dict[str, nn.Linear]) -> dict[str, tuple[Tensor, Tensor]]:
    """Per layer: A (B, T, in) inputs and G (B, T, out) gradients of the per-sample losses.

    T counts token dims and repeated calls. The backward goes to the layer outputs only: no
    parameter gradient is computed and no ``.grad`` touched. The forward must be deterministic
    (the caller routes live dropout to vmap).
    """
    batch = inputs.shape[0]
    watch = _WatchParams({id(p): m for m in layers.values() for p in m.parameters(recurse=False)})
    outputs, seen = _forward(model, inputs, layers, batch, watch)
    if watch.outside or not isinstance(outputs, Tensor):
        raise Fallback("a watched weight is used outside its layer, or the output is not a Tensor")
    if batch > 1:
        _probe(model, inputs, outputs, layers, seen)
    losses = per_sample_losses(loss_fn, outputs, targets)
    if losses.shape != (batch,):
        raise ValueError(f"loss_fn must return a scalar per sample, got shape {tuple(losses.shape[1:])}")
    used = {n: calls for n, calls in seen.items() if calls}
    outs = [o for calls in used.values() for _, _, o in calls]
    if not outs:  # no identity layer was called: nothing to capture
        return {}
    grads = iter(torch.autograd.grad(losses.sum(), outs, allow_unused=True, materialize_grads=True))
    terms = {}
    for name, calls in used.items():
        if any(x._version != v for x, v, _ in calls):
            raise Fallback(f"{name}: its input was modified in place after the call")
        m = layers[name]
        a = torch.cat([x.reshape(batch, -1, m.in_features) for x, _, _ in calls], dim=1)
        g = torch.cat([next(grads).reshape(batch, -1, m.out_features) for _ in calls], dim=1)
        terms[name] = (a, g)
    return terms
