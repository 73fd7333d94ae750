"""Optimizer steps: the fastest correct ``torch.optim`` implementation for the parameters at hand.

``adamw`` and ``sgd`` return ``torch.optim.AdamW`` / ``torch.optim.SGD`` objects (subclasses
that only guard the fused step, see below; GradScaler, LR schedulers and ``state_dict`` work as
usual) with the implementation chosen per
device type. Measured choice table, ms per step (2-core AMD EPYC, torch 2.14.1, default malloc
with THP_MEM_ALLOC_ENABLE=1, torch.utils.benchmark median with both threads;
perf_tests/test_optim.py gates the resnet18 rows):

| parameters                    | dtype | optimizer | for-loop | foreach | fused |
|-------------------------------|-------|-----------|----------|---------|-------|
| resnet18 (11.7M, 62 tensors)  | fp32  | AdamW     | 9.14     | 10.12   | 2.29  |
| resnet18                      | bf16  | AdamW     | 7.48     | 7.62    | 3.28  |
| 200 x 256x256                 | fp32  | AdamW     | 14.57    | 17.80   | 3.29  |
| 200 x 256x256                 | bf16  | AdamW     | 14.02    | 14.17   | 4.28  |
| resnet18                      | fp32  | SGD m=0.9 | 1.98     | 1.90    | 1.44  |
| resnet18                      | bf16  | SGD m=0.9 | 2.53     | 2.53    | 1.61  |
| 200 x 256x256                 | fp32  | SGD m=0.9 | 4.46     | 4.11    | 2.14  |
| 200 x 256x256                 | bf16  | SGD m=0.9 | 5.20     | 4.71    | 2.32  |

So on CPU: fused, always. foreach never beats fused and is slower than the loop for AdamW (as
shared/MEASUREMENTS.md found on a Xeon); for SGD it is a few percent ahead of the loop. On CUDA
fused is chosen too: not measured in this project yet (no GPU lent), it is torch's fastest
documented path; record the numbers here when measured. Other device types get torch's default.

A trap found by the correctness tests: torch 2.14.1's fused kernels index parameter, grad and
state as flat arrays, so a grad whose strides differ from its parameter's (a transposed
parameter with a grad set by hand, say) gets silently wrong steps: after 10 steps on a
transposed 3x5 parameter, AdamW was off by 4.5e-3 and SGD (momentum 0.9) by 4.2, against the
for-loop. Autograd's own grads follow the parameter's layout, so training is unaffected, but
these optimizers copy any mismatched grad into the parameter's layout before a fused step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

Params = Iterable[Tensor] | Iterable[dict[str, Any]]
FUSED_DEVICES = ("cpu", "cuda")  # where torch has fused AdamW/SGD and we choose it (table above)


def _tensors(groups: list) -> list[Tensor]:
    return [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]


def _groups(params: Params, arg: str) -> list:
    if isinstance(params, Tensor):
        raise TypeError(f"{arg} must be an iterable of tensors or parameter groups, got a Tensor; "
                        "pass model.parameters() or [tensor]")
    groups = list(params)
    if not groups:
        raise ValueError(f"{arg} is empty: the optimizer has nothing to update")
    for g in groups:
        for p in g["params"] if isinstance(g, dict) else [g]:
            if not isinstance(p, Tensor):
                raise TypeError(f"{arg} holds a {type(p).__name__}, not a tensor")
            if not p.is_floating_point():
                raise TypeError(f"{arg} holds a {p.dtype} tensor: optimizers update floating-point "
                                "parameters only")
    return groups


def _align_grads(groups: list[dict]) -> None:
    """Give every grad its parameter's strides (see the module note): a copy, only on mismatch."""
    for group in groups:
        for p in group["params"]:
            if p.grad is not None and p.numel() > 1 and p.grad.stride() != p.stride():
                aligned = torch.empty_like(p, memory_format=torch.preserve_format)
                p.grad = aligned.copy_(p.grad)


class _AlignedStep:
    """Mixin: align grad layouts before torch's fused step; closures run first so their grads
    are aligned too."""

    defaults: dict
    param_groups: list[dict]

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.defaults.get("fused"):
            _align_grads(self.param_groups)
        super().step()  # type: ignore[misc]
        return loss


class AdamW(_AlignedStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose fused step is safe for any grad layout."""


class SGD(_AlignedStep, torch.optim.SGD):
    """``torch.optim.SGD`` whose fused step is safe for any grad layout."""


def implementation(params: list[Tensor]) -> dict[str, bool]:
    """The ``fused``/``foreach`` keywords for these parameters, by the measured table above."""
    devices = {p.device.type for p in params}
    if devices <= set(FUSED_DEVICES) and len(devices) == 1:
        return {"fused": True}
    return {}  # mixed or other devices: torch's default choice


def adamw(params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 1e-2) -> AdamW:
    """torch AdamW (decoupled weight decay, bias correction) with the fastest implementation."""
    groups = _groups(params, "params")
    return AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             **implementation(_tensors(groups)))


def sgd(params: Params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
        weight_decay: float = 0.0, nesterov: bool = False) -> SGD:
    """torch SGD (momentum, dampening, Nesterov, L2 weight decay) with the fastest implementation."""
    groups = _groups(params, "params")
    return SGD(groups, lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay, nesterov=nesterov,
                           **implementation(_tensors(groups)))
