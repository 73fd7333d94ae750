"""Online Coreset Selection (OCS) scores from Gram products, no per-sample gradient materialized.

The original (jaehong31/OCS ``sample_selection``) flattens every sample's gradient into E (N, P)
and scores sample i with cos(a, b) = a.b / max(|a||b|, 1e-6):

    score_i = cos(g, E_i) - mean_j cos(E_i, E_j) + tau * cos(r, E_i)

g the gradient of the stream batch's loss, r that of the replay memory's (no affinity without
memory), the diversity mean over all N, diagonal included. Every term is a Gram product: with
G = E E^T (the ghost identity for Linear layers), |E_i| = sqrt(G_ii) and the diversity need G
only. g = mean_i E_i and r = the memory's mean per-sample gradient are built from the captured
layer terms (g_W = sum_i b_i a_i^T / N, one product) and <g, E_i> = sum_t b_it^T g_W a_it is one
forward-sized product, no E_i built. Two cheaper-looking shortcuts lose accuracy or time:
<g, E_i> = mean_j G_ij with |g|^2 = mean_ij G_ij loses digits when g nearly cancels
(|g| << |E_i|), which the reference's cosine of one vector g does not; and an N x M Gram block
against the memory measured slower than building r (evidence/from-the-code.md). The
stream and the memory share one captured forward and backward.

The loss must reduce per-sample losses by their mean (the original's CrossEntropyLoss) or sum:
g and r are its batch gradients, the reduction is read from the loss's gradient at the model's
outputs over the whole stream and memory, and anything else (class weights over mixed
classes) is refused. Scoring needs a deterministic model: dropout in train
mode draws masks the reference could not reproduce, so call ``model.eval()`` around scoring.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels import checks, per_sample
from kernels.layer_capture import LossFn, per_sample_losses
from kernels.per_sample import ghost_terms

Memory = tuple[Tensor, Tensor]
EPS = 1e-6  # the original's floor on |a||b|


def check_k(inputs: Tensor, k: int) -> None:
    """``ocs_select``'s k: an int in [1, N] (numpy ints too, not bool). An empty or non-tensor
    stream is left to ``check_inputs``, which ``ocs_scores`` runs once."""
    if not isinstance(inputs, Tensor) or inputs.ndim == 0 or inputs.shape[0] == 0:
        return
    n = inputs.shape[0]
    checks.integer(k, "k", low=1, high=n, hint=f"samples to select of the stream's N={n}")


def check_inputs(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, memory: Memory | None,
                 tau: float) -> tuple[str, list[str]]:
    """The refusals of ``ocs_scores``/``ocs_select``, shared with ``reference.coreset``; returns
    the loss's reduction, 'mean' or 'sum', and the trainable parameter names."""
    checks.tensor(inputs, "inputs (the stream)", min_ndim=1, nonempty=True, shape="(N, ...)")
    checks.number(tau, "tau")
    checks.module(model, "model")
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise ValueError(f"model.{name} is {type(m).__name__}(p={m.p}) in train mode: scores would "
                             "depend on random masks; call model.eval() for scoring, model.train() after")
    names = per_sample.check_inputs(model, loss_fn, inputs, targets)  # types, sizes, device, dtype, NaN/inf
    if memory is not None:
        _check_memory(inputs, targets, memory)
    return loss_reduction(model, loss_fn, inputs, targets, memory), names


def loss_reduction(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                   memory: Memory | None = None) -> str:
    """'mean' or 'sum': how ``loss_fn`` reduces per-sample losses, read from its gradient at the
    model's outputs over the whole stream and the whole memory. Where the batch loss's gradient
    there is 1/n (mean) or 1 (sum) times the per-sample losses' summed gradient, the chain rule
    makes g and r, its batch gradients, that multiple of sum_i E_i. Any other reduction (class
    weights over mixed classes, a token mean over padded samples of unequal lengths) is refused
    rather than scored as something else. A batch that cannot tell (one sample, or every output
    gradient zero) agrees with both; torch's default 'mean' is taken where both agree."""
    agree = {"mean", "sum"}
    for x, y in [(inputs, targets), *([memory] if memory is not None else [])]:
        agree &= _reductions(model, loss_fn, x, y)
        if not agree:
            raise ValueError(
                "loss_fn must reduce per-sample losses by their mean (e.g. F.cross_entropy) or sum: its "
                "gradient at the model's outputs is neither 1/n nor 1 times the per-sample losses' "
                "(class weights over mixed classes, a token mean over samples of unequal lengths); OCS "
                "scores need g as a multiple of the per-sample gradients' sum")
    return "mean" if "mean" in agree else "sum"


