"""The peers: what a user would call instead of a kernel, each as a function with the kernel's (or
the reference's) signature, so a perf test times it as one more ``impl`` of its group.

Each optional library is imported when its row runs: a missing one skips that row with the
reason and the install command (``need``), never the whole file. So is a helper of the library
under test that an older revision lacks (``--perf-against REV``: that row is not comparable, not
every row of the files importing this module).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.coreset import top_k
from reference.coreset import literal_scores


@functools.cache  # resolved once, outside the timed calls after the first (a skip is not cached)
def need(module: str, package: str, row: str) -> ModuleType:
    """``module``, or the row ``row`` skipped with the pip command that would run it."""
    return pytest.importorskip(module, reason=f"{row}: not installed (pip install {package})")


# Per-sample gradients: Opacus's GradSampleModule (per-layer hooks), wrapped once per model,
# outside the timed calls, as a training loop wraps its model once.
_WRAPPED: dict[int, nn.Module] = {}


def opacus_grads(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Opacus's per-sample gradients, as ``reference.per_sample_grads``: sample i's gradient of its
    own loss (``loss_reduction="mean"`` scales Opacus's samples back to that)."""
    opacus = need("opacus", "opacus", "peer: opacus")
    if id(model) not in _WRAPPED:  # checked and wrapped once, outside the timed calls after the first
        if any(isinstance(m, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm))
               for m in model.modules()):
            raise ValueError("the Opacus peer runs its copy in train mode (Opacus captures only there): "
                             "a model with dropout or batch norm would compute another function")
        _WRAPPED.clear()
        _WRAPPED[id(model)] = opacus.GradSampleModule(copy.deepcopy(model), batch_first=True,
                                                      loss_reduction="mean").train()
    gsm = _WRAPPED[id(model)]
    for p in gsm.parameters():
        p.grad, p.grad_sample = None, None
    loss_fn(gsm(x), y).backward()
    return {n: p.grad_sample for n, p in gsm._module.named_parameters() if p.requires_grad}


def opacus_norms(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor) -> Tensor:
    """Opacus's per-sample gradients, then the per-sample norm its clipping takes: (B,)."""
    grads = opacus_grads(model, loss_fn, x, y)
    return torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)


_GHOST: dict[int, nn.Module] = {}


def opacus_ghost_norms(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor) -> Tensor:
    """Per-sample gradient norms as Opacus's ghost clipping (fast gradient clipping) computes them:
    one forward and backward through ``GradSampleModuleFastGradientClipping``, whose hooks take
    each Linear layer's norms from its activations and backprops without the gradients; (B,).
    (Its second backward, with the clipping coefficients, belongs to a DP step, not to the norms.)"""
    opacus = need("opacus", "opacus", "peer: opacus ghost clipping")
    if id(model) not in _GHOST:  # wrapped once, outside the timed calls after the first
        _GHOST.clear()
        _GHOST[id(model)] = opacus.grad_sample.GradSampleModuleFastGradientClipping(
            copy.deepcopy(model), batch_first=True, loss_reduction="mean", use_ghost_clipping=True).train()
    gsm = _GHOST[id(model)]
    for p in gsm.parameters():
        p.grad = None
    loss_fn(gsm(x), y).backward()
    return gsm.get_norm_sample()


def opacus_gram(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor) -> Tensor:
    """Opacus's per-sample gradients flattened into E (B, P), then E @ E.T: (B, B)."""
    flat = torch.cat([g.flatten(1) for g in opacus_grads(model, loss_fn, x, y).values()], 1)
    return flat @ flat.T


def opacus_ocs_select(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor, k: int, *,
                      memory: tuple[Tensor, Tensor] | None = None, tau: float = 1000.0) -> Tensor:
    """OCS with a per-sample-gradient library: Opacus's E (N, P), then the original's formulas."""
    return top_k(literal_scores(model, loss_fn, x, y, memory, tau, opacus_grads), k)


