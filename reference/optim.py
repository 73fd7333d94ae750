"""Reference optimizers: one parameter at a time, the textbook update in plain tensor ops.

Semantics are torch's (torch.optim.AdamW / SGD docs): decoupled weight decay and bias
correction for AdamW; momentum buffer initialised to the first gradient, dampening, Nesterov
and L2 weight decay for SGD. Parameters whose grad is None are skipped; AdamW steps a complex
parameter as its (real, imaginary) pairs, as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


class AdamW(torch.optim.Optimizer):
    """p <- p - lr*wd*p; m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2;
    p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                # a complex number as its (real, imaginary) pair, as torch steps it: g^2 per component
                w, g, m, v = (torch.view_as_real(x) if x.is_complex() else x
                              for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
                t = state["step"]
                w.mul_(1 - lr * wd)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        return loss


class SGD(torch.optim.Optimizer):
    """d = g + wd*p; b <- d (first step) else momentum*b + (1-dampening)*d;
    p <- p - lr * (d + momentum*b if nesterov else b)  (b = d when momentum is 0)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            lr, mom, damp = group["lr"], group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                if mom:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = d.clone()
                    else:
                        state["momentum_buffer"].mul_(mom).add_(d, alpha=1 - damp)
                    buf = state["momentum_buffer"]
                    d = d.add(buf, alpha=mom) if group["nesterov"] else buf
                p.add_(d, alpha=-lr)
        return loss


def adamw(params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-3,
          betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2) -> AdamW:
    return AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def sgd(params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-3, momentum: float = 0.0,
        dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> SGD:
    return SGD(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
               nesterov=nesterov)
