"""One batched pass that captures every Linear layer's inputs and output gradients, checked.

The Linear identity g_i(W) = sum_t b_it a_it^T holds only under assumptions a forward hook
cannot see, so each is checked and any failure raises ``Fallback`` (the caller then uses vmap,
which needs none of them):

- the layer sees the batch in dim 0 and samples do not mix: a probe forward of the last, the
  second and the first samples, in that order, must reproduce their layer inputs (shape and
  value) and model outputs (a batch of 3 or fewer: each sample alone). This catches time-major
  layers (T, B, d), cross-sample ops such as ``h - h.mean(0)`` or ``h - h[:1]``, a shift between
  neighbours, a mixup with the batch flipped, position encodings indexed by the batch, samples
  reordered inside the model (sorted by a key, say: a layer row then holds another sample),
  functional dropout. Mixing or reordering that leaves the three probed samples unchanged is
  not seen, nor mixing in the backward only: samples must be independent;
- the weight is used by its own module's calls only: in the autograd graph of the per-sample
  losses, every edge into a layer's parameters (or into the nodes its calls made, such as an
  autocast copy of the weight) must come from one of its calls, and a layer never called owns
  its parameters too. This catches tied or functionally reused weights; a use that no gradient
  flows through (no_grad, ``.detach()``) is not a use the identity misses. A loss_fn that
  reaches a parameter other than through the model's output (weight decay inside the loss) is
  refused before this check (``loss_parameters``): vmap would miss that term too;
- a captured input is not modified in place later (its version counter is compared);
- in-place ops after the layer (``ReLU(inplace=True)``, ``out += x``) rebase the layer output
  onto a new autograd node, so the hook keeps the output's gradient edge (the node that made it)
  and the backward goes to that edge; an output that is a view (a Linear on (B, T, in) inputs) is
  handed to the rest of the model as a clone, since an in-place op on a view rebases its base
  instead and the edge would be bypassed. The hook runs before the layer's own forward hooks,
  and a layer called under no_grad is refused. A global
  forward hook (``register_module_forward_hook``) runs before it, so any registered means vmap.
  A change to a captured input through an alias that shares no version counter (``.data``,
  ``.numpy()``) is not seen: those are unsafe in any autograd computation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import vmap
from torch.utils._pytree import tree_flatten

from kernels import checks

LossFn = Callable[[Tensor, Tensor], Tensor]
Node = torch.autograd.graph.Node
# torch's own losses, called bare: they see the output and the targets only (``_unreduced`` batches them)
CLASS_LOSSES = (F.cross_entropy, F.nll_loss)  # scores (B, C) against class indices (B,)
ELEMENT_LOSSES = (F.mse_loss, F.l1_loss)  # an output against a target of its shape
BARE_LOSSES = CLASS_LOSSES + ELEMENT_LOSSES


class Fallback(Exception):
    """The identity's assumptions do not hold for this model and batch: use vmap."""


def own_parameters(m: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``m.named_parameters(recurse=False)``, read from ``m._parameters`` as torch's own recursive
    walk reads it (a named_parameters call a module costs more than the rest): each once, in order."""
    seen: set[int] = set()
    return [(n, p) for n, p in m._parameters.items() if p is not None and not (id(p) in seen or seen.add(id(p)))]


def _layer_nodes(calls: list, params: set[int]) -> set[Node]:
    """The autograd nodes of one layer's calls that lead to its own parameters (ids ``params``):
    between each call's output node and (not into) the node that made its input, those from which
    an AccumulateGrad of the layer's parameters is reached (the weight's transpose, autocast's
    cached copy of it), and those AccumulateGrad nodes. A cached copy of an input is not one."""
    leads: dict[Node, bool] = {}

    def visit(node: Node | None, stop: Node | None) -> bool:
        if node is None or node is stop:
            return False
        if node not in leads:
            variable = getattr(node, "variable", None)
            leads[node] = id(variable) in params if variable is not None else \
                any([visit(n, stop) for n, _ in node.next_functions])  # a list: visit every branch
        return leads[node]

    for call in calls:
        visit(call[4].node, call[3])
    return {node for node, yes in leads.items() if yes}


def _used_outside(root: Tensor, layers: dict[str, nn.Module], seen: dict[str, list]) -> str | None:
    """The first layer whose parameters, or the nodes its calls made to reach them, the graph of
    ``root`` reaches by an edge from outside its calls, or None (module note). A layer never
    called owns its parameters too: any use of them is outside. The edge into a call's output
    node comes from what consumes the output and is not counted."""
    param_owner = {id(p): name for name, m in layers.items() for _, p in own_parameters(m)}
    owner: dict[Node, str] = {}
    for name, calls in seen.items():
        own = {pid for pid, of in param_owner.items() if of == name}
        owner.update(dict.fromkeys(_layer_nodes(calls, own), name))

    def owner_of(node: Node) -> str | None:
        variable = getattr(node, "variable", None)
        return owner.get(node, param_owner.get(id(variable)) if variable is not None else None)

    entries = {c[4].node for calls in seen.values() for c in calls}
    stack, visited = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        mine = owner_of(node)
        for nxt, _ in node.next_functions:
            used = owner_of(nxt) if nxt is not None and nxt not in entries else None
            if used is not None and used != mine:
                return used
            stack.append(nxt)
    return None


def loss_parameters(losses: Tensor, outputs: object, model: nn.Module) -> list[str]:
    """The model's parameters that ``losses`` reach other than through ``outputs`` (a tensor, or
    the tuple or dict a model returns: every tensor in it): a loss_fn that uses a parameter
    itself (weight decay inside the loss), or an activation the forward stored on the model.
    Per-sample gradients by the identity or by torch.func differentiate the loss through the
    model's output only, so such a loss must be refused, not computed without them."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    ends = {t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, Tensor)}
    found, stack, visited = [], [losses.grad_fn], ends
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in names:
            found.append(names[id(variable)])
        stack.extend(n for n, _ in node.next_functions)
    return found


