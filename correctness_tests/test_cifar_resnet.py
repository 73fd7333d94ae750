"""The CIFAR ResNet workload runs end to end at a tiny size, and refuses bad input."""

from __future__ import annotations

import pytest
import torch

from kernels.models import ResNet10
from kernels.training import Recipe
from workloads.cifar_resnet import Config, ablation, format_rows, run, synthetic_cifar
from workloads.cli.cifar_resnet import main


def test_synthetic_cifar_shapes_and_determinism() -> None:
    x, y = synthetic_cifar(16, seed=3)
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (16,)
    assert int(y.min()) >= 0 and int(y.max()) < 10
    x2, y2 = synthetic_cifar(16, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="n must be"):
        synthetic_cifar(0)


def test_the_optimized_run_learns() -> None:
    """25 steps of batch 32: held-out accuracy far above chance (0.1); measured 0.98."""
    report = run(Config(steps=25, batch=32), Recipe(), "fp32")
    assert report.accuracy > 0.6 and report.final_loss < 1.0


def test_ablation_runs_every_row() -> None:
    rows = ablation(Config(steps=6, batch=16, warmup=1, eval_images=64), compile_=False, emulated_bf16=True)
    assert [r.name.split(" (")[0] for r in rows] == [
        "baseline", "+ fused AdamW", "+ AMP", "+ channels_last", "auto", "auto, deterministic",
        "auto + OneCycleLR, accumulation 2",
        "auto + DataLoader, 0 workers", "auto + DataLoader, 2 workers"]
    assert all(r.ms_per_step > 0 and 0.0 <= r.accuracy <= 1.0 for r in rows)
    assert all(torch.isfinite(torch.tensor(r.final_loss)) for r in rows)
    assert len(format_rows(rows)) == len(rows) + 2


def test_ablation_leaves_emulated_bf16_out(monkeypatch) -> None:
    """On a CPU without bf16 instructions the AMP row is left out and the next rows build on fp32."""
    import workloads.cifar_resnet as C

    monkeypatch.setattr(C, "bf16_emulated", lambda device: True)
    rows = ablation(Config(steps=1, batch=8, warmup=1, eval_images=64), compile_=False)
    names = [r.name for r in rows]
    assert "+ AMP" not in names and names[1:3] == ["+ fused AdamW (fp32)", "+ channels_last"]


def test_resnet10_refuses_non_images() -> None:
    with pytest.raises(ValueError, match="images"):
        ResNet10()(torch.zeros(2, 32, 32))


def test_cli_rejects_bad_sizes(capsys) -> None:
    for bad in (["--steps", "0"], ["--batch", "7"]):
        with pytest.raises(SystemExit):
            main(bad)
        assert "--steps must be >= 1 and --batch an even number >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--eval-images", "0"])
    assert "eval_images must be" in capsys.readouterr().err


def test_resnet10_stages_halve_the_resolution_after_the_first() -> None:
    """Feature maps 32 (stem), 32, 16, 8, 4 (stages) at widths 16-128; each block ends in a ReLU of
    the residual sum, so its output is non-negative even where the shortcut is a conv."""
    torch.manual_seed(0)
    model = ResNet10(norm="group")
    x = model.stem(torch.randn(2, 3, 32, 32))
    shapes = [tuple(x.shape[1:])]
    for stage in model.stages:
        x = stage(x)
        shapes.append(tuple(x.shape[1:]))
        assert bool((x >= 0).all())
    assert shapes == [(16, 32, 32), (16, 32, 32), (32, 16, 16), (64, 8, 8), (128, 4, 4)]
