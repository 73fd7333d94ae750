"""The exact hypergradient of one unrolled inner step: autograd through the step itself.

theta' = theta - lr * grad_theta L_in(theta, w) is built with ``create_graph=True``, so
L_out(theta') is a differentiable function of w and ``torch.autograd.grad`` returns
dL_out/dw = -lr * (d^2 L_in / dw dtheta) . grad L_out(theta') exactly (no eps, no truncation).
Slow and memory-hungry (a double backward through the inner model), obviously correct.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from kernels.hypergrad import LossClosure


def _mean(fns: LossClosure | Sequence[LossClosure], forward) -> Tensor:
    fns = [fns] if callable(fns) else list(fns)
    return sum(fn(forward) for fn in fns) / len(fns)


def exact_hypergradient(
    inner: nn.Module,
    inner_loss: LossClosure | Sequence[LossClosure],
    outer_loss: LossClosure | Sequence[LossClosure],
    outer_params: Iterable[Tensor],
    *,
    lr: float,
    at: Mapping[str, Tensor],
) -> list[Tensor]:
    """dL_out(theta - lr grad L_in(theta, w))/dw with theta = ``at`` (the parameters before the
    step, by name); ``inner`` only supplies the forward (its own parameters are not read)."""
    outer = list(outer_params)
    named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
    buffers = {n: b.clone() for n, b in inner.named_buffers()}
    theta = {n: at[n].detach().clone().requires_grad_() for n, _ in named}

    def forward(params: dict[str, Tensor]):
        return lambda *args, **kwargs: functional_call(inner, ({**params, **buffers}), args, kwargs)

    grads = torch.autograd.grad(_mean(inner_loss, forward(theta)), list(theta.values()), create_graph=True)
    stepped = {n: t - lr * g for (n, t), g in zip(theta.items(), grads, strict=True)}
    result = torch.autograd.grad(_mean(outer_loss, forward(stepped)), outer, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(result, outer, strict=True)]
