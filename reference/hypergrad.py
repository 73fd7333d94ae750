"""The exact hypergradient of one unrolled inner step: autograd through the step itself.

The inner step theta -> theta' of SGD (with or without momentum and weight decay; no dampening,
not Nesterov) depends on w only through -lr * grad_theta L_in(theta, w): the momentum buffer and
the decay are constants of w. So theta'(w) = theta' - lr * (g(w) - g(w).detach()) has theta''s
value and the step's derivative; g is built with ``create_graph=True``, L_out(theta'(w)) is
differentiable in w, and ``torch.autograd.grad`` returns dL_out/dw = -lr * (d^2 L_in / dw
dtheta) . grad L_out(theta') exactly (no eps, no truncation). Slow and memory-hungry (a double
backward through the inner model), obviously correct.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from kernels.hypergrad import LossClosure


def _mean(fns: LossClosure | Sequence[LossClosure], forward) -> Tensor:
    fns = [fns] if callable(fns) else list(fns)
    return sum(fn(forward) for fn in fns) / len(fns)


@torch.enable_grad()
def exact_hypergradient(
    inner: nn.Module,
    inner_loss: LossClosure | Sequence[LossClosure],
    outer_loss: LossClosure | Sequence[LossClosure],
    outer_params: Iterable[Tensor],
    *,
    lr: float,
    at: Mapping[str, Tensor],
) -> list[Tensor]:
    """dL_out(theta'(w))/dw: ``inner`` holds theta' (after the step), ``at`` theta (before it,
    by name), as for kernels.darts_hypergradient."""
    outer = list(outer_params)
    named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
    buffers = {n: b.clone() for n, b in inner.named_buffers()}
    theta = {n: at[n].detach().clone().requires_grad_() for n, _ in named}
    # the calls run a copy of the model: torch's functional_call leaves a layer registered under two
    # names holding the call's tensors, and the caller's model must keep its own
    model = copy.deepcopy(inner)

    def forward(params: dict[str, Tensor]):
        return lambda *args, **kwargs: functional_call(model, ({**params, **buffers}), args, kwargs)

    grads = torch.autograd.grad(_mean(inner_loss, forward(theta)), list(theta.values()), create_graph=True)
    stepped = {n: p.detach() - lr * (g - g.detach()) for (n, p), g in zip(named, grads, strict=True)}
    result = torch.autograd.grad(_mean(outer_loss, forward(stepped)), outer, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(result, outer, strict=True)]
