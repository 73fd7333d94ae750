"""The Meta-Weight-Net workload: data, the optimized step against the reference step, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

import pytest
import torch

from correctness_tests.tolerances import FINITE_DIFFERENCE, FINITE_DIFFERENCE_RELU, REDUCTION, assert_close
from kernels.training import Recipe
from reference.workloads.meta_reweight import reference_step
from workloads import meta_reweight as M
from workloads.cli import meta_reweight as meta_reweight_cli
from workloads.common import EMULATED_BF16_NOTE, amp_recipe, bf16_emulated
from workloads.meta_reweight import reference_learner

# The workload's ResNet-10 widths: narrower nets cross more ReLU kinks in the finite difference
# (tolerances.FINITE_DIFFERENCE_RELU). Small batches and sets keep it fast.
SMALL = M.Config(max_per_class=60, meta_per_class=4, test_per_class=4, batch=20, meta_batch=20, steps=3,
                 norm="group")

# The CLI test's net and sets: narrow and small, in fields its arguments leave at their defaults.
CLI_SIZE = {"widths": (8, 8, 8, 8), "meta_per_class": 2, "test_per_class": 10, "batch": 20, "meta_batch": 20}


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters()}


def _scale(params: dict[str, torch.Tensor]) -> float:
    return max(p.abs().max().item() for p in params.values())


def test_long_tail_and_balanced_sets() -> None:
    counts = M.class_counts(M.Config())
    assert counts[0] == 490 and counts[-1] == 5 and counts == sorted(counts, reverse=True)  # 490 / 100^(c/9)
    (x, y), (xm, ym), (xt, yt) = M.datasets(SMALL)
    assert x.shape == (sum(M.class_counts(SMALL)), 3, 32, 32)
    assert torch.bincount(y).tolist() == M.class_counts(SMALL)
    assert torch.bincount(ym).tolist() == [4] * 10 and torch.bincount(yt).tolist() == [4] * 10
    b = next(M.batches((x, y), 20, seed=0))
    assert b[0].shape == (20, 3, 32, 32)


def _assert_same(actual: torch.nn.Module, expected: torch.nn.Module, kind: str) -> None:
    want = _params(expected)
    for name, p in _params(actual).items():
        assert_close(p, want[name], kind, msg=name, scale=_scale(want))


def _record_hypergradients(ln: M.Learner) -> list[list[torch.Tensor]]:
    """The gradient Adam receives for W at every outer step."""
    seen, step = [], ln.outer_opt.step

    def recording_step(*args, **kwargs):
        seen.append([p.grad.clone() for p in ln.weight_net.parameters()])
        return step(*args, **kwargs)

    ln.outer_opt.step = recording_step
    return seen


def _lockstep(a: M.Learner, a_step, b: M.Learner, b_step, hypergradient_kind: str, steps: int = 4) -> None:
    """Run two learners on the same batches; after every outer step the classifiers agree to fp32
    reduction rounding and the hypergradients Adam received to ``hypergradient_kind``; then W and
    its Adam state are synced from ``b``. Unsynced, Adam's update lr * m / (sqrt(v) + eps) turns a
    hypergradient element smaller than the difference's error into a full step of either sign
    (measured: one element of W 2.2e-3 = 2 x meta lr apart after 3 steps), which then reaches the
    classifier through W's weights."""
    a_grads, b_grads = _record_hypergradients(a), _record_hypergradients(b)
    train_set, meta_set, _ = M.datasets(SMALL)
    data, meta = M.batches(train_set, SMALL.batch, 1), M.batches(meta_set, SMALL.meta_batch, 2)
    for step in range(steps):
        batch, m = next(data), next(meta)
        a_step(a, batch, m, SMALL)
        b_step(b, batch, m, SMALL)
        _assert_same(a.model, b.model, REDUCTION)
        scale = max(g.abs().max().item() for g in b_grads[step])
        assert scale > 1e-3, f"a vanishing hypergradient ({scale}) would make this comparison vacuous"
        for got, want in zip(a_grads[step], b_grads[step], strict=True):
            assert_close(got, want, hypergradient_kind, msg=f"hypergradient at step {step}", scale=scale)
        a.weight_net.load_state_dict(b.weight_net.state_dict())
        a.outer_opt.load_state_dict(b.outer_opt.state_dict())


def test_accumulation_in_fp32_equals_the_reference_batch() -> None:
    """fp32, accumulation 4 (micro-batches of 5), fused SGD and the DARTS kernel against the
    reference's one batch of 20, Python SGD and the exact hypergradient, over 4 outer steps (with
    momentum from the second). Constraint: GroupNorm (per-sample statistics); BatchNorm's
    statistics differ per micro-batch (test below)."""
    _lockstep(M.learner(SMALL, recipe=Recipe(accumulation=4)), M.outer_step, reference_learner(SMALL),
              reference_step, FINITE_DIFFERENCE_RELU)