# Top-k singular values: the randomized SVDs a user already has.
def svd_lowrank(a: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """torch's randomized SVD at our oversampling and power iterations (it takes no generator: it
    draws from the global one, left as it is)."""
    return torch.svd_lowrank(a, q=2 * k, niter=4)[1][:k]


def randomized_svd(a: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """scikit-learn's randomized SVD with its defaults (10 oversamples, 'auto' power iterations)."""
    extmath = need("sklearn.utils.extmath", "scikit-learn", "peer: sklearn randomized_svd")
    seed = int(torch.randint(2**31, (), generator=generator, device=generator.device))
    s = extmath.randomized_svd(a.cpu().numpy(), k, random_state=np.random.RandomState(seed))[1]
    return torch.from_numpy(s).to(a.device)


# torch.compile of the slow reference: a user's first alternative to a hand-written kernel. Each
# function is compiled once per process; the compile lands in the row's first call (first_call_ms),
# never in its timed rounds.
COMPILED = "peer: torch.compile(reference)"


@functools.cache
def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` (inductor, default mode), made once per function."""
    return torch.compile(fn)


# Per-sample gradients by torch.func's vmap(grad) recipe compiled by inductor: a torch user's first
# alternative to a hand-written per-sample kernel (the reference's loop of backward passes does not
# compile whole: each autograd.grad call breaks the graph).
COMPILED_VMAP = "peer: torch.compile(vmap)"


@functools.cache  # resolved once, outside the timed calls after the first
def _compiled_vmap() -> Callable[..., Any]:
    # imported when the row first runs: 9 of the 13 row modules import this one, and a revision that
    # --perf-against times may predate the helper (their rows would all be "not comparable")
    from workloads.common import vmap_grads

    return compiled(vmap_grads)


def compiled_vmap_grads(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``workloads.common.vmap_grads`` through ``torch.compile`` (compiled once per process)."""
    return _compiled_vmap()(model, loss_fn, x, y)


# Standardization as a torch user writes it instead of scikit-learn's StandardScaler (the reference,
# numpy code torch.compile cannot take), eager and compiled.
TORCH_OPS = "peer: torch ops"
COMPILED_OPS = "peer: torch.compile(torch ops)"


def torch_standardize(x: Tensor) -> Tensor:
    """StandardScaler's fit and transform of x (N, D) in torch ops: each column's mean and population
    variance in one call, a zero scale taken as 1 (a constant column), then (x - mean) / scale."""
    var, mean = torch.var_mean(x, 0, correction=0)
    scale = var.sqrt()
    return (x - mean) / torch.where(scale == 0, 1.0, scale)


# RoPE: rotary-embedding-torch's rotation (the interleaved RoPE our RotaryEmbedding(interleaved=True)
# computes), alone and before torch's SDPA.
ROTATION = "peer: rotary-embedding-torch"
ROTARY = "peer: rotary-embedding-torch + SDPA"


def rotary_rotation(head_dim: int, device: str, row: str = ROTATION) -> Callable[[Tensor], Tensor]:
    """``fn(x)``: rotary-embedding-torch rotates x (B, H, S, D), its frequencies cached."""
    ret = need("rotary_embedding_torch", "rotary-embedding-torch", row)
    return ret.RotaryEmbedding(dim=head_dim).to(device).rotate_queries_or_keys


def rotary_attention(head_dim: int, device: str) -> Callable[..., Tensor]:
    """``fn(q, k, v, causal=)``: rotary-embedding-torch rotates q and k, SDPA attends."""
    rotate = rotary_rotation(head_dim, device, ROTARY)

    def attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        return F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=causal)

    return attend


# The DARTS hypergradient: Betty's own (betty.hypergradient.darts), the original implementation's
# library, on its problem interface (duck-typed here: its Engine would build the same two objects).
BETTY = "peer: betty darts"


def betty_darts(model: nn.Module, inner: Callable, outer: Callable, weight_params: Iterable[Tensor], *,
                lr: float, at: dict[str, Tensor] | None = None) -> list[Tensor]:
    """``kernels.darts_hypergradient``'s quantity through Betty: v = the outer loss's gradient at
    the model's parameters, then Betty's finite difference, which perturbs them in place and
    backpropagates each inner loss through the whole graph. Betty centres it at the current
    parameters (theta', ``at=None``); its result is ours / lr. Betty 0.1.1 leaves the parameters
    at theta' - eps v (its restoring ``add`` is not in place), so they are copied back here."""
    darts = need("betty.hypergradient.darts", "betty-ml", BETTY).darts
    if at is not None:
        raise ValueError("Betty takes the difference at the current parameters only (at=None)")
    params, w = [p for p in model.parameters() if p.requires_grad], list(weight_params)
    v = torch.autograd.grad(outer(model), params)
    saved = [p.detach().clone() for p in params]
    curr = SimpleNamespace(config=SimpleNamespace(darts_alpha=0.01), trainable_parameters=lambda: params,
                           training_step_exec=lambda batch: inner(model), cur_batch=None)
    grads = darts(v, curr, SimpleNamespace(trainable_parameters=lambda: w))
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return [lr * g for g in grads]


# A training step: PyTorch's own recipe, written as its AMP docs write it, with torch's optimizer
# at its defaults (foreach): the loop a user has before reaching for an engine.
def torch_step(model: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer, x: Tensor, y: Tensor,
               dtype: torch.dtype | None = None) -> Tensor:
    """One step: forward (under ``torch.autocast`` at ``dtype`` when given), backward, step,
    ``zero_grad``; returns the loss."""
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


PEERS: dict[str, Any] = {
    "peer: opacus": opacus_grads,
    COMPILED_VMAP: compiled_vmap_grads,
    "peer: opacus norms": opacus_norms,
    "peer: opacus ghost clipping": opacus_ghost_norms,
    "peer: opacus Gram": opacus_gram,
    "peer: opacus + OCS formulas": opacus_ocs_select,
    "peer: torch.svd_lowrank": svd_lowrank,
    "peer: sklearn randomized_svd": randomized_svd,
}
