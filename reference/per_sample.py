"""Reference per-sample gradients: one backward pass per sample, Gram and norms materialized."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.per_sample import LossFn, check_inputs, check_result


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                     chunk_size: int | None = None, randomness: str = "error") -> dict[str, Tensor]:
    """Loop over samples: g_i = autograd.grad(loss_fn(model(x_i[None]), y_i[None])).

    ``chunk_size`` is validated and otherwise ignored (signature parity). ``randomness='same'``
    replays one RNG state for every sample, so each sees the same dropout draw.
    """
    names = check_inputs(model, loss_fn, inputs, targets, randomness, chunk_size)
    params = dict(model.named_parameters())
    trainable = [params[n] for n in names]
    per_name: dict[str, list[Tensor]] = {n: [] for n in names}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(inputs.device) if inputs.is_cuda else None
    for i in range(inputs.shape[0]):
        if randomness == "same":  # replay the generators the forward draws from
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, inputs.device)
        loss = loss_fn(model(inputs[i : i + 1]), targets[i : i + 1])
        if loss.ndim != 0:
            raise ValueError(f"loss_fn must return a scalar per sample, got shape {tuple(loss.shape)}")
        # a loss no trainable parameter reaches (every one in a layer never called): zero gradients
        grads = torch.autograd.grad(loss, trainable, allow_unused=True) if loss.requires_grad else \
            [None] * len(trainable)
        for n, p, g in zip(names, trainable, grads, strict=True):
            per_name[n].append(torch.zeros_like(p) if g is None else g)
    result = {n: torch.stack(gs) if gs else params[n].new_zeros((0, *params[n].shape))
              for n, gs in per_name.items()}
    check_result({f"the per-sample gradient of {n!r}": g for n, g in result.items()})
    return result


def _flat(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, randomness: str,
          chunk_size: int | None) -> Tensor:
    grads = per_sample_grads(model, loss_fn, inputs, targets, randomness=randomness, chunk_size=chunk_size)
    return torch.cat([g.reshape(inputs.shape[0], -1) for g in grads.values()], dim=1)


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def per_sample_grad_gram(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                         chunk_size: int | None = None, randomness: str = "error") -> Tensor:
    """G = E @ E.T with E (B, P) the materialized, flattened per-sample gradients, in their dtype
    (a caller's autocast does not reach the product)."""
    flat = _flat(model, loss_fn, inputs, targets, randomness, chunk_size)
    with torch.autocast(flat.device.type, enabled=False):
        return flat @ flat.T


@torch.enable_grad()  # a gradient computation: works when called under no_grad
def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                          chunk_size: int | None = None, randomness: str = "error") -> Tensor:
    """|g_i| from the materialized per-sample gradients."""
    return _flat(model, loss_fn, inputs, targets, randomness, chunk_size).norm(dim=1)