def test_accumulation_alone_is_exact_to_rounding() -> None:
    """The same DARTS step at accumulation 1 and 4: micro-batching changes only fp32 rounding,
    which the difference amplifies by 1 / eps (the smooth-network budget)."""
    _lockstep(M.learner(SMALL, recipe=Recipe(accumulation=4)), M.outer_step, M.learner(SMALL), M.outer_step,
              FINITE_DIFFERENCE)


def test_batchnorm_breaks_the_equality() -> None:
    """The stated constraint is real: with BatchNorm, micro-batches normalize by other statistics."""
    cfg = replace(SMALL, norm="batch", steps=1)
    one, four = M.learner(cfg), M.learner(cfg, recipe=Recipe(accumulation=4))
    M.run("k=1", M.outer_step, one, cfg)
    M.run("k=4", M.outer_step, four, cfg)
    diff = max((a - b).abs().max().item() for a, b in zip(one.model.parameters(), four.model.parameters(),
                                                           strict=True))
    assert diff > 1e-4 * _scale(_params(one.model))


def test_runs_report_accuracy_memory_and_plain_training() -> None:
    r = M.run("opt", M.outer_step, M.learner(SMALL, recipe=amp_recipe("cpu", 2)), SMALL, warmup=1,
              measure_peak=True)
    assert r.ms_per_step > 0 and 0.0 <= r.balanced_accuracy <= 1.0 and (r.peak_mib is None or r.peak_mib > 0)
    plain = M.learner(SMALL)
    before = [p.detach().clone() for p in plain.weight_net.parameters()]
    M.run("plain", M.outer_step, plain, SMALL, reweight=False)
    assert all(torch.equal(a, b) for a, b in zip(before, plain.weight_net.parameters(), strict=True))


