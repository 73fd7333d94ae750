"""Top-10 singular values of one matrix with a decaying spectrum (0.9^i, a LoRA-like update's
shape), smoke 512 x 512, full 1024 x 1024: full svdvals (the reference) against the randomized
range finder (q = 20, 4 power iterations). The timed result must be within 1e-4 relative of the
reference's values. Floors: docs/measurements/floors.md (measurements: docs/measurements/from-the-code.md).

Peers, the libraries a user would call instead, timed in the same group at the same accuracy
check: ``torch.svd_lowrank(A, q=20, niter=4)`` (the same range finder, without our per-value
error bound) and scikit-learn's ``randomized_svd(A, 10)``. Their rows carry no floor: ours is
not ahead of them yet (docs/kernels/spectral.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.utils.extmath import randomized_svd

import kernels.spectral as KS
import reference.spectral as RS

SIZE = {"smoke": 512, "full": 1024}
IMPLS = {"reference": RS.topk_singular_values, "optimized": KS.topk_singular_values}


def _svd_lowrank(a: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """torch's randomized SVD at our oversampling and power iterations (it takes no generator: it
    draws from the global one, left as it is)."""
    return torch.svd_lowrank(a, q=2 * k, niter=4)[1][:k]


def _randomized_svd(a: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """scikit-learn's randomized SVD with its defaults (10 oversamples, 'auto' power iterations)."""
    seed = int(torch.randint(2**31, (), generator=generator))
    s = randomized_svd(a.cpu().numpy(), k, random_state=np.random.RandomState(seed))[1]
    return torch.from_numpy(s).to(a.device)


PEERS = {"peer: torch.svd_lowrank": _svd_lowrank, "peer: sklearn randomized_svd": _randomized_svd}


@pytest.mark.speedup(cpu={"smoke": 5.5, "full": 10.0})
@pytest.mark.speedup(over="peer: torch.svd_lowrank")
@pytest.mark.speedup(over="peer: sklearn randomized_svd")
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
