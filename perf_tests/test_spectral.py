"""Top-10 singular values of one matrix with a decaying spectrum (0.9^i, a LoRA-like update's
shape), smoke 512 x 512, full 1024 x 1024: full svdvals (the reference) against the randomized
range finder (q = 20, 4 power iterations). The timed result must be within 1e-4 relative of the
reference's values. Floors: evidence/floors.md (measurements: evidence/from-the-code.md).

Peers, the libraries a user would call instead, timed in the same group at the same accuracy
check: ``torch.svd_lowrank(A, q=20, niter=4)`` (the same range finder, without our per-value
error bound) and scikit-learn's ``randomized_svd(A, 10)`` (perf_tests/peers.py); the
``speedup(over=...)`` rows time ours against each directly.
"""

from __future__ import annotations

import pytest
import torch

import kernels.spectral as KS
import reference.spectral as RS
from perf_tests import peers

SIZE = {"smoke": 512, "full": 1024}
IMPLS = {"reference": RS.topk_singular_values, "optimized": KS.topk_singular_values}
PEERS = {"peer: torch.svd_lowrank": peers.svd_lowrank, "peer: sklearn randomized_svd": peers.randomized_svd}


@pytest.mark.speedup(cpu={"smoke": 5.5, "full": 10.0}, cuda={"full": 15.0})
@pytest.mark.speedup(cpu={"smoke": 0.85}, over="peer: torch.svd_lowrank")
@pytest.mark.speedup(cpu={"smoke": 3.5}, over="peer: sklearn randomized_svd")
@pytest.mark.parametrize("impl", [*IMPLS, *PEERS])
def test_topk_singular_values(perf, impl: str) -> None:
    n = SIZE[perf.size]
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(n, n, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=g)).Q
    a = ((u * 0.9 ** torch.arange(n)) @ v.T).to(perf.device)
    gen = torch.Generator(device=perf.device)
    fn = {**IMPLS, **PEERS}[impl]
    got = perf(lambda: fn(a, 10, generator=gen.manual_seed(1)), label=f"{n}x{n} k=10")
    want = RS.topk_singular_values(a, 10)
    assert bool(((got - want).abs() <= 1e-4 * want).all())