def test_config_and_cli(capsys, tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="imbalance must be >= 1"):
        M.Config(imbalance=0.5)
    with pytest.raises(ValueError, match="lr must be > 0"):
        M.Config(lr=0.0)
    with pytest.raises(ValueError, match="a batch of 100 needs max_per_class large enough"):
        M.Config(max_per_class=20)
    ln, (x, y) = M.learner(SMALL, recipe=Recipe(accumulation=3)), M.datasets(SMALL)[0]
    with pytest.raises(ValueError, match="accumulation 3 must divide the batch"):
        M.outer_step(ln, (x[:20], y[:20]), (x[:21], y[:21]), SMALL)
    with pytest.raises(ValueError, match="batch of 100 needs at least 100 samples"):
        next(M.batches((torch.zeros(10, 3), torch.zeros(10)), 100, seed=0))
    for bad in (["--steps", "0"], ["--memory-steps", "0"]):
        with pytest.raises(SystemExit):
            meta_reweight_cli.main(bad)
    # The CLI end to end on a narrow net and small sets (its arguments, tables and files are what
    # this checks; the full-size net's steps are what the other tests compare).
    monkeypatch.setattr(meta_reweight_cli, "Config", partial(M.Config, **CLI_SIZE))
    assert meta_reweight_cli.main(["--steps", "1", "--max-per-class", "100", "--accumulation", "2",
                                   "--memory-steps", "1", "--output-dir", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {f"meta_reweight_{t}.{e}" for t in ("accuracy", "memory")
                                                     for e in ("csv", "json", "png")}
    out = capsys.readouterr().out
    assert "balanced test accuracy" in out and "+ accumulation 2" in out and "peak MiB" in out
    # the AMP rows where bf16 runs in hardware; elsewhere the line that says they are left out
    assert ("+ AMP + accumulation 2" in out) == (not bf16_emulated("cpu")) == (EMULATED_BF16_NOTE not in out)


def test_the_results_json_config_holds_accumulation_and_memory_steps(tmp_path, monkeypatch) -> None:
    """--accumulation (both tables) and --memory-steps (the memory table's steps) are in the JSON's
    config: the Config rebuilt from each file is the one its rows ran with (the runs faked: the
    options and files are what this checks)."""
    ran = {}

    def accuracy_runs(cfg: M.Config, recipe: Recipe) -> list[M.RunReport]:
        ran["accuracy"] = cfg
        return [M.RunReport("r", 1.0, 0.5)]

    def memory_ablation(cfg: M.Config, *args, **kwargs) -> list[M.RunReport]:
        ran["memory"] = (cfg, args, kwargs)
        return [M.RunReport("r", 1.0, 0.5, 2.0), M.RunReport("b", 1.0, 0.5, 1.0)]

    monkeypatch.setattr(meta_reweight_cli, "optimized_recipe", lambda cfg, *args: Recipe())
    monkeypatch.setattr(meta_reweight_cli, "accuracy_runs", accuracy_runs)
    monkeypatch.setattr(meta_reweight_cli, "memory_ablation", memory_ablation)
    assert meta_reweight_cli.main(["--steps", "1", "--accumulation", "2", "--memory-steps", "3",
                                   "--output-dir", str(tmp_path)]) == 0
    for table, steps in (("accuracy", 1), ("memory", 3)):
        config = json.loads((tmp_path / f"meta_reweight_{table}.json").read_text())["config"]
        assert (config.get("accumulation"), config["steps"]) == (2, steps), table
        rebuilt = M.Config(**{**config, "widths": tuple(config["widths"])})  # widths: a list in JSON
        assert rebuilt == M.Config(steps=steps, accumulation=2)
    assert ran["accuracy"] == M.Config(steps=1, accumulation=2) and ran["memory"][0].accumulation == 2


def test_memory_table_leaves_emulated_bf16_out_unless_asked(monkeypatch) -> None:
    """The rows and their recipes (the AMP rows run in test_runs_report_accuracy_memory_and_plain_training
    and, on this CPU or not, in test_config_and_cli)."""
    import workloads.meta_reweight_ablation as A

    monkeypatch.setattr(A, "bf16_emulated", lambda device: True)
    recipe = lambda name, step, ln, *a, **k: (name, None if step is reference_step else ln.recipe)  # noqa: E731
    monkeypatch.setattr(A, "run", recipe)
    base = [("reference (fp32, exact hypergradient)", None), ("baseline (fp32, DARTS kernel)", Recipe()),
            ("+ accumulation 2", Recipe(accumulation=2))]
    assert A.memory_ablation(SMALL, 2) == base
    assert A.memory_ablation(SMALL, 2, emulated_bf16=True) == [
        *base[:2], ("+ AMP", amp_recipe("cpu")), base[2], ("+ AMP + accumulation 2", amp_recipe("cpu", 2))]


def test_a_balanced_training_set_and_positive_step_sizes_are_checked() -> None:
    """imbalance 1 (n_0 = n_9) is a valid, balanced set; alpha and meta_lr must be > 0 as lr must."""
    assert M.class_counts(M.Config(imbalance=1.0)) == [490] * 10
    for name in ("meta_lr", "alpha"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            M.Config(**{name: 0.0})


def test_batches_cover_every_sample_once_an_epoch_in_a_new_order_each_epoch() -> None:
    """40 samples in batches of 20: both batches of an epoch, each sample once; the next epoch
    another order. 45 samples: the last 5 of each epoch are dropped, not a short batch."""
    x = torch.arange(40.0)
    stream = M.batches((x, x), 20, seed=0)
    epochs = [torch.cat([next(stream)[0] for _ in range(2)]) for _ in range(2)]
    assert all(torch.equal(e.sort().values, x) for e in epochs) and not torch.equal(*epochs)
    y = torch.arange(45.0)
    assert [len(next(M.batches((y, y), 20, seed=0))[0])] == [20]
    stream = M.batches((y, y), 20, seed=0)
    assert [len(set(next(stream)[0].tolist()) | set(next(stream)[0].tolist()))] == [40]


def test_meta_and_test_sets_are_their_own_balanced_sets() -> None:
    """meta_per_class and test_per_class each size their own set, and no image is in two sets."""
    cfg = replace(SMALL, meta_per_class=3, test_per_class=5)
    (x, _), (xm, ym), (xt, yt) = M.datasets(cfg)
    assert torch.bincount(ym).tolist() == [3] * 10 and torch.bincount(yt).tolist() == [5] * 10
    rows = torch.cat([x, xm, xt]).flatten(1)
    assert len(rows.unique(dim=0)) == len(rows)


def test_accumulation_must_divide_the_meta_batch_too() -> None:
    ln, (x, y) = M.learner(SMALL, recipe=Recipe(accumulation=3)), M.datasets(SMALL)[0]
    with pytest.raises(ValueError, match=r"accumulation 3 must divide the batch \(21\) and the meta batch \(20\)"):
        M.outer_step(ln, (x[:21], y[:21]), (x[:20], y[:20]), SMALL)


def test_the_hypergradient_runs_in_bf16_only_under_a_bf16_recipe(monkeypatch) -> None:
    """outer_step hands darts_hypergradient the recipe's bf16 (and fp32's None), W's step on what it returns."""
    seen = []

    def hypergradient(model, inner, outer, params, **kwargs):
        seen.append(kwargs["autocast_dtype"])
        return [torch.zeros_like(p) for p in params]

    monkeypatch.setattr(M, "darts_hypergradient", hypergradient)
    (x, y), (xm, ym), _ = M.datasets(SMALL)
    for recipe in (Recipe(torch.bfloat16), Recipe()):
        M.outer_step(M.learner(SMALL, recipe=recipe), (x[:20], y[:20]), (xm[:20], ym[:20]), SMALL)
    assert seen == [torch.bfloat16, None]


def test_a_skipped_inner_step_leaves_the_weighting_net_alone(monkeypatch) -> None:
    """fp16's GradScaler skipped the step (faked): theta did not move, so no hypergradient, no W step."""
    from kernels.training import train

    monkeypatch.setattr(M, "train", lambda *a, **k: replace(train(*a, **k), skipped_steps=1))
    monkeypatch.setattr(M, "darts_hypergradient", lambda *a, **k: pytest.fail("differentiated a skipped step"))
    ln = M.learner(SMALL)
    before = [p.detach().clone() for p in ln.weight_net.parameters()]
    (x, y), (xm, ym), _ = M.datasets(SMALL)
    M.outer_step(ln, (x[:20], y[:20]), (xm[:20], ym[:20]), SMALL)
    assert all(torch.equal(a, b) for a, b in zip(before, ln.weight_net.parameters(), strict=True))


class _AlwaysZero(torch.nn.Module):
    """Predicts class 0 for every input (2 classes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[1.0, 0.0]]).expand(len(x), 2)


def test_balanced_accuracy_is_the_mean_of_the_per_class_accuracies() -> None:
    """8 of class 0 (all right), 2 of class 1 (all wrong): 0.5, not 0.8; the model back in training mode."""
    model = _AlwaysZero()
    y = torch.tensor([0] * 8 + [1] * 2)
    assert M.balanced_accuracy(model, (torch.zeros(10, 3), y)) == 0.5
    assert model.training


def test_a_run_takes_warmup_then_its_steps(monkeypatch) -> None:
    """run(warmup=2) takes 2 + cfg.steps outer steps, each on a new batch, with the reweight flag given."""
    calls = []
    M.run("count", lambda ln, b, m, cfg, rw: calls.append((b[1].clone(), rw)), M.learner(SMALL), SMALL,
          reweight=False, warmup=2)
    assert len(calls) == 2 + SMALL.steps and not any(rw for _, rw in calls)
    assert not torch.equal(calls[0][0], calls[1][0])


def test_the_ablation_runs_each_memory_row_its_steps_and_the_accuracy_rows_with_and_without_reweighting(
        monkeypatch) -> None:
    import workloads.meta_reweight_ablation as A

    ran = []
    monkeypatch.setattr(A, "run", lambda name, step, ln, cfg, rw=True, **kw: ran.append((name, cfg.steps, rw, kw)))
    A.memory_ablation(SMALL, 2, steps=7)
    assert ran and all(steps == 7 and kw == {"warmup": 2, "measure_peak": True} for _, steps, _, kw in ran)
    ran.clear()
    A.accuracy_runs(SMALL, Recipe())
    sides = [(name.rsplit(", ", 1)[1], rw) for name, _, rw, _ in ran]
    assert sides == [("reweighted", True), ("plain CE", False)] * 2
    assert all(steps == SMALL.steps for _, steps, _, _ in ran)


def test_the_memory_table_saves_against_the_baseline_row(tmp_path, monkeypatch, capsys) -> None:
    """'saved vs baseline' is 1 - peak / the baseline's peak (row 2: the DARTS kernel in fp32), not the
    reference's (row 1): 2.0, 1.0, 0.5 MiB read -100.0%, 0.0%, 50.0% (the runs faked)."""
    peaks = [2.0, 1.0, 0.5]
    monkeypatch.setattr(meta_reweight_cli, "optimized_recipe", lambda cfg, *args: Recipe())
    monkeypatch.setattr(meta_reweight_cli, "accuracy_runs", lambda cfg, recipe: [M.RunReport("r", 1.0, 0.5)])
    monkeypatch.setattr(meta_reweight_cli, "memory_ablation",
                        lambda cfg, **kw: [M.RunReport(f"row {i}", 1.0, 0.5, p) for i, p in enumerate(peaks)])
    assert meta_reweight_cli.main(["--steps", "1", "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "meta_reweight_memory.json").read_text())["rows"]
    assert [r["saved vs baseline"] for r in rows] == ["-100.0%", "0.0%", "50.0%"]
