"""The spectral probe workload: data, features through the cache, the classifier, the CLI."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.feature_cache import FeatureCache
from kernels.training import Recipe
from workloads import spectral_probe as P
from workloads.cli import spectral_probe as spectral_probe_cli

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
        spectral_probe_cli.main(["--samples", "0"])


def test_seed_comparison_pairs_reference_and_optimized(capsys) -> None:
    pairs = P.compare_seeds(SMALL, 2)
    assert len(pairs) == 2 and all(0.0 <= a <= 1.0 for pair in pairs for a in pair)
    argv = ["--samples", "60", "--layers", "1", "--dim", "32", "--max-epochs", "2", "--seeds", "1"]
    assert spectral_probe_cli.main(argv) == 0
    assert "optimized - reference: mean" in capsys.readouterr().out


def test_sd15_shapes() -> None:
    """SD 1.5's UNet: 16 transformer blocks (320 x 5, 640 x 5, 1280 x 6), each 4 self-attention
    (d x d) and 4 cross-attention projections, 2 of them (d x 768)."""
    shapes = P.SD15_SHAPES
    assert len(shapes) == 128 and sum(s == (s[0], 768) and s[0] != 768 for s in shapes) == 32
    assert sorted({s[0] for s in shapes}) == [320, 640, 1280]
    cfg = replace(SMALL, layers=128, shapes="sd15", samples=50)
    w = P.layer_weights(cfg, 5)  # block 0's cross-attention k: (320, 768)
    assert w.shape == (50, 320, 768)
    s = torch.linalg.svdvals(w)
    assert bool((s[:, cfg.rank:] < 0.1 * s[:, :1]).all())  # rank 4 plus noise at a non-square shape
    with pytest.raises(ValueError, match="shapes='sd15' has 128 layers"):
        replace(SMALL, shapes="sd15")
    with pytest.raises(ValueError, match="shapes must be one of"):
        replace(SMALL, shapes="sdxl")


def test_accuracy_claim_is_a_paired_non_inferiority_test() -> None:
    better = [(0.75, 0.76), (0.79, 0.83), (0.77, 0.80), (0.76, 0.80), (0.735, 0.74)]  # docs/measurements
    assert "+2.5 points" in P.accuracy_claim(better) and "rejected at p = 0.0046" in P.accuracy_claim(better)
    worse = [(0.75, 0.74), (0.79, 0.77), (0.77, 0.78)]
    assert "not shown to be within 1 point" in P.accuracy_claim(worse)
    assert "no spread" in P.accuracy_claim([(0.7, 0.7), (0.8, 0.8)])