def _reductions(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> set[str]:
    """Those of 'mean' and 'sum' whose gradient at the outputs the batch loss's matches: normwise
    within sqrt(eps) of the outputs' dtype (mean and sum differ by n >= 2, class weights by
    their ratios; rounding by a few eps)."""
    with torch.no_grad():
        out = model(x)
    if not isinstance(out, Tensor):
        raise TypeError(f"OCS scores need a model returning one Tensor (N, ...), got {type(out).__name__}")
    with torch.enable_grad():
        o = out.detach().requires_grad_()
        batch = loss_fn(o, y)
        if not isinstance(batch, Tensor) or batch.ndim != 0:
            raise ValueError(f"loss_fn must return a scalar, got {getattr(batch, 'shape', type(batch).__name__)}")
        each = per_sample_losses(loss_fn, o, y)
        checks.finite({"the model's per-sample losses": each, "the model's batch loss": batch},
                      error=FloatingPointError, hint="OCS scores would be NaN")
        gb, ge = (torch.autograd.grad(t, o, allow_unused=True, materialize_grads=True)[0].double()
                  for t in (batch, each.sum()))  # the batch loss's and the per-sample losses' at the outputs
    tol = torch.finfo(o.dtype).eps ** 0.5
    agree = set()
    for name, scale in (("mean", 1.0 / x.shape[0]), ("sum", 1.0)):
        want = ge * scale
        if float((gb - want).norm()) <= tol * max(float(gb.norm()), float(want.norm())):
            agree.add(name)
    return agree


def _check_memory(inputs: Tensor, targets: Tensor, memory: Memory) -> None:
    if not (isinstance(memory, tuple | list) and len(memory) == 2 and all(isinstance(t, Tensor) for t in memory)):
        raise TypeError("memory must be an (inputs, targets) pair of tensors, or None for no affinity")
    mx, my = memory
    if mx.ndim == 0 or mx.shape[0] == 0 or mx.shape[0] != my.shape[0]:
        raise ValueError(f"memory needs M >= 1 inputs and as many targets, got {tuple(mx.shape)} and "
                         f"{tuple(my.shape)}; pass memory=None when there is none")
    if mx.shape[1:] != inputs.shape[1:] or mx.dtype != inputs.dtype or mx.device != inputs.device:
        raise ValueError(f"memory inputs are {mx.dtype} {tuple(mx.shape[1:])} per sample on {mx.device}, "
                         f"the stream's {inputs.dtype} {tuple(inputs.shape[1:])} on {inputs.device}: they "
                         "must match (the same model scores both)")
    if my.shape[1:] != targets.shape[1:] or my.dtype != targets.dtype or my.device != targets.device:
        raise ValueError(f"memory targets are {my.dtype} {tuple(my.shape[1:])} per sample on {my.device}, "
                         f"the stream's {targets.dtype} {tuple(targets.shape[1:])} on {targets.device}: they must "
                         "match")
    checks.finite({"memory inputs": mx, "memory targets": my})


def check_scores(scores: Tensor) -> Tensor:
    checks.finite({"the OCS scores": scores}, error=FloatingPointError,
                  hint="the model's loss or gradients overflowed or are NaN on this batch")
    return scores


def top_k(scores: Tensor, k: int) -> Tensor:
    """Indices (k,) of the k largest scores, ties broken by the lower index."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


@torch.enable_grad()
def ocs_scores(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
               memory: Memory | None = None, tau: float = 1000.0) -> Tensor:
    """Score (N,) of each stream sample: similarity - diversity + tau * affinity (module doc).

    inputs (N, ...), targets (N, ...); memory an (inputs (M, ...), targets (M, ...)) replay batch.
    """
    reduction, names = check_inputs(model, loss_fn, inputs, targets, memory, tau)
    n = inputs.shape[0]
    if memory is not None:  # one capture for both batches: samples are independent
        inputs, targets = torch.cat([inputs, memory[0]]), torch.cat([targets, memory[1]])
    both = ghost_terms(model, loss_fn, inputs, targets, names=names)  # memory checked like the stream
    stream = both.rows(slice(0, n))
    with torch.autocast(inputs.device.type, enabled=False):
        gram = stream.gram()
        norms = gram.diagonal().clamp_min(0).sqrt()
        # cos(g, E_i) from g itself, as the reference: when g nearly cancels (|g| << |E_i|),
        # mean_j G_ij and sqrt(mean G) lose digits that the cosine of one vector keeps.
        scale = 1.0 / n if reduction == "mean" else 1.0  # g: the batch loss's gradient, as the original
        g = {name: t * scale for name, t in stream.sum_grad().items()}
        g_norm = torch.cat([t.flatten() for t in g.values()]).norm()
        sim = stream.dots(g) / (g_norm * norms).clamp_min(EPS)
        div = (gram / torch.outer(norms, norms).clamp_min(EPS)).mean(0)
        scores = sim - div
        if memory is not None:
            scale = 1.0 / len(memory[1]) if reduction == "mean" else 1.0
            r = {name: t * scale for name, t in both.rows(slice(n, None)).sum_grad().items()}
            r_norm = torch.cat([t.flatten() for t in r.values()]).norm()
            scores = scores + tau * stream.dots(r) / (r_norm * norms).clamp_min(EPS)
    return check_scores(scores)


def ocs_select(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, k: int, *,
               memory: Memory | None = None, tau: float = 1000.0) -> Tensor:
    """Indices (k,) int64 of the k best-scoring stream samples, best first, ties by index."""
    check_k(inputs, k)
    return top_k(ocs_scores(model, loss_fn, inputs, targets, memory=memory, tau=tau), k)
