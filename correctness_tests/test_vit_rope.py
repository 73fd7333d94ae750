"""The RoPE ViT workload: the model, gradient accumulation equal to the large batch, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kernels
import reference
import reference.training
from correctness_tests.tolerances import REDUCTION, assert_dicts_close
from kernels.models import RopeViT
from kernels.training import Recipe
from workloads import vit_rope
from workloads.cli import vit_rope as vit_rope_cli


def test_model_shapes_and_reference_attention_share_parameters() -> None:
    model = RopeViT(dim=48, heads=4, depth=2)
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    ref = RopeViT(dim=48, heads=4, depth=2, attention=reference.RopeSelfAttention)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ref(x), model(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even head dim"):
        RopeViT(dim=36, heads=4)


def test_accumulation_128x2_equals_batch_256_in_fp32() -> None:
    """The engine's two micro-batches of 128 and one reference step on the same 256 images give
    the same parameters (LayerNorm only: no batch statistics, so the split changes only rounding).
    Plain SGD, whose step is proportional to the gradient: a wrong accumulation scale shows."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    init = RopeViT(dim=32, heads=2, depth=1)
    models = [RopeViT(dim=32, heads=2, depth=1) for _ in range(2)]
    for m in models:
        m.load_state_dict(init.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    kernels.train(models[0], F.cross_entropy, opts[0], [(x[:128], y[:128]), (x[128:], y[128:])],
                  Recipe(accumulation=2))
    reference.training.train(models[1], F.cross_entropy, opts[1], [(x, y)])
    got, want = (dict(m.named_parameters()) for m in models)
    assert_dicts_close(got, want, REDUCTION)
    assert not torch.equal(models[0].head.weight, init.head.weight)  # the step did move the weights


def test_fp32_rows_train_identically() -> None:
    """The reference and the rows that swap in the RoPE cache or the attention kernel are one
    function: same losses and accuracy after the same steps (fp32)."""
    from dataclasses import replace

    from kernels.attention import RopeSelfAttention

    cfg = vit_rope.Config(steps=3, warmup_steps=1, batch=8, accumulation=1, dim=32, heads=2, depth=1)
    ref = vit_rope.reference_method()
    rows = [vit_rope.run(m, cfg) for m in (ref, replace(ref, attention=vit_rope.CachedRopeManualAttention),
                                           replace(ref, attention=RopeSelfAttention))]
    for r in rows[1:]:
        assert r.final_loss == pytest.approx(rows[0].final_loss, rel=1e-4)
        assert r.accuracy == pytest.approx(rows[0].accuracy, abs=0.002)


def test_config_and_data() -> None:
    cfg = vit_rope.Config(steps=2, warmup_steps=1, batch=8, accumulation=2)
    batches = cfg.data(2)
    assert len(batches) == 6 and batches[0][0].shape == (4, 3, 32, 32)
    with pytest.raises(ValueError, match="equal micro-batches"):
        vit_rope.Config(batch=9, accumulation=2)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        vit_rope.cifar10("/nonexistent", train=True)
    assert vit_rope.Config().max_grad_norm == 1.0  # the original's clipping
    with pytest.raises(ValueError, match="max_grad_norm"):
        vit_rope.Config(max_grad_norm=0.0)


def test_cosine_schedule_warms_up_then_decays() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = vit_rope.cosine_schedule(opt, total=10, warmup=2)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs == sorted(lrs[:2]) + sorted(lrs[2:], reverse=True)
    assert lrs[-1] < 0.05


def test_cli_ablation_rows(capsys, tmp_path) -> None:
    # 64 held-out images: the accuracy's evaluation, not the 3 steps, was 90% of each row's time
    argv = ["--steps", "1", "--batch", "8", "--depth", "1", "--ablation", "--no-compile", "--emulated-bf16",
            "--eval-images", "64"]
    assert vit_rope_cli.main([*argv, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "vit_rope.json").read_text())
    assert [r["run"] for r in record["rows"]] == list(record["curves"]["training loss per step"])
    assert all(len(v) == 3 for v in record["curves"]["training loss per step"].values())  # 2 warm-up + 1 step
    assert (tmp_path / "vit_rope.csv").exists() and (tmp_path / "vit_rope.png").exists()
    for row in ("reference (fp32", "+ cached RoPE", "+ attention kernel", "+ fused AdamW", "+ AMP", "optimized ("):
        assert f"| {row}" in out, row
    assert "clipped at 1" in out and ", no clipping |" in out  # the clipping's own ablation row
    for row in (", checkpoint every 10 steps |", ", DataLoader, 0 workers |", ", DataLoader, 2 workers |"):
        assert row in out, row
    for bad in (["--steps", "0"], ["--max-grad-norm", "-1"], ["--no-clip", "--max-grad-norm", "2"],
                ["--eval-images", "0"]):
        with pytest.raises(SystemExit):
            vit_rope_cli.main(bad)


def test_the_loader_feeds_the_same_batches_with_any_number_of_workers() -> None:
    """The optimized run from the augmenting DataLoader: 0 and 2 workers train bitwise alike."""
    cfg = vit_rope.Config(steps=2, batch=8, depth=1, accumulation=2, eval_images=64)
    method = vit_rope.optimized_method(cfg, Recipe(accumulation=2))
    inline, workers = (vit_rope.run(method, cfg, workers=w) for w in (0, 2))
    assert inline.losses == workers.losses and len(inline.losses) == 4
    assert inline.losses != vit_rope.run(method, cfg).losses  # augmented batches, not the preloaded ones


def test_a_run_resumed_from_its_checkpoint_ends_where_the_whole_run_does(tmp_path) -> None:
    """The optimized loop (fixed recipe, accumulation 2, clipping) crashes after 3 saved steps;
    --resume from the checkpoint ends with the uninterrupted run's loss and parameters, bitwise."""
    from kernels.optim import adamw
    from kernels.training import train

    cfg = vit_rope.Config(steps=3, warmup_steps=2, batch=8, accumulation=2, dim=32, heads=2, depth=1)
    method = vit_rope.Method("opt", vit_rope.RopeSelfAttention, adamw, train, vit_rope.Recipe(accumulation=2))
    whole = vit_rope.run(method, cfg)
    path = str(tmp_path / "vit.safetensors")
    calls = []

    def crashing(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the process dies after its third saved step
        calls.append(1)
        return train(*args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        vit_rope.run(replace(method, train_fn=crashing), replace(cfg, checkpoint=path, save_every=1))
    steps_run = []

    def counting(*args, **kwargs):
        result = train(*args, **kwargs)
        steps_run.append(result.optimizer_steps)
        return result

    resumed = vit_rope.run(replace(method, train_fn=counting),
                           replace(cfg, checkpoint=path, save_every=1, resume=True))
    assert sum(steps_run) == 2  # only the 5 - 3 steps left were run
    assert resumed.final_loss == whole.final_loss and resumed.accuracy == whole.accuracy
    assert resumed.first_step == 4 and resumed.losses == whole.losses[3:]  # its curve at its own steps
    # a resume under other settings trains another run (more steps draw other synthetic images): refused
    for other in (replace(cfg, steps=4), replace(cfg, batch=4), replace(cfg, seed=1)):
        with pytest.raises(ValueError, match="saved by a run with other settings"):
            vit_rope.run(method, replace(other, checkpoint=path, resume=True))
    with pytest.raises(ValueError, match=r"saved by a run with other settings \(recipe: saved 'fp32', now"):
        vit_rope.run(replace(method, recipe=vit_rope.Recipe(torch.bfloat16, accumulation=2)),
                     replace(cfg, checkpoint=path, resume=True))
    with pytest.raises(ValueError, match="nothing left"):
        vit_rope.run(method, replace(cfg, checkpoint=path, resume=True))
    with pytest.raises(ValueError, match="resume needs an existing checkpoint"):
        vit_rope.Config(resume=True, checkpoint=str(tmp_path / "none"))
    with pytest.raises(SystemExit):
        vit_rope_cli.main(["--ablation", "--checkpoint", path])


def test_the_cli_resumes_only_under_the_runs_own_settings(capsys, tmp_path) -> None:
    """A checkpoint keeps the settings that define its run (steps, batch, seed, the recipe...):
    --resume with other ones is a one-line error naming them before any run (it went ahead
    silently, on other synthetic images and a recipe Recipe.auto picked again)."""
    path = str(tmp_path / "vit.safetensors")
    argv = ["--batch", "8", "--depth", "1", "--eval-images", "16", "--checkpoint", path]
    assert vit_rope_cli.main(["--steps", "1", "--save-every", "1", *argv]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        vit_rope_cli.main(["--steps", "2", *argv, "--resume"])
    err = capsys.readouterr().err
    assert "saved by a run with other settings (--steps 1)" in err, err


def test_a_bad_checkpoint_is_refused_before_any_run(capsys, monkeypatch, tmp_path) -> None:
    """--checkpoint that could not be written (a directory, a folder that is a file or missing), a
    file that is no checkpoint, or, resuming, one with no steps left or another model's weights: a
    one-line error naming --checkpoint before the reference run, not a traceback after it."""
    from torch import nn

    from kernels.training import save_checkpoint

    class Started(Exception):
        """A run began: the checkpoint got past the CLI's checks."""

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(vit_rope_cli, "run", started)
    (tmp_path / "file.txt").write_text("a file, not a folder")
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    done = tmp_path / "done.safetensors"
    linear = nn.Linear(2, 2)
    save_checkpoint(done, linear, torch.optim.SGD(linear.parameters(), lr=0.1), step=99)
    other = tmp_path / "other.safetensors"  # steps left, but not this ViT's weights
    save_checkpoint(other, linear, torch.optim.SGD(linear.parameters(), lr=0.1), step=1)
    argv = ["--steps", "1", "--batch", "8", "--depth", "1", "--checkpoint"]
    bad = [([str(tmp_path)], "is a directory"), ([str(tmp_path / "file.txt" / "vit.safetensors")], "not a folder"),
           ([str(tmp_path / "missing" / "vit.safetensors")], "does not exist"),
           ([str(tmp_path / "bad.safetensors")], "not a kernelgate checkpoint"),
           ([str(tmp_path / "bad.safetensors"), "--resume"], "not a kernelgate checkpoint"),
           ([str(done), "--resume"], "nothing left"), ([str(other), "--resume"], "another model's weights"),
           # an earlier run's state is not replaced unasked (it was, silently)
           ([str(done)], "holds an earlier run's checkpoint, at step 99: pass --resume")]
    for args, message in bad:
        with pytest.raises(SystemExit):
            vit_rope_cli.main([*argv, *args])
        err = capsys.readouterr().err
        assert "--checkpoint" in err and message in err, (args, err)
    with pytest.raises(Started):  # a new file
        vit_rope_cli.main([*argv, str(tmp_path / "new.safetensors")])


def test_tokens_are_patches_in_raster_order_and_attention_reads_the_normed_tokens() -> None:
    """Token 8 r + c is the 4x4 patch at row r, column c (RoPE's positions follow it); a block's
    attention sees norm1 of its tokens (pre-LN)."""
    from correctness_tests.tolerances import ELEMENTWISE, assert_close

    torch.manual_seed(0)
    model, x, seen = RopeViT(dim=8, heads=2, depth=1), torch.randn(2, 3, 32, 32), {}
    block = model.blocks[0]
    block.register_forward_pre_hook(lambda m, args: seen.setdefault("tokens", args[0]))
    block.attn.register_forward_pre_hook(lambda m, args: seen.setdefault("attention", args[0]))
    with torch.no_grad():
        model(x)
        for r, c in [(0, 1), (2, 5), (7, 0)]:
            patch = F.conv2d(x[:, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4], model.patch.weight, model.patch.bias)
            assert_close(seen["tokens"][:, 8 * r + c], patch.flatten(1), ELEMENTWISE)
        assert_close(seen["attention"], block.norm1(seen["tokens"]), ELEMENTWISE)


def test_the_lr_schedule_spans_the_warmup_and_the_timed_steps() -> None:
    """The lr at each of a run's 2 + 3 optimizer steps: warm-up to lr, then cosine decay towards 0 at
    step 5 (the whole run), lr x [0.5, 1, 1, 0.75, 0.25]."""
    from kernels.attention import RopeSelfAttention
    from kernels.optim import adamw

    lrs = []

    def recording_adamw(params, **kwargs):
        opt = adamw(params, **kwargs)
        opt.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
        return opt

    cfg = vit_rope.Config(steps=3, warmup_steps=2, batch=8, accumulation=1, dim=32, heads=2, depth=1,
                          eval_images=16)
    vit_rope.run(vit_rope.Method("lr", RopeSelfAttention, recording_adamw, reference.training.train), cfg)
    assert lrs == pytest.approx([cfg.lr * f for f in (0.5, 1.0, 1.0, 0.75, 0.25)])


def _cifar_files(root, records: dict[str, list[int]]) -> None:
    """CIFAR-10's binary files under ``root``: per file, one record per label, its 3 planes at pixel
    values 10, 20, 30 (channel-major, as the binary version stores them)."""
    import numpy as np

    folder = root / vit_rope.CIFAR_BIN
    folder.mkdir(parents=True, exist_ok=True)
    plane = 32 * 32
    for name, labels in records.items():
        rows = [np.concatenate([[label], [10] * plane, [20] * plane, [30] * plane]) for label in labels]
        np.concatenate(rows).astype(np.uint8).tofile(folder / name)


def test_cifar10_reads_every_training_file_with_its_labels_and_planes(tmp_path) -> None:
    """data_batch_1..5 (not the test batch) in order, the label byte first, then the R, G, B planes;
    a file cut short is refused as damaged."""
    _cifar_files(tmp_path, {**{f"data_batch_{i}.bin": [i, i + 5] for i in range(1, 6)}, "test_batch.bin": [0]})
    x, y = vit_rope.cifar10(str(tmp_path), train=True)
    assert y.tolist() == [1, 6, 2, 7, 3, 8, 4, 9, 5, 10] and x.shape == (10, 3, 32, 32)
    means = x.mean(dim=(0, 2, 3))
    assert bool(means[0] < means[1] < means[2]) and bool((x[:, 0] == x[0, 0, 0, 0]).all())
    assert vit_rope.cifar10(str(tmp_path), train=False)[1].tolist() == [0]
    with (tmp_path / vit_rope.CIFAR_BIN / "data_batch_5.bin").open("ab") as fh:
        fh.write(b"\x00" * 7)
    with pytest.raises(ValueError, match="not whole 3073-byte records"):
        vit_rope.cifar10(str(tmp_path), train=True)


def test_accuracy_is_measured_on_images_the_run_did_not_train_on() -> None:
    seen = []

    class Recording(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return torch.zeros(len(x), 10)

    cfg = vit_rope.Config(steps=2, warmup_steps=0, batch=8, accumulation=1, eval_images=16)
    vit_rope.accuracy(Recording(), cfg)
    train = cfg.images()[0].flatten(1)
    held_out = torch.cat(seen).flatten(1)
    assert len(held_out) == 16 and not (held_out[:, None] == train[None]).all(-1).any()


def test_a_checkpoint_keeps_every_setting_that_defines_its_run() -> None:
    """run_settings differs for each setting a resume must share (lr, weight decay, clipping, data,
    the model's size, the recipe): a resume under another is refused."""
    cfg = vit_rope.Config()
    base = vit_rope.run_settings(cfg, Recipe(accumulation=2))
    others = [{"lr": 2e-3}, {"weight_decay": 0.1}, {"max_grad_norm": None}, {"warmup_steps": 3}, {"dim": 96},
              {"heads": 4}, {"depth": 2}, {"steps": 21}, {"batch": 32}, {"seed": 1}]
    for change in others:
        assert vit_rope.run_settings(replace(cfg, **change), Recipe(accumulation=2)) != base, change
    assert vit_rope.run_settings(cfg, Recipe(torch.bfloat16, accumulation=2)) != base
    assert vit_rope.run_settings(cfg, Recipe(accumulation=4)) != base


def test_the_table_gives_each_rows_speedup_over_the_reference() -> None:
    rows = [vit_rope.ViTReport("ref", 40.0, None, 0.5, 2.0), vit_rope.ViTReport("opt", 10.0, 12.4, 0.25, 1.5)]
    cells = vit_rope.table(rows)
    assert cells[1] == ["opt", "10.0", "4.00x", "0.0", "12", "25.0%", "1.500"] and cells[0][2] == "1.00x"


def test_the_ablation_leaves_out_only_the_amp_row_where_bf16_is_emulated(monkeypatch) -> None:
    """The rows' names (runs faked): without --emulated-bf16 on such a CPU the AMP row goes, the
    optimized row and the rows built on it stay."""
    from kernels.attention import RopeSelfAttention
    from kernels.optim import adamw
    from kernels.training import train

    monkeypatch.setattr(vit_rope, "bf16_emulated", lambda device: True)
    monkeypatch.setattr(vit_rope, "optimized_method", lambda cfg: vit_rope.Method(
        "optimized (fp32, accumulation 2)", RopeSelfAttention, adamw, train, Recipe(accumulation=2)))
    monkeypatch.setattr(vit_rope, "run",
                        lambda m, cfg, workers=None: vit_rope.ViTReport(m.name, 1.0, None, 0.5, 1.0))
    names = [r.name for r in vit_rope.ablation(vit_rope.Config(), compile_=False)]
    assert not any(n.startswith("+ AMP") for n in names)
    assert names[4] == "optimized (fp32, accumulation 2)" and names[5].startswith(names[4] + ", no clipping")
    names = [r.name for r in vit_rope.ablation(vit_rope.Config(), compile_=False, emulated_bf16=True)]
    assert names[4].startswith("+ AMP") and names[5] == "optimized (fp32, accumulation 2)"
