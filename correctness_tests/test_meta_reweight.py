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
