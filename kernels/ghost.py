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


def qualified(layer: str, param: str) -> str:
    """A layer's parameter by its ``named_parameters`` name: ``layer.param``, or ``param`` for the root."""
    return f"{layer}.{param}" if layer else param


def _one_row(a: Tensor, g: Tensor, weight: bool, bias: bool) -> Tensor:
    """Gram (B, B) of one Linear layer's trainable parameters with one row a sample (a (B, 1, in),
    g (B, 1, out)): g_i(W) = b_i a_i^T and g_i(bias) = b_i, so the weight's term
    (a_i . a_j)(b_i . b_j) and the bias's b_i . b_j make one product."""
    a2, g2 = a[:, 0], g[:, 0]
    gg = g2 @ g2.T
    if not weight:
        return gg
    return gg * (a2 @ a2.T + float(bias))


def _ghost_weight(a: Tensor, g: Tensor, norms: bool = False) -> Tensor:
    """Gram (B, B) of one Linear weight's per-sample gradients, rows T > 1 (one row: ``_one_row``);
    ``norms``: their norms (B,) instead, the square root of its diagonal."""
    if a.shape[1] ** 2 > a.shape[2] * g.shape[2]:
        # Long token axis: T^2 dot products cost more than building the (out, in) gradients.
        w = torch.einsum("bto,bti->boi", g, a).flatten(1)
        return torch.linalg.vector_norm(w, dim=1) if norms else w @ w.T
    spec = "bti,bsi->bts" if norms else "bti,csi->bcts"
    aa, gg = torch.einsum(spec, a, a), torch.einsum(spec.replace("i", "o"), g, g)
    total = (aa * gg).sum((-2, -1))
    return total.clamp_min(0).sqrt() if norms else total  # a sum of squares: rounding must not make NaN


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

    def gram(self) -> Tensor:
        """G (B, B) with G[i, j] = <g_i, g_j>."""
        b = self.batch
        total = self.zero.expand((b, b))
        with torch.autocast(self.zero.device.type, enabled=False):  # products in the weights' dtype
            for mname, (a, g) in self.terms.items():
                m = self.plan.linear[mname]
                weight, bias = m.weight.requires_grad, m.bias is not None and m.bias.requires_grad
                if a.shape[1] == 1:  # one row a sample: weight and bias in one product
                    total = total + _one_row(a, g, weight, bias)
                    continue
                if weight:
                    total = total + _ghost_weight(a, g)
                if bias:
                    bias_grads = g.sum(1)
                    total = total + bias_grads @ bias_grads.T
            if self.grads:
                flat = torch.cat([t.reshape(b, -1) for t in self.grads.values()], 1)
                total = total + flat @ flat.T
        return total.contiguous()  # no term (no layer called): a tensor of its own, not the zero expanded

    def norms(self) -> Tensor:
        """|g_i| (B,): the square root of the Gram's diagonal, as one norm of the per-parameter
        norms. One row a sample: |g_i(W)| = |b_i| |a_i| and |g_i(bias)| = |b_i|, two norms and a
        product a layer (squares and sums of the rows take several ops more)."""
        parts = []
        with torch.autocast(self.zero.device.type, enabled=False):  # products in the weights' dtype
            for mname, (a, g) in self.terms.items():
                m = self.plan.linear[mname]
                weight, bias = m.weight.requires_grad, m.bias is not None and m.bias.requires_grad
                if a.shape[1] == 1:
                    ng = torch.linalg.vector_norm(g, dim=(1, 2))
                    if weight:
                        parts.append(ng * torch.linalg.vector_norm(a, dim=(1, 2)))
                    if bias:
                        parts.append(ng)
                    continue
                if weight:
                    parts.append(_ghost_weight(a, g, norms=True))
                if bias:
                    parts.append(torch.linalg.vector_norm(g.sum(1), dim=1))
            if self.grads:
                flat = torch.cat([t.reshape(self.batch, -1) for t in self.grads.values()], 1)
                parts.append(torch.linalg.vector_norm(flat, dim=1))
            if not parts:  # no layer called: zeros of its own, not the zero expanded
                return self.zero.new_zeros(self.batch)
            return torch.linalg.vector_norm(torch.stack(parts, 1), dim=1)

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
                a, g = self.terms.get(mname, (None, None))
                for n, p in m.named_parameters(recurse=False):
                    if p.requires_grad:
                        out[qualified(mname, n)] = (torch.zeros_like(p) if a is None else
                                           g.flatten(0, 1).T @ a.flatten(0, 1) if n == "weight" else g.sum((0, 1)))
        return out

    def dots(self, vector: dict[str, Tensor]) -> Tensor:
        """(B,) with entry i = <v, g_i>; ``vector`` maps every trainable name to a param-shaped
        tensor. Linear weight: sum_t b_it^T V a_it, one forward-sized matmul, no g_i built."""
        total = self.zero.expand(self.batch)
        with torch.autocast(self.zero.device.type, enabled=False):
            for mname, (a, g) in self.terms.items():
                m = self.plan.linear[mname]
                if m.weight.requires_grad:
                    total = total + ((g @ vector[qualified(mname, "weight")]) * a).sum((1, 2))
                if m.bias is not None and m.bias.requires_grad:
                    total = total + g.sum(1) @ vector[qualified(mname, "bias")]
            for name, t in self.grads.items():
                total = total + t.reshape(self.batch, -1) @ vector[name].reshape(-1)
        return total
