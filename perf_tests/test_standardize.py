"""Standardizer fit + transform of fp32 features, smoke 10000 x 512, full 50000 x 512: scikit-learn's
StandardScaler (the reference) against kernels.Standardizer. The timed result must equal
sklearn's transform within the fp32 tolerance.

Measured on the 2-core CPU: 10000 rows 5.2x (14.6 -> 2.79 ms), 50000 rows 4.5x (77.9 -> 17.5 ms);
torch.var_mean over dim 0 alone took 77 ms at 50000 x 512, so the kernel uses explicit passes
(kernels/standardize.py). Floor 3x, the issue's aim (MEASUREMENTS.md's var_mean: 1.7x).
"""

from __future__ import annotations

import pytest
import torch

from correctness_tests.tolerances import REDUCTION, assert_close
from kernels.standardize import Standardizer
from reference.standardize import Standardizer as Reference

ROWS = {"smoke": 10_000, "full": 50_000}
IMPLS = {"reference": Reference, "optimized": Standardizer}


@pytest.mark.speedup(cpu=3.0)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_standardize(perf, impl: str) -> None:
    n = ROWS[perf.size]
    x = (5.0 + 3.0 * torch.randn(n, 512, generator=torch.Generator().manual_seed(0))).to(perf.device)
    cls = IMPLS[impl]
    got = perf(lambda: cls().fit(x).transform(x), label=f"{n}x512 fp32")
    assert_close(got.float(), Reference().fit(x).transform(x).float(), REDUCTION)
