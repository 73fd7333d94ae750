"""Reference OCS: materialize E (N, P) with the per-sample loop, every cosine computed literally
as the original's ``sample_selection`` does (jaehong31/OCS, core/train_methods_mnist.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from kernels.coreset import EPS, Memory, check_inputs, check_k, check_reduction, check_scores
from kernels.layer_capture import LossFn
from reference.per_sample import per_sample_grads


def _flat_grad(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Tensor:
    """The batch loss's gradient, flattened like the original's ``flatten_grads``."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(model(inputs), targets), params, allow_unused=True)
    flat = [(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads, strict=True)]
    return torch.cat(flat)


@torch.enable_grad()
def ocs_scores(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
               memory: Memory | None = None, tau: float = 1000.0) -> Tensor:
    """score_i = cos(g, E_i) - mean_j cos(E_i, E_j) + tau * cos(r, E_i), E materialized."""
    return literal_scores(model, loss_fn, inputs, targets, memory, tau, per_sample_grads)


@torch.enable_grad()
def literal_scores(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, memory: Memory | None,
                   tau: float, grads_fn: Callable[..., dict[str, Tensor]]) -> Tensor:
    """The original's formulas on E from ``grads_fn`` (a ``per_sample_grads``): the reference
    passes the loop, the workload's ablation vmap and the einsum identity."""
    check_inputs(model, loss_fn, inputs, targets, memory, tau)
    xs, ys = (inputs, targets) if memory is None else (torch.cat([inputs, memory[0]]),
                                                       torch.cat([targets, memory[1]]))
    with torch.no_grad():
        check_reduction(loss_fn, model(xs), ys, inputs.shape[0])  # refused as the kernel refuses it
    grads = grads_fn(model, loss_fn, inputs, targets)
    eg = torch.cat([t.flatten(1) for t in grads.values()], dim=1)
    g = _flat_grad(model, loss_fn, inputs, targets)
    ng, neg = torch.norm(g), torch.norm(eg, dim=1)
    mean_sim = torch.matmul(g, eg.t()) / torch.maximum(ng * neg, torch.ones_like(neg) * EPS)
    negd = torch.unsqueeze(neg, 1)
    cross_div = torch.matmul(eg, eg.t()) / torch.maximum(torch.matmul(negd, negd.t()), torch.ones_like(negd) * EPS)
    avg_div = torch.mean(cross_div, 0)
    coreset_aff = 0.0
    if memory is not None:
        ref_grads = _flat_grad(model, loss_fn, *memory)
        ref_ng = torch.norm(ref_grads)
        coreset_aff = torch.matmul(ref_grads, eg.t()) / torch.maximum(ref_ng * neg, torch.ones_like(neg) * EPS)
    return check_scores(mean_sim - avg_div + tau * coreset_aff)


def top_k(scores: Tensor, k: int) -> Tensor:
    """Indices (k,) of the k largest scores, a tie to the lower index: the first k of all indices
    ordered by (-score, index)."""
    values = scores.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]
    return torch.tensor(order, dtype=torch.int64, device=scores.device)


def ocs_select(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, k: int, *,
               memory: Memory | None = None, tau: float = 1000.0) -> Tensor:
    """The top k of the reference scores (sorted, ties by index)."""
    check_k(inputs, k)
    return top_k(ocs_scores(model, loss_fn, inputs, targets, memory=memory, tau=tau), k)