def refuse_loss_parameters(found: list[str]) -> None:
    if found:
        raise ValueError(f"loss_fn reaches model parameter(s) {found} other than through the model's output "
                         "(weight decay inside the loss, or an activation the forward stored on the model): "
                         "per-sample gradients here differentiate the loss through the output only; add such a "
                         "term's gradient separately, or return what the loss needs from the forward")


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
    # each pair's error and values by their extremes, one pass a tensor (aminmax: exact in any
    # dtype, NaN propagates), read in one sync and compared on the host: a NaN compares False, and
    # an inf value is not close (any error would be within a bound scaled by it)
    errors = torch._foreach_sub([a for a, _ in pairs], [b for _, b in pairs])
    found = list(checks.extremes({f"{side}{k}": t for k, (e, (_, b)) in enumerate(zip(errors, pairs, strict=True))
                                  for side, t in (("error", e), ("value", b))}).values())
    bounds = [(max(-err[0], err[1]), max(-value[0], value[1]), torch.finfo(b.dtype))
              for err, value, (_, b) in zip(found[::2], found[1::2], pairs, strict=True)]
    return all(err <= min(64 * f.eps, f.eps**0.5) * max(scale, f.tiny) and scale <= f.max
               for err, scale, f in bounds)


class _Recorder:
    """Forward hooks on the layers, registered once for the probe's forwards and the batch's: each
    ``run`` records, per layer, one tuple (input, version, output, input's node, output's gradient
    edge) a call; the probe's (``batch`` None) hold no edge. ``remove`` takes the hooks off."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.names, self.batch = list(layers), None
        self.seen: dict[str, list] = {}
        # prepend: see the layer's own output, before any user hook changes it
        self.handles = [m.register_forward_hook(self._hook(name), with_kwargs=True, prepend=True)
                        for name, m in layers.items()]

    def _hook(self, name: str) -> Callable:
        def fn(mod: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
            x, batch = args[0] if args else kwargs["input"], self.batch
            if batch is None:
                self.seen[name].append((x.detach(), x._version, out, x.grad_fn, None))
                return out
            if x.shape[0] != batch or out.shape[0] != batch:
                raise Fallback(f"{name}: batch not in dim 0")
            if not out.requires_grad:
                raise Fallback(f"{name}: called under no_grad (or a reentrant checkpoint)")
            self.seen[name].append((x.detach(), x._version, out, x.grad_fn, get_gradient_edge(out)))
            return out.clone() if out._is_view() else out  # module note: a view's in-place op bypasses the edge
        return fn

    def run(self, model: nn.Module, x: Tensor, batch: int | None) -> tuple[object, dict[str, list]]:
        """``model(x)`` and its layers' calls; ``batch``: the batch's forward, None a probe's."""
        self.batch, self.seen = batch, {name: [] for name in self.names}
        return model(x), self.seen

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


_Probe = list[tuple[Tensor, object, dict[str, list]]]  # (rows, output, layer calls) a forward


def _probe_forward(model: nn.Module, inputs: Tensor, recorder: _Recorder) -> _Probe:
    """The probe's forwards (``_probe``), run before the batch's own: what a forward leaves on the
    model (an activation a loss_fn reads, ``self.h = ...``) is then the batch's, not the probe's."""
    batch = inputs.shape[0]
    runs = []
    for rows in [[batch - 1, 1, 0]] if batch > 3 else [[i] for i in range(batch)]:
        index = torch.tensor(rows, device=inputs.device)
        with torch.no_grad():  # the rows gathered (a copy): a model may view its input across the batch dim
            runs.append((index, *recorder.run(model, inputs.index_select(0, index), None)))
    return runs


