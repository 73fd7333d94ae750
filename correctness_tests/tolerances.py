"""The one tolerance table of the project, keyed by (kernel kind, dtype): (atol, rtol).

atol is normwise: it is scaled by the largest magnitude of the expected tensor, since the
rounding error of a sum or product grows with the size of its terms, not with 1. A test on
small values is therefore as strict as one on large values, never vacuous. A tolerance here
is never loosened to make a test pass: find out why the results differ.
"""

from __future__ import annotations

import torch
from torch import Tensor

ELEMENTWISE = "elementwise"
REDUCTION = "reduction"  # sums, matmuls, Gram matrices, norms
# The DARTS finite-difference hypergradient against the exact one at alpha = 0.01: truncation
# O(alpha^2) plus rounding amplified by 1/eps (kernels/hypergrad.py). Measured on the workload's
# ResNet-10: 4e-5 (fp32) normwise; on a tanh MLP 1.4e-5 in fp64 (truncation alone).
FINITE_DIFFERENCE = "finite_difference"
# The same on a ReLU network: theta +- eps v crosses ReLU kinks, so the error falls only about
# as eps and erratically, and does so in fp64 as well. Measured at alpha = 0.01 on the workload's
# ResNet-10 (fp64, batch 20): 6.4e-4 at widths 16-128, 6.2e-3 at 8-64, 1.9e-1 at 4-8-8-8; over 6
# outer steps at widths 16-128 (fp32): up to 4.6e-3 at batch 20, 2.7e-3 at batch 100 (alpha
# 1e-3: 1.4e-3 and 7.7e-4). Twice the largest measured.
FINITE_DIFFERENCE_RELU = "finite_difference_relu"
# A RoPE rotation whose angles are position x frequency rounded in fp32 (rotary-embedding-torch's, a
# peer row): each angle is off by a few ulps of itself, so the error grows with the position.
# Measured against fp64 angles, normwise, forward and gradient: 1.3e-5 at S=512, 7.5e-5 at S=2048
# (the suite's sizes), 2.2e-4 at S=8192; the project's own rotation: 1.1e-7. Twice the S=2048 figure.
FP32_ANGLES = "fp32_angles"

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    (ELEMENTWISE, torch.float64): (1e-7, 1e-7),
    (REDUCTION, torch.float64): (1e-7, 1e-7),
    (ELEMENTWISE, torch.float32): (1e-5, 1e-5),
    (REDUCTION, torch.float32): (1e-5, 1e-4),
    (ELEMENTWISE, torch.bfloat16): (5e-2, 2e-2),
    (REDUCTION, torch.bfloat16): (5e-2, 2e-2),
    (ELEMENTWISE, torch.float16): (1e-2, 1e-2),
    (REDUCTION, torch.float16): (1e-2, 1e-2),
    (FINITE_DIFFERENCE, torch.float64): (1e-4, 1e-4),
    (FINITE_DIFFERENCE, torch.float32): (1e-3, 1e-3),
    (FINITE_DIFFERENCE_RELU, torch.float64): (1e-2, 1e-2),
    (FINITE_DIFFERENCE_RELU, torch.float32): (1e-2, 1e-2),
    (FP32_ANGLES, torch.float32): (1.5e-4, 1e-5),
}


def tolerance(kind: str, dtype: torch.dtype) -> tuple[float, float]:
    try:
        return TOLERANCES[(kind, dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for ({kind!r}, {dtype}); add it to TOLERANCES") from None


def _scale(t: Tensor) -> float:
    m = t.detach().abs().max().item() if t.numel() else 0.0
    return m if m > 0 else 1.0


def assert_close(actual: Tensor, expected: Tensor, kind: str, msg: str = "",
                 scale: float | None = None, dtype: torch.dtype | None = None) -> None:
    """actual == expected within the table's tolerance for expected's dtype (or ``dtype``: the
    precision the computation ran in, e.g. bfloat16 under autocast with fp32 results).

    atol is multiplied by ``scale``: by default the largest magnitude of ``expected``; pass the
    scale of the whole result when ``expected`` is one part of it (one parameter's gradient).
    """
    atol, rtol = tolerance(kind, dtype or expected.dtype)
    scale = _scale(expected) if scale is None else scale
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{msg}\n{m}" if msg else m)


def assert_dicts_close(actual: dict[str, Tensor], expected: dict[str, Tensor], kind: str,
                       dtype: torch.dtype | None = None) -> None:
    """Per-parameter results (e.g. gradients) compared with the scale of all of them together:
    a parameter whose exact gradient is 0 still carries the rounding of the whole backward."""
    assert list(actual) == list(expected), f"keys differ: {list(actual)} vs {list(expected)}"
    scale = max((_scale(t) for t in expected.values()), default=1.0)
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        assert actual[name].dtype == expected[name].dtype, name
        assert_close(actual[name], expected[name], kind, msg=f"parameter {name}", scale=scale, dtype=dtype)


def max_error(actual: Tensor, oracle: Tensor, scale: float | None = None) -> float:
    """Normwise error of ``actual`` against a higher-precision ``oracle`` (divided by ``scale``,
    by default the oracle's largest magnitude)."""
    return ((actual.double() - oracle.double()).abs().max() / (scale or _scale(oracle))).item()


def assert_as_accurate(optimized: Tensor, reference: Tensor, oracle: Tensor, c: float = 4.0,
                       scale: float | None = None, condition: Tensor | None = None) -> None:
    """err(optimized) <= c * err(reference) against the oracle; each error floored at one ulp.
    ``scale`` as in ``assert_close``: the magnitude of the terms when the result cancels.
    ``condition`` (same shape as the result, >= 1): each element's condition number for rounding
    that both sides do in different but equally valid orders (a batched forward against a
    per-sample one): element i's floor is then condition_i ulps, since below it which side rounds
    better is luck, not accuracy."""
    ulp = torch.finfo(reference.dtype).eps
    e_ref = max_error(reference, oracle, scale)
    if condition is None:
        e_opt = max_error(optimized, oracle, scale)
        assert e_opt <= c * max(e_ref, ulp), (
            f"optimized is less accurate than the reference: {e_opt:.3g} > {c} x {e_ref:.3g}")
        return
    s = scale or _scale(oracle)
    err = (optimized.double() - oracle.double()).abs() / s
    bound = c * torch.maximum(torch.full_like(err, e_ref), ulp * condition.double().clamp_min(1.0))
    worst = int((err / bound).argmax())
    assert bool((err <= bound).all()), (
        f"optimized is less accurate than the reference: element {worst} has error {err[worst].item():.3g} > "
        f"{c} x max(reference's {e_ref:.3g}, {condition[worst].item():.3g} ulps)")
