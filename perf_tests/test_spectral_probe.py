"""The spectral probe end to end (features, standardization, training to early stopping) at a
CI-sized scale (smoke: 100 samples x 2 layers of 256 x 256, 5 epochs at most). Reference:
svdvals, sklearn, batch 64, fp32. Optimized: randomized top-k, Standardizer, batch 256, the
engine, features computed into an empty FeatureCache each round; cached: the same, reading the
features back from a filled cache. Floors: evidence/floors.md (measurements:
evidence/from-the-code.md).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernels.feature_cache import FeatureCache
from workloads import spectral_probe as P

CFG = {"smoke": P.Config(samples=100, layers=2, max_epochs=5, patience=5),
       "full": P.Config(samples=400, layers=8, max_epochs=20, patience=10)}


@pytest.mark.speedup(cpu=2.0, impl="optimized")
@pytest.mark.speedup(cpu={"smoke": 10.0, "full": 20.0}, impl="cached")
@pytest.mark.parametrize("impl", ["reference", "optimized", "cached"])
def test_spectral_probe(perf, impl: str, tmp_path) -> None:
    cfg = replace(CFG[perf.size], device=perf.device)
    if impl == "reference":
        report = perf(lambda: P.run(P.reference_method(), cfg), label=f"{cfg.samples} x {cfg.layers} layers")
    elif impl == "cached":
        method = P.optimized_method(cfg, FeatureCache(tmp_path / "warm"))
        P.run(method, cfg)  # fills the cache
        report = perf(lambda: P.run(method, cfg), label="features read from the cache")
    else:
        method = P.optimized_method(cfg, None)
        fresh = iter(range(10**6))
        report = perf(lambda cache: P.run(replace(method, cache=cache), cfg), label=method.name,
                      setup=lambda: FeatureCache(tmp_path / f"cold{next(fresh)}"))
    assert 0.0 <= report.accuracy <= 1.0 and report.epochs >= 1
