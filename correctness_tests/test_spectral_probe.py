"""The spectral probe workload: data, features through the cache, the classifier, the CLI."""

from __future__ import annotations

import json
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


def test_the_cache_key_names_the_device(tmp_path, monkeypatch) -> None:
    """The features' test matrices come from a generator on cfg.device, so they differ by device:
    features cached on one device are not another's."""
    import kernels.feature_cache as FC

    keys = []
    real = FC.key_hash
    monkeypatch.setattr(FC, "key_hash", lambda key: keys.append(key) or real(key))
    P.run(replace(P.optimized_method(SMALL, FeatureCache(tmp_path)), recipe=Recipe()), SMALL)
    assert keys and keys[0]["device"] == "cpu"


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
    better = [(0.75, 0.76), (0.79, 0.83), (0.77, 0.80), (0.76, 0.80), (0.735, 0.74)]  # evidence
    assert "+2.5 points" in P.accuracy_claim(better) and "rejected at p = 0.0046" in P.accuracy_claim(better)
    worse = [(0.75, 0.74), (0.79, 0.77), (0.77, 0.78)]
    assert "not shown to be within 1 point" in P.accuracy_claim(worse)
    assert "no spread" in P.accuracy_claim([(0.7, 0.7), (0.8, 0.8)])


def test_sampled_layers_and_loader_workers() -> None:
    """--sample-layers keeps a seeded subset of the layers; workers generate the same weights."""
    cfg = replace(SMALL, layers=8, sample_layers=0.25)
    used = P.layer_indices(cfg)
    assert len(used) == 2 and used == sorted(used) and used == P.layer_indices(cfg)
    assert P.layer_indices(replace(cfg, sample_layers=0.01)) != [] and P.layer_indices(SMALL) == [0, 1]
    x, _ = P.features(cfg, P.spectral_features)
    assert x.shape == (60, 2 * 32)
    x2, _ = P.features(replace(cfg, num_workers=2), P.spectral_features)
    assert torch.equal(x, x2)
    for bad, match in (({"sample_layers": 0.0}, "sample_layers is a fraction"),
                       ({"sample_layers": 1.5}, "sample_layers is a fraction"),
                       ({"num_workers": -1}, "num_workers must be >= 0"), ({"device": "tpu"}, "device must be")):
        with pytest.raises(ValueError, match=match):
            replace(SMALL, **bad)


TINY = ["--samples", "60", "--layers", "2", "--dim", "32", "--max-epochs", "2", "--no-amp"]


