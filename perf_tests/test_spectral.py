"""Top-10 singular values of one matrix with a decaying spectrum (0.9^i, a LoRA-like update's
shape), smoke 512 x 512, full 1024 x 1024: full svdvals (the reference) against the randomized
range finder (q = 20, 4 power iterations). The timed result must be within 1e-4 relative of the
reference's values. Floors: docs/measurements/floors.md (measurements: docs/measurements/from-the-code.md).
"""

from __future__ import annotations

import pytest
import torch

import kernels.spectral as KS
import reference.spectral as RS

SIZE = {"smoke": 512, "full": 1024}
IMPLS = {"reference": RS, "optimized": KS}


@pytest.mark.speedup(cpu={"smoke": 5.5, "full": 10.0})
@pytest.mark.parametrize("impl", list(IMPLS))
def test_topk_singular_values(perf, impl: str) -> None:
    n = SIZE[perf.size]
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(n, n, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=g)).Q
    a = ((u * 0.9 ** torch.arange(n)) @ v.T).to(perf.device)
    gen = torch.Generator(device=perf.device)
    fn = IMPLS[impl].topk_singular_values
    got = perf(lambda: fn(a, 10, generator=gen.manual_seed(1)), label=f"{n}x{n} k=10")
    want = RS.topk_singular_values(a, 10)
    assert bool(((got - want).abs() <= 1e-4 * want).all())
