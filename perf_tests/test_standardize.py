"""Standardizer fit + transform of fp32 features, smoke 10000 x 512, full 50000 x 512: scikit-learn's
StandardScaler (the reference) against kernels.Standardizer. The timed result must equal
sklearn's transform within the fp32 tolerance. The floor sits under the measured speedups
(evidence/from-the-code.md).

Peers beside the reference: the same fit and transform in torch ops, as a torch user writes them,
and those ops under ``torch.compile`` (perf_tests/peers.py; no floor yet: docs/peers.md).
"""

from __future__ import annotations

import pytest
import torch

from correctness_tests.tolerances import REDUCTION, assert_close
from kernels.standardize import Standardizer
from perf_tests.peers import COMPILED_OPS, TORCH_OPS, compiled, torch_standardize
from reference.standardize import Standardizer as Reference

ROWS = {"smoke": 10_000, "full": 50_000}
IMPLS = {"reference": Reference, "optimized": Standardizer}


@pytest.mark.speedup(cpu={"smoke": 7.5, "full": 3.0}, cuda={"full": 50.0})
@pytest.mark.speedup(over=TORCH_OPS)
@pytest.mark.speedup(over=COMPILED_OPS)
@pytest.mark.parametrize("impl", [*IMPLS, "optimized, out=", TORCH_OPS, COMPILED_OPS])
def test_standardize(perf, impl: str) -> None:
    """The reference is scikit-learn's StandardScaler, the library most users call; the torch ops
    are the other peers. "optimized, out=" transforms into the previous call's result, as a loop
    can: no fresh (N, D) result to page-fault."""
    n = ROWS[perf.size]
    x = (5.0 + 3.0 * torch.randn(n, 512, generator=torch.Generator().manual_seed(0))).to(perf.device)
    if impl == "optimized, out=":
        buf = torch.empty_like(x)
        fn = lambda: Standardizer().fit(x).transform(x, out=buf)
    elif impl in (TORCH_OPS, COMPILED_OPS):
        peer = torch_standardize if impl == TORCH_OPS else compiled(torch_standardize)
        fn = lambda: peer(x)
    else:
        fn = lambda: IMPLS[impl]().fit(x).transform(x)
    got = perf(fn, label=f"{n}x512 fp32")
    assert_close(got.float(), Reference().fit(x).transform(x).float(), REDUCTION)
