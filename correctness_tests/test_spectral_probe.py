"""The spectral probe workload: data, features through the cache, the classifier, the CLI."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.feature_cache import FeatureCache
from kernels.training import Recipe
from kernels.workloads import spectral_probe as P

SMALL = P.Config(samples=60, layers=2, dim=32, rank=4, max_epochs=3, patience=2)


def test_weights_have_the_class_spectral_shape() -> None:
    w = P.layer_weights(SMALL, 0)
    assert w.shape == (60, 32, 32)
    s = torch.linalg.svdvals(w)
    assert bool((s[:, 4:] < 0.1 * s[:, :1]).all())  # rank 4 plus small noise
    y = P.labels(SMALL)
    ratio = s[:, 1] / s[:, 0]  # exp(-1 / tau): grows with the class's tau
    assert ratio[y == 9].mean() > ratio[y == 0].mean()
    assert torch.equal(P.layer_weights(SMALL, 0), w)  # deterministic


def test_features_go_through_the_cache(tmp_path) -> None:
    method = replace(P.optimized_method(SMALL, FeatureCache(tmp_path)), recipe=Recipe())
    first = P.run(method, SMALL)
    assert method.cache.misses == 1 and method.cache.hits == 0
    again = P.run(replace(method, name="cached"), SMALL)
    assert method.cache.hits == 1 and again.accuracy == first.accuracy
    x, _ = P.features(SMALL, P.spectral_features)
    assert x.shape == (60, 2 * 32)


def test_reference_and_optimized_both_train() -> None:
    for method in (P.reference_method(), replace(P.optimized_method(SMALL, None), recipe=Recipe())):
        r = P.run(method, SMALL)
        assert 1 <= r.epochs <= 3 and 0.0 <= r.accuracy <= 1.0 and r.feature_s > 0


def test_config_and_cli() -> None:
    with pytest.raises(ValueError, match="5 per class"):
        P.Config(samples=20)
    with pytest.raises(SystemExit):
        P.main(["--samples", "0"])


def test_seed_comparison_pairs_reference_and_optimized(capsys) -> None:
    pairs = P.compare_seeds(SMALL, 2)
    assert len(pairs) == 2 and all(0.0 <= a <= 1.0 for pair in pairs for a in pair)
    assert P.main(["--samples", "60", "--layers", "1", "--dim", "32", "--max-epochs", "2", "--seeds", "1"]) == 0
    assert "optimized - reference: mean" in capsys.readouterr().out
