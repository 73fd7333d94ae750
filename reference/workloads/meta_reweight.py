"""Reference run of the Meta-Weight-Net workload: fp32, one batch per step, per-parameter Python
SGD (reference.optim), the plain loop (reference.training.train), and the EXACT hypergradient of
the unrolled step (reference.hypergrad: autograd through theta - lr grad L_in)."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

import reference.training
from reference.hypergrad import exact_hypergradient

Batch = tuple[Tensor, Tensor]


def reweighted_loss(losses: Tensor, weight_net: nn.Module) -> Tensor:
    """mean_i W(l_i) l_i over per-sample losses (B,), W reading the detached losses (B, 1): no
    gradient flows through W's input."""
    return (weight_net(losses.detach()[:, None]).reshape(-1) * losses).mean()


def reference_step(ln: Any, batch: Batch, meta: Batch, cfg: Any, reweight: bool = True) -> None:
    """Inner SGD step on the reweighted loss, then Adam on W with the exact hypergradient.
    ``ln``: a workloads.meta_reweight.Learner (model, weight_net, inner_opt, outer_opt); ``cfg``:
    its Config (lr, device)."""
    per_sample_ce = lambda logits, y: F.cross_entropy(logits.float(), y, reduction="none")
    x, y = batch
    if not reweight:
        reference.training.train(ln.model, F.cross_entropy, ln.inner_opt, [batch], device=cfg.device)
        return
    theta = {n: p.detach().clone() for n, p in ln.model.named_parameters()}
    loss = lambda logits, y: reweighted_loss(per_sample_ce(logits, y), ln.weight_net)
    reference.training.train(ln.model, loss, ln.inner_opt, [batch], device=cfg.device)
    grads = exact_hypergradient(ln.model, lambda f: loss(f(x), y), lambda f: F.cross_entropy(f(meta[0]), meta[1]),
                                ln.weight_net.parameters(), lr=cfg.lr, at=theta)
    for p, g in zip(ln.weight_net.parameters(), grads, strict=True):
        p.grad = g
    ln.outer_opt.step()
    ln.outer_opt.zero_grad(set_to_none=True)