def test_cli_keeps_features_between_runs(tmp_path, capsys) -> None:
    """A second run with the same --cache-dir reads the optimized run's features back; --no-cache
    keeps nothing; --output-dir writes the table, the epochs' curves and the machine."""
    cache = tmp_path / "cache"
    assert spectral_probe_cli.main([*TINY, "--cache-dir", str(cache)]) == 0
    first = capsys.readouterr().out
    assert f"features cache: {cache}" in first and len(list(cache.glob("*.safetensors"))) == 1
    assert "| optimized (top-k, Standardizer, batch 256, fp32) | computed |" in first
    assert ", again | cache |" in first
    assert spectral_probe_cli.main([*TINY, "--cache-dir", str(cache), "--output-dir", str(tmp_path / "out")]) == 0
    second = capsys.readouterr().out
    assert "| optimized (top-k, Standardizer, batch 256, fp32) | cache |" in second
    record = json.loads((tmp_path / "out" / "spectral_probe.json").read_text())
    assert [r["features"] for r in record["rows"]] == ["computed", "cache", "cache"]
    assert record["config"]["samples"] == 60 and record["machine"]["device_type"] == "cpu"
    assert all(len(v) == 2 for v in record["curves"]["validation loss per epoch"].values())  # 2 epochs each
    assert (tmp_path / "out" / "spectral_probe.png").stat().st_size > 0
    assert spectral_probe_cli.main([*TINY, "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "features cache: none (--no-cache)" in out and ", again" not in out


def test_cli_quick_and_bad_flags(tmp_path, capsys) -> None:
    quick = ["--quick", "--layers", "4", "--dim", "32", "--max-epochs", "1", "--no-cache"]
    assert spectral_probe_cli.main(quick) == 0
    assert "Spectral probe: 100 samples x 1 of 4 layers of 32x32" in capsys.readouterr().out  # 0.25 x 4 layers
    for bad in (["--ablation", "--cache-dir", str(tmp_path)], ["--sample-layers", "0"], ["--num-workers", "-1"],
                ["--seeds", "-1"], ["--cache-dir", str(tmp_path / "f"), "--no-cache"],
                ["--seeds", "1", "--cache-dir", str(tmp_path)], ["--seeds", "1", "--output-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:
            spectral_probe_cli.main(bad)
        assert exc.value.code == 2, bad
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):  # a cache folder that is a file: a usage error, not a traceback
        spectral_probe_cli.main([*TINY, "--cache-dir", str(tmp_path / "file")])
    assert "error:" in capsys.readouterr().err


def test_the_split_is_70_10_20_without_overlap() -> None:
    tr, va, te = P._split(SMALL)
    assert (len(tr), len(va), len(te)) == (42, 6, 12)
    assert torch.equal(torch.cat([tr, va, te]).sort().values, torch.arange(60))


def _random_features(w: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(len(w), 32, generator=generator, device=w.device)


def _fake_method(train_fn, scaler=None, batch: int = 41) -> P.Method:
    from kernels.standardize import Standardizer

    return P.Method("fake", _random_features, scaler or Standardizer, batch, train_fn)


def test_early_stopping_waits_patience_epochs_and_the_lr_drops_on_a_plateau() -> None:
    """A training that leaves the model as it is: the first epoch's validation loss stays the best,
    so the run stops after 1 + patience epochs; ReduceLROnPlateau (patience 5) divides the lr by 10
    after the 6th epoch without improvement. Batches of 41 of the 42 training rows: the 1-row rest
    (BatchNorm needs 2) is left out."""
    lrs, sizes = [], []

    def untrained(model, loss_fn, opt, batches, recipe, device):
        lrs.append(opt.param_groups[0]["lr"])
        sizes.append([len(y) for _, y in batches])

    report = P.run(_fake_method(untrained), replace(SMALL, max_epochs=30, patience=8))
    assert report.epochs == 9 and len(report.val_loss) == 9
    assert lrs == pytest.approx([1e-3] * 7 + [1e-4] * 2)
    assert sizes == [[41]] * 9


def test_the_test_accuracy_is_the_best_epochs(monkeypatch) -> None:
    """Epochs after the first leave NaN weights (faked): the validation loss never improves again, and
    the test accuracy is measured on the first epoch's weights, restored."""
    calls, evaluated = [], []

    def diverging(model, loss_fn, opt, batches, recipe, device):
        calls.append(1)
        if len(calls) > 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))

    evaluate = P._evaluate
    monkeypatch.setattr(P, "_evaluate", lambda model, x, y: evaluated.append(
        all(bool(p.isfinite().all()) for p in model.parameters())) or evaluate(model, x, y))
    P.run(_fake_method(diverging), replace(SMALL, max_epochs=10, patience=2))
    assert evaluated == [True, False, False, True]  # 3 validation passes, then the test set


def test_the_standardizer_is_fit_on_the_training_rows_alone() -> None:
    fitted = []

    class Recording:
        def fit(self, x):
            fitted.append(len(x))
            return self

        def transform(self, x):
            return x

    P.run(_fake_method(lambda *a, **k: None, scaler=Recording), replace(SMALL, max_epochs=1))
    assert fitted == [42]


def test_a_layer_as_wide_as_the_rank_is_accepted() -> None:
    assert replace(SMALL, dim=4, rank=4).dim == 4


def test_the_table_gives_the_speedup_of_the_whole_time() -> None:
    rows = [P.ProbeReport("ref", 6.0, 2.0, 10, 0.9), P.ProbeReport("opt", 1.0, 1.0, 10, 0.9, "cache")]
    cells = P.table(rows)
    assert [c[P.HEADER.index("total speedup")] for c in cells] == ["1.00x", "4.00x"]
    assert cells[1][:4] == ["opt", "cache", "1.00", "1.00"] and cells[1][-1] == "90.0%"


def test_the_cache_key_holds_every_data_setting(tmp_path) -> None:
    """Features generated under another noise, rank, seed or layers are another entry: each of these
    configs misses the cache once."""
    from kernels.training import train

    method = replace(_fake_method(train), cache=FeatureCache(tmp_path))
    configs = [SMALL, replace(SMALL, noise=0.05), replace(SMALL, rank=3), replace(SMALL, seed=1),
               replace(SMALL, layers=3), replace(SMALL, layers=3, sample_layers=0.5)]
    for cfg in configs:
        P._features(cfg, method)
    assert method.cache.misses == len(configs) and method.cache.hits == 0


def test_quick_keeps_the_sizes_given(capsys, monkeypatch) -> None:
    """--quick sets --samples, --max-epochs and --sample-layers only where they are not given (runs faked)."""
    seen = []
    monkeypatch.setattr(spectral_probe_cli, "run", lambda m, cfg: seen.append(cfg) or P.ProbeReport(
        m.name, 1.0, 1.0, 1, 0.5))
    monkeypatch.setattr(spectral_probe_cli, "optimized_method", lambda cfg, store, amp: P.reference_method())
    argv = ["--quick", "--samples", "60", "--max-epochs", "3", "--sample-layers", "0.5", "--layers", "4",
            "--dim", "32", "--no-cache"]
    assert spectral_probe_cli.main(argv) == 0
    assert "Spectral probe: 60 samples x 2 of 4 layers" in capsys.readouterr().out
    assert {(c.samples, c.max_epochs, c.sample_layers) for c in seen} == {(60, 3, 0.5)}