def _probe(runs: _Probe, outputs: Tensor, layers: dict[str, nn.Module], seen: dict[str, list]) -> None:
    """The last, second and first samples, run in that order as a batch of their own (one
    forward), must reproduce their batched model outputs and every layer input: the last one
    catches shifts between neighbours and batch-indexed additions such as ``pe[:x.size(0)]``,
    the reversed order a reordering inside the model and mixing with a fixed sample (``h[:1]``),
    the second sample a mixing symmetric under reversal (a flipped batch: its mirror is not the
    probe's). B <= 3: each sample alone (a forward each; 3 reversed would be the batch itself)."""
    pairs = []
    for index, out_p, seen_p in runs:
        if not isinstance(out_p, Tensor) or any(len(seen_p[n]) != len(seen[n]) for n in layers):
            raise Fallback("the probe samples call the layers differently")
        pairs += [(outputs.detach().index_select(0, index), out_p)]
        pairs += [(c[0].index_select(0, index), cp[0])
                  for n in layers for c, cp in zip(seen[n], seen_p[n], strict=True)]
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
    if loss_fn in CLASS_LOSSES:
        # class indices (B,) against scores (B, C); a sample whose target is the default
        # ignore_index has mean 0/0 (NaN) alone, as vmap gives it, where "none" gives 0
        if outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            losses = loss_fn(outputs, targets, reduction="none")
            return torch.where(targets == -100, float("nan"), losses)
    elif loss_fn in ELEMENT_LOSSES:
        if outputs.shape == targets.shape and outputs.ndim >= 1:  # no broadcasting: each sample its own
            return loss_fn(outputs, targets, reduction="none").reshape(outputs.shape[0], -1).mean(1)
    return None


def _global_hooks() -> bool:
    """Whether a global module forward hook (``nn.modules.module.register_module_forward_hook``) is
    registered: it runs before a module's own hooks, so the capture would record its output as the
    layer's."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks)


def _joined(parts: list[Tensor]) -> Tensor:
    """(B, T, d) parts joined along T; one part as it is (a cat would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def capture(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
            layers: dict[str, nn.Linear], outputs: list[Tensor] | None = None) -> dict[str, tuple[Tensor, Tensor]]:
    """Per layer: A (B, T, in) inputs and G (B, T, out) gradients of the per-sample losses.

    T counts token dims and repeated calls. The backward goes to the layer outputs only: no
    parameter gradient is computed and no ``.grad`` touched. The forward must be deterministic
    (the caller routes live dropout to vmap). ``outputs``: a list the model's outputs on the
    batch (detached) are appended to, for a caller that reads them too.
    """
    batch = inputs.shape[0]
    if _global_hooks():  # they run before any module's own hooks, the capture's too: it would see their output
        raise Fallback("a global module forward hook is registered")
    recorder = _Recorder(layers)
    try:
        probe = _probe_forward(model, inputs, recorder) if batch > 1 else []
        out, seen = recorder.run(model, inputs, batch)
    finally:
        recorder.remove()
    if not isinstance(out, Tensor):
        raise Fallback("the model's output is not a Tensor")
    if out.ndim == 0 or out.shape[0] != batch:  # squeezed at B=1, say: per sample only through vmap
        raise Fallback(f"the model's output {tuple(out.shape)} has no batch dim {batch} first")
    if probe:
        _probe(probe, out, layers, seen)
    losses = per_sample_losses(loss_fn, out, targets)
    if losses.shape != (batch,):
        raise ValueError(f"loss_fn must return a scalar per sample, got shape {tuple(losses.shape[1:])}")
    if loss_fn not in BARE_LOSSES:  # torch's own, called bare, read the output and the targets only
        refuse_loss_parameters(loss_parameters(losses, out, model))
    outside = _used_outside(losses, layers, seen)
    if outside is not None:
        raise Fallback(f"{outside}: its weight is used outside its own calls (tied or functionally reused)")
    if outputs is not None:
        outputs.append(out.detach())
    used = {n: calls for n, calls in seen.items() if calls}
    edges: list[GradientEdge] = [c[4] for calls in used.values() for c in calls]
    if not edges:  # no identity layer was called: nothing to capture
        return {}
    # an output the losses do not reach has gradient zero (grad's materialize_grads takes no edges)
    grads = iter([g if g is not None else c[2].new_zeros(c[2].shape)
                  for g, c in zip(torch.autograd.grad(losses.sum(), edges, allow_unused=True),
                                  [c for calls in used.values() for c in calls], strict=True)])
    terms = {}
    for name, calls in used.items():
        if any(x._version != v for x, v, *_ in calls):
            raise Fallback(f"{name}: its input was modified in place after the call")
        out_features, in_features = layers[name].weight.shape  # the weight's: forward reads no attribute
        a = _joined([c[0].reshape(batch, -1, in_features) for c in calls])
        g = _joined([next(grads).reshape(batch, -1, out_features) for _ in calls])
        terms[name] = (a, g)
    return terms
