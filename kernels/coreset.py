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
                 tau: float) -> list[str]:
    """The refusals of ``ocs_scores``/``ocs_select`` before any forward, shared with
    ``reference.coreset``; returns the trainable parameter names. The loss's reduction is
    checked on the model's outputs (``check_reduction``)."""
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
    return names


def joined(inputs: Tensor, targets: Tensor, memory: Memory | None) -> tuple[Tensor, Tensor]:
    """The stream then the memory, one batch: (N + M, ...) inputs and targets."""
    if memory is None:
        return inputs, targets
    return torch.cat([inputs, memory[0]]), torch.cat([targets, memory[1]])


def check_reduction(loss_fn: LossFn, outputs: Tensor, targets: Tensor, n: int) -> str:
    """'mean' or 'sum': how ``loss_fn`` reduces per-sample losses, read from its gradient at the
    model's ``outputs`` (N + M, ...) on the stream's n samples and then the memory's (``joined``),
    each batch whole. Where the batch loss's gradient there is 1/n (mean) or 1 (sum) times the
    per-sample losses' summed gradient, the chain rule makes g and r, the batch gradients, that
    multiple of sum_i E_i. Any other reduction (class weights over mixed classes, a token mean
    over padded samples of unequal lengths) is refused rather than scored as something else. A
    batch that cannot tell (one sample, or every output gradient zero) agrees with both; torch's
    default 'mean' is taken where both agree. Mean and sum differ by n >= 2, class weights by
    their ratios, rounding by a few eps: the gradients must match to sqrt(eps) of the outputs'
    dtype, normwise."""
    if not isinstance(outputs, Tensor):
        raise TypeError(f"OCS scores need a model returning one Tensor (N, ...), got {type(outputs).__name__}")
    parts = [slice(0, n), *([slice(n, None)] if outputs.shape[0] > n else [])]  # the stream, the memory
    with torch.enable_grad():
        # two leaves of the same outputs: the batch losses' gradient at them (the two batches' rows
        # apart) and the per-sample losses', in one backward
        o, oe = (outputs.detach().requires_grad_() for _ in range(2))
        batches = [loss_fn(o[p], targets[p]) for p in parts]
        if any(not isinstance(b, Tensor) or b.ndim != 0 for b in batches):
            raise ValueError(f"loss_fn must return a scalar, got {[getattr(b, 'shape', b) for b in batches]}")
        each = per_sample_losses(loss_fn, oe, targets)
        checks.finite({"the model's per-sample losses": each, "the model's batch loss": torch.stack(batches)},
                      error=FloatingPointError, hint="OCS scores would be NaN")
        gb, ge = (g.double() for g in torch.autograd.grad(sum(batches) + each.sum(), (o, oe), allow_unused=True,
                                                          materialize_grads=True))
    sizes = [len(range(o.shape[0])[p]) for p in parts]
    # per batch: |gb|, |ge|, |gb - ge / m| (mean), |gb - ge| (sum), read in one sync
    norms = [t.norm() for p, m in zip(parts, sizes, strict=True)
             for t in (gb[p], ge[p], gb[p] - ge[p] / m, gb[p] - ge[p])]
    tol = torch.finfo(o.dtype).eps ** 0.5
    agree = {"mean", "sum"}
    for m, (b, e, off_mean, off_sum) in zip(sizes, torch.stack(norms).view(len(parts), 4).tolist(), strict=True):
        agree &= {name for name, err, scale in (("mean", off_mean, 1.0 / m), ("sum", off_sum, 1.0))
                  if err <= tol * max(b, e * scale)}
    if not agree:
        raise ValueError(
            "loss_fn must reduce per-sample losses by their mean (e.g. F.cross_entropy) or sum: its gradient at "
            "the model's outputs is neither 1/n nor 1 times the per-sample losses' (class weights over mixed "
            "classes, a token mean over samples of unequal lengths); OCS scores need g as a multiple of the "
            "per-sample gradients' sum")
    return "mean" if "mean" in agree else "sum"


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
    names = check_inputs(model, loss_fn, inputs, targets, memory, tau)
    n = inputs.shape[0]
    inputs, targets = joined(inputs, targets, memory)  # one capture for both batches: samples are independent
    both = ghost_terms(model, loss_fn, inputs, targets, names=names)  # memory checked like the stream
    outputs = both.outputs
    if outputs is None:  # no capture ran (every parameter through vmap): one forward for the check
        with torch.no_grad():
            outputs = model(inputs)
    reduction = check_reduction(loss_fn, outputs, targets, n)
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
