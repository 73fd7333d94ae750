"""One batched pass that captures every Linear layer's inputs and output gradients, checked.

The Linear identity g_i(W) = sum_t b_it a_it^T holds only under assumptions a forward hook
cannot see, so each is checked and any failure raises ``Fallback`` (the caller then uses vmap,
which needs none of them):

- the layer sees the batch in dim 0 and samples do not mix: a probe forward of the first and
  last samples must reproduce their layer inputs (shape and value) and model outputs. This
  catches time-major layers (T, B, d), cross-sample ops such as ``h - h.mean(0)``, a shift
  between neighbours, position encodings indexed by the batch, functional dropout. Mixing
  that leaves both probed samples unchanged is not seen: samples must be independent;
- the weight is used by its own module's calls only: in the autograd graph of the per-sample
  losses, every edge into a layer's parameters (or into the nodes its calls made, such as an
  autocast copy of the weight) must come from one of its calls. This catches tied or
  functionally reused weights in the forward and a loss that uses a weight itself (weight decay
  inside ``loss_fn``); a use that no gradient flows through (no_grad, ``.detach()``) is not a
  use the identity misses;
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

LossFn = Callable[[Tensor, Tensor], Tensor]
# torch's own losses, called bare: they see the output and the targets only
BARE_LOSSES = (F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss)


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


Node = torch.autograd.graph.Node


def _layer_nodes(calls: list, params: set[Tensor]) -> set[Node]:
    """The autograd nodes one layer's calls made: from each call's output node back to (not
    into) the node that made its input, with the AccumulateGrad nodes of ``params`` (its own)."""
    nodes: set[Node] = set()
    for x_fn, out in ((c[3], c[2]) for c in calls):
        stack = [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node is x_fn or node in nodes:
                continue
            if hasattr(node, "variable") and not any(node.variable is p for p in params):
                continue  # another leaf (an input that requires grad): not the layer's
            nodes.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return nodes


def _used_outside(root: Tensor, layers: dict[str, nn.Module], seen: dict[str, list]) -> str | None:
    """The first layer whose parameters, or nodes its calls made, the graph of ``root`` reaches
    by an edge from outside its calls, or None (module note). The edge into a call's output node
    comes from what consumes the output and is not counted."""
    owner: dict[Node, str] = {}
    for name, calls in seen.items():
        params = {p for p in layers[name].parameters(recurse=False) if p.requires_grad}
        for node in _layer_nodes(calls, params):
            owner[node] = name
    entries = {c[2].grad_fn for calls in seen.values() for c in calls}
    stack, visited = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in entries and owner.get(nxt, owner.get(node)) != owner.get(node):
                return owner[nxt] if nxt in owner else owner[node]
            stack.append(nxt)
    return None


def loss_parameters(losses: Tensor, outputs: Tensor, model: nn.Module) -> list[str]:
    """The model's parameters that ``losses`` reach other than through ``outputs``: a loss_fn that
    uses a parameter itself (weight decay inside the loss). Per-sample gradients by the identity
    or by torch.func differentiate the loss through the model's output only, so such a loss must
    be refused, not computed without that term."""
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    found, stack, visited = [], [losses.grad_fn], {outputs.grad_fn}
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and any(variable is p for p in names):
            found.append(next(n for p, n in names.items() if variable is p))
        stack.extend(n for n, _ in node.next_functions)
    return found


def refuse_loss_parameters(found: list[str]) -> None:
    if found:
        raise ValueError(f"loss_fn uses model parameter(s) {found} itself, not only through the model's output "
                         "(e.g. weight decay inside the loss): per-sample gradients here differentiate the loss "
                         "through the output only; add that term's gradient separately, or compute it in the "
                         "model's forward")


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


def _record(layers: dict[str, nn.Module], seen: dict[str, list], batch: int | None) -> list:
    """Register hooks that append (input, version, output, input's node) per call; returns the handles."""

    def post(name: str):
        def fn(mod: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
            x = args[0] if args else kwargs["input"]
            if batch is not None and (x.shape[0] != batch or out.shape[0] != batch):
                raise Fallback(f"{name}: batch not in dim 0")
            if batch is not None and not out.requires_grad:
                raise Fallback(f"{name}: called under no_grad (or a reentrant checkpoint)")
            seen[name].append((x.detach(), x._version, out, x.grad_fn))
            return out.clone()
        return fn

    # prepend: see the layer's own output, before any user hook changes it
    return [m.register_forward_hook(post(name), with_kwargs=True, prepend=True) for name, m in layers.items()]


def _forward(model: nn.Module, x: Tensor, layers: dict[str, nn.Module],
             batch: int | None) -> tuple[object, dict[str, list]]:
    seen: dict[str, list] = {name: [] for name in layers}
    handles = _record(layers, seen, batch)
    try:
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
        out_p, seen_p = _forward(model, inputs[idx], layers, None)
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
    outputs, seen = _forward(model, inputs, layers, batch)
    if not isinstance(outputs, Tensor):
        raise Fallback("the model's output is not a Tensor")
    if batch > 1:
        _probe(model, inputs, outputs, layers, seen)
    losses = per_sample_losses(loss_fn, outputs, targets)
    if losses.shape != (batch,):
        raise ValueError(f"loss_fn must return a scalar per sample, got shape {tuple(losses.shape[1:])}")
    refuse_loss_parameters(loss_parameters(losses, outputs, model))
    outside = _used_outside(losses, layers, seen)
    if outside is not None:
        raise Fallback(f"{outside}: its weight is used outside its own calls (tied, reused, or in the loss)")
    used = {n: calls for n, calls in seen.items() if calls}
    outs = [c[2] for calls in used.values() for c in calls]
    if not outs:  # no identity layer was called: nothing to capture
        return {}
    grads = iter(torch.autograd.grad(losses.sum(), outs, allow_unused=True, materialize_grads=True))
    terms = {}
    for name, calls in used.items():
        if any(x._version != v for x, v, *_ in calls):
            raise Fallback(f"{name}: its input was modified in place after the call")
        m = layers[name]
        a = torch.cat([c[0].reshape(batch, -1, m.in_features) for c in calls], dim=1)
        g = torch.cat([next(grads).reshape(batch, -1, m.out_features) for _ in calls], dim=1)
        terms[name] = (a, g)
    return terms
