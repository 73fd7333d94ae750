"""Gram products of per-sample gradients without building them ("ghost" identities).

For ``nn.Linear`` with captured layer inputs a (B, T, in) and output gradients b (B, T, out):
<g_i(W), g_j(W)> = sum_{t,s} (a_it . a_js)(b_it . b_js) and <V, g_i(W)> = sum_t b_it^T V a_it.
Other parameters arrive materialized (vmap) and meet in one flat product. ``GhostTerms`` is built
by ``kernels.per_sample.ghost_terms``; Gram, norms and OCS scores are computed from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def _one_row(a: Tensor, g: Tensor, diagonal: bool, weight: bool, bias: bool) -> Tensor:
    """Gram (B, B), or its diagonal (B,), of one Linear layer's trainable parameters with one row a
    sample (a (B, 1, in), g (B, 1, out)): g_i(W) = b_i a_i^T and g_i(bias) = b_i, so the weight's
    term (a_i . a_j)(b_i . b_j) and the bias's b_i . b_j make one product."""
    a2, g2 = a[:, 0], g[:, 0]
    gg = _sum_squares(g2) if diagonal else g2 @ g2.T
    if not weight:
        return gg
    return gg * ((_sum_squares(a2) if diagonal else a2 @ a2.T) + float(bias))


def _ghost_weight(a: Tensor, g: Tensor, diagonal: bool) -> Tensor:
    """Gram (B, B), or its diagonal (B,), of one Linear weight's per-sample gradients, rows T > 1
    (one row: ``_one_row``)."""
    if a.shape[1] ** 2 > a.shape[2] * g.shape[2]:
        # Long token axis: T^2 dot products cost more than building the (out, in) gradients.
        w = torch.einsum("bto,bti->boi", g, a).flatten(1)
        return _sum_squares(w) if diagonal else w @ w.T
    spec = "bti,bsi->bts" if diagonal else "bti,csi->bcts"
    aa, gg = torch.einsum(spec, a, a), torch.einsum(spec.replace("i", "o"), g, g)
    return (aa * gg).sum((-2, -1))


def _sum_squares(rows: Tensor) -> Tensor:
    """(B,): each row's sum of squares, for rows (B, d)."""
    return (rows * rows).sum(1)


def _gram_of(flat: Tensor, diagonal: bool) -> Tensor:
    return _sum_squares(flat) if diagonal else flat @ flat.T


@dataclass
class Plan:
    """Which parameters take the layer identity and which go through vmap (kernels.per_sample)."""

    names: list[str]  # trainable parameters, model order (requires_grad False: skipped)
    linear: dict[str, nn.Linear]  # modules whose trainable params use the layer identity
    other: list[str]  # trainable parameters that go through vmap


@dataclass
class GhostTerms:
    """What one forward and backward over a batch leaves for Gram products: captured (A, G) of
    the identity layers and materialized per-sample gradients of every other parameter."""

    plan: Plan
    terms: dict[str, tuple[Tensor, Tensor]]
    grads: dict[str, Tensor]  # name -> (B, *param.shape), parameters in plan.other
    batch: int
    zero: Tensor  # a 0-dim zero in the inputs' dtype and device
    outputs: Tensor | None = None  # the model's outputs on the batch (detached), where a capture ran

    def gram(self, diagonal: bool = False) -> Tensor:
        """G (B, B) with G[i, j] = <g_i, g_j>, or its diagonal (B,)."""
        b = self.batch
        total = self.zero.expand((b,) if diagonal else (b, b))
        with torch.autocast(self.zero.device.type, enabled=False):  # products in the weights' dtype
            for mname, (a, g) in self.terms.items():
                m = self.plan.linear[mname]
                weight, bias = m.weight.requires_grad, m.bias is not None and m.bias.requires_grad
                if a.shape[1] == 1:  # one row a sample: weight and bias in one product
                    total = total + _one_row(a, g, diagonal, weight, bias)
                    continue
                if weight:
                    total = total + _ghost_weight(a, g, diagonal)
                if bias:
                    total = total + _gram_of(g.sum(1), diagonal)
            if self.grads:
                total = total + _gram_of(torch.cat([t.reshape(b, -1) for t in self.grads.values()], 1), diagonal)
        return total

    def rows(self, index: slice) -> GhostTerms:
        """The same terms for a slice of the batch (samples are independent)."""
        terms = {n: (a[index], g[index]) for n, (a, g) in self.terms.items()}
        grads = {n: t[index] for n, t in self.grads.items()}
        outputs = None if self.outputs is None else self.outputs[index]
        return GhostTerms(self.plan, terms, grads, len(range(self.batch)[index]), self.zero, outputs)

    def sum_grad(self) -> dict[str, Tensor]:
        """sum_i g_i per trainable parameter: the batch gradient of a sum-reduced loss."""
        out = {n: t.sum(0) for n, t in self.grads.items()}
        with torch.autocast(self.zero.device.type, enabled=False):
            for mname, m in self.plan.linear.items():
                prefix = f"{mname}." if mname else ""
                a, g = self.terms.get(mname, (None, None))
                for n, p in m.named_parameters(recurse=False):
                    if p.requires_grad:
                        out[prefix + n] = (torch.zeros_like(p) if a is None else
                                           g.flatten(0, 1).T @ a.flatten(0, 1) if n == "weight" else g.sum((0, 1)))
        return out

    def dots(self, vector: dict[str, Tensor]) -> Tensor:
        """(B,) with entry i = <v, g_i>; ``vector`` maps every trainable name to a param-shaped
        tensor. Linear weight: sum_t b_it^T V a_it, one forward-sized matmul, no g_i built."""
        total = self.zero.expand(self.batch)
        with torch.autocast(self.zero.device.type, enabled=False):
            for mname, (a, g) in self.terms.items():
                m, prefix = self.plan.linear[mname], f"{mname}." if mname else ""
                if m.weight.requires_grad:
                    total = total + ((g @ vector[prefix + "weight"]) * a).sum((1, 2))
                if m.bias is not None and m.bias.requires_grad:
                    total = total + g.sum(1) @ vector[prefix + "bias"]
            for name, t in self.grads.items():
                total = total + t.reshape(self.batch, -1) @ vector[name].reshape(-1)
        return total
