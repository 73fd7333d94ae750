"""The OCS workload: data, memory, loss, and the claim that the fp32 reference and the
optimized run select the same samples and end within 0.5 points of average accuracy."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kernels.training import Recipe
from workloads import ocs
from workloads.cli.ocs import main
from workloads.ocs import REFERENCE
from workloads.rotated_digits import digits, mnist, rotated_tasks


@pytest.fixture(scope="module")
def tasks() -> list:
    return rotated_tasks(digits(), 3)


def test_rotated_digits(tasks: list) -> None:
    (x_train, y_train), (x_test, y_test) = digits()
    assert x_train.shape == (1437, 1, 28, 28) and x_test.shape == (360, 1, 28, 28)
    assert 0 <= x_train.min() and x_train.max() <= 1 and set(y_train.tolist()) == set(range(10))
    (t1, _), (t2, _), (t3, _) = tasks
    assert t1[0].shape == (1437, 784) and torch.equal(t1[0], x_train.flatten(1))  # task 1: unrotated
    assert torch.equal(t2[1], y_train) and not torch.allclose(t2[0], t1[0])  # rotated, same labels
    # rotation keeps the ink roughly (nearest neighbour, corners filled with 0), 18 degrees more than 9
    assert (t2[0].sum() / t1[0].sum() - 1).abs() < 0.05
    assert (t3[0] - t1[0]).abs().mean() > (t2[0] - t1[0]).abs().mean()
    with pytest.raises(ValueError, match="tasks must be"):
        rotated_tasks(digits(), 0)


def test_mnist_is_never_downloaded(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloads"):
        mnist(str(tmp_path))


def test_balanced_takes_quota_per_class_then_the_best_of_the_rest() -> None:
    labels = torch.tensor([0, 0, 0, 1, 2, 0, 1])
    order = torch.arange(7)
    assert ocs.balanced(order, labels, 6, 3).tolist() == [0, 1, 3, 4, 6, 2]  # 2 per class, then best
    assert ocs.balanced(order.flip(0), labels, 3, 3).tolist() == [6, 5, 4]


def test_replay_loss_weights_the_memory_rows() -> None:
    out, y = torch.randn(7, 4), torch.randint(0, 4, (7,))
    loss = ocs.ReplayLoss(3, 10.0)
    want = F.cross_entropy(out[:3], y[:3]) + 10 * F.cross_entropy(out[3:], y[3:])
    torch.testing.assert_close(loss(out, y), want)
    torch.testing.assert_close(loss(out[:3], y[:3]), F.cross_entropy(out[:3], y[:3]))  # task 1: no replay


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="select"):
        ocs.Config(stream=10, select=20)
    with pytest.raises(ValueError, match=r"select \(10\) must be under stream \(10\)"):
        ocs.Config(stream=10, select=10)  # every stream batch would be skipped
    with pytest.raises(ValueError, match="passes must be"):
        ocs.Config(passes=0)


def test_fp32_runs_select_the_same_samples_and_agree_on_accuracy(tasks: list) -> None:
    cfg = ocs.Config(tasks=3, passes=1)
    ref = ocs.run(REFERENCE, cfg, tasks)
    opt = ocs.run(ocs.optimized(Recipe()), cfg, tasks)
    assert len(ref.selected) == len(opt.selected) == 3 * 15  # 14 batches of 100 and one of 37 a pass
    assert all(torch.equal(a, b) for a, b in zip(ref.selected, opt.selected, strict=True))
    assert torch.equal(ref.params, opt.params)  # same selections, same fp32 arithmetic: bit-identical
    assert abs(ref.average_accuracy - opt.average_accuracy) <= 0.005
    assert [len(r) for r in opt.accuracy] == [1, 2, 3]
    # each step picks 10 of its stream batch (rows 100 b .. 100 b + 99, b = step mod 15), not its first 10
    for step, s in enumerate(opt.selected):
        start = 100 * (step % 15)
        assert len(s) == 10 and bool(((s >= start) & (s < start + 100)).all())
    assert sum(not torch.equal(s, torch.arange(100 * (i % 15), 100 * (i % 15) + 10))
               for i, s in enumerate(opt.selected)) > 40


def test_memory_is_split_across_tasks(tasks: list) -> None:
    cfg = ocs.Config(tasks=3, passes=1, memory=30)
    learner = ocs.start(cfg, "memory")
    for t in range(1, 4):
        ocs.train_task(learner, t, tasks, cfg, ocs.optimized(Recipe()))
        assert sorted(learner.coreset) == list(range(1, t + 1))
        assert all(len(y) == 30 // t for _, y in learner.coreset.values())
    x3, y3 = learner.coreset[3]
    train_x, train_y = tasks[2][0]
    rows = (x3[:, None, :] == train_x[None]).all(-1).nonzero()  # slot 3 holds task 3's images
    assert len(rows) >= len(y3) and torch.equal(train_y[rows[:, 1]].unique(), y3.unique())


def test_replay_batches_come_from_one_slot_each() -> None:
    coreset = {1: (torch.zeros(25, 3), torch.zeros(25, dtype=torch.int64)),
               2: (torch.ones(12, 3), torch.ones(12, dtype=torch.int64))}
    batches = ocs._replay_batches(coreset, 10, torch.Generator().manual_seed(0))
    assert sorted(len(y) for _, y in batches) == [2, 5, 10, 10, 10]
    assert all(len(y.unique()) == 1 for _, y in batches)  # never mixed across tasks
    assert sum(len(y) for _, y in batches) == 37


def test_report_metrics() -> None:
    r = ocs.OCSReport("r", accuracy=[[0.9], [0.7, 0.8], [0.8, 0.6, 0.5]])
    assert r.average_accuracy == pytest.approx((0.8 + 0.6 + 0.5) / 3)
    assert r.forgetting == pytest.approx(((0.9 - 0.8) + (0.8 - 0.6)) / 2)  # best earlier minus now
    assert ocs.OCSReport("one", accuracy=[[0.5]]).forgetting == 0.0


def test_cli_and_ablation_rows(capsys, tmp_path) -> None:
    assert main(["--tasks", "1", "--passes", "1", "--ablation", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "ocs.json").read_text())
    assert len(record["rows"]) == 5 and all(len(v) == 1 for v in record["curves"].popitem()[1].values())
    for row in ("reference (loop scores, fp32)", "vmap (materialized E)", "einsum (materialized E)",
                "ghost Gram |", "ghost Gram + AMP"):
        assert f"| {row}" in out, row
    assert "selected the same samples at every step" in out
    with pytest.raises(SystemExit):
        main(["--tasks", "0"])


def test_the_results_json_config_holds_mnist(tmp_path, monkeypatch) -> None:
    """--mnist is in the JSON's config: the Config rebuilt from the file is the one the options
    made, so a run reproduced from it reads the same data (here MNIST's loader and the runs are
    faked: the options and the file are what this checks)."""
    import workloads.cli.ocs as ocs_cli

    def run(method: ocs.Method, cfg: ocs.Config, tasks: list) -> ocs.OCSReport:
        return ocs.OCSReport(method.name, [[0.5]], [1.0], [], [None], torch.zeros(3))

    split = (torch.zeros(20, 1, 28, 28), torch.zeros(20, dtype=torch.int64))
    monkeypatch.setattr(ocs_cli, "mnist", lambda root: (split, split))
    monkeypatch.setattr(ocs_cli, "optimized_recipe", lambda cfg, tasks: Recipe())
    monkeypatch.setattr(ocs_cli, "run", run)
    root = str(tmp_path / "mnist")
    assert main(["--tasks", "1", "--passes", "1", "--mnist", root, "--output-dir", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "ocs.json").read_text())["config"]
    assert config.get("mnist") == root
    assert ocs.Config(**config) == ocs.Config(tasks=1, passes=1, mnist=root)


def test_the_mlp_has_relu_after_each_hidden_layer_and_one_dropout() -> None:
    """Linear + ReLU per hidden layer, logits left linear, dropout after the first hidden layer only."""
    from kernels.models import MLP

    kinds = [type(m).__name__ for m in MLP((4, 8, 8, 8, 3), dropout=0.5).net]
    assert kinds == ["Linear", "ReLU", "Dropout", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [type(m).__name__ for m in MLP((4, 3)).net] == ["Linear"]


def test_each_task_steps_at_its_decayed_lr_with_momentum(tasks: list) -> None:
    """Task t's fresh optimizer: lr 0.005 x 0.75^(t - 1), momentum 0.8 (training faked: the
    stream is read, no step taken)."""
    from dataclasses import replace

    made = []

    def optimizer(params, **kwargs):
        made.append(kwargs)
        return torch.optim.SGD(params, **kwargs)

    def read_only(model, loss_fn, opt, steps, recipe, device):
        for _ in steps:
            pass

    method = replace(ocs.optimized(Recipe()), optimizer_fn=optimizer, train_fn=read_only)
    ocs.run(method, ocs.Config(tasks=3, passes=1), tasks)
    assert [k["lr"] for k in made] == pytest.approx([0.005, 0.005 * 0.75, 0.005 * 0.75**2])
    assert all(k["momentum"] == 0.8 for k in made)


def _random_scores(model, loss_fn, x, y, *, memory, tau) -> torch.Tensor:
    return torch.rand(len(y))


def _stream(n: int, cfg: ocs.Config, coreset: dict | None = None) -> tuple[list, ocs.OCSReport, list]:
    """Every batch ``ocs._steps`` yields over ``n`` rows labelled by their index, with random scores."""
    torch.manual_seed(0)
    report, last = ocs.OCSReport("stream"), []
    data = (torch.randn(n, 784), torch.arange(n))
    out = list(ocs._steps(ocs.MLP(), data, coreset or {}, cfg, _random_scores, torch.Generator().manual_seed(0),
                          report, last))
    return out, report, last


def test_the_memory_candidates_are_the_last_passs_picks() -> None:
    cfg = ocs.Config(passes=2)
    steps, report, last = _stream(300, cfg)
    assert len(steps) == 6 and len(last) == 3
    assert all(torch.equal(a, b) for a, b in zip(last, report.selected[3:], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(last, report.selected[:3], strict=True))


def test_a_stream_batch_of_at_most_select_samples_is_skipped() -> None:
    """110 rows in stream batches of 100: the last batch, 10 = select rows, is not trained."""
    steps, _, _ = _stream(110, ocs.Config(passes=1))
    assert len(steps) == 1 and bool((steps[0][1] < 100).all())


def test_consecutive_steps_replay_consecutive_memory_batches() -> None:
    """A memory of 30 (3 replay batches of 10): 3 steps replay all 30, each sample once."""
    memory = (torch.randn(30, 784), 1000 + torch.arange(30))
    steps, _, _ = _stream(300, ocs.Config(passes=1), {1: memory})
    replayed = torch.cat([y[10:] for _, y in steps])
    assert len(replayed) == 30 and torch.equal(replayed.sort().values, memory[1])


def test_accuracy_is_measured_with_dropout_off() -> None:
    model, y = torch.nn.Dropout(p=1.0), torch.arange(10).repeat(3)
    assert ocs.accuracy(model.train(), (F.one_hot(y).float(), y)) == 1.0


def test_scores_are_computed_in_eval_mode_and_training_resumes_in_train_mode() -> None:
    modes = []
    model = ocs.MLP(dropout=0.2).train()
    ocs._score(lambda m, *a, **k: modes.append(m.training) or torch.zeros(2), model, torch.zeros(2, 784),
               torch.zeros(2, dtype=torch.int64), None, 1.0)
    assert modes == [False] and model.training


def test_the_peak_is_the_largest_tasks() -> None:
    assert ocs.OCSReport("r", peak_bytes=[2**20, 3 * 2**20, None]).peak_mib == 3.0
    assert ocs.OCSReport("r", peak_bytes=[None]).peak_mib is None


def test_the_ablation_table_gives_each_rows_speedup_over_the_reference() -> None:
    from workloads.ocs_ablation import HEADER, table

    rows = [ocs.OCSReport(name, [[0.5, 0.7]], seconds, peak_bytes=[2**21])
            for name, seconds in (("ref", [4.0, 2.0]), ("fast", [1.0, 2.0]))]
    cells = table(rows)
    assert [dict(zip(HEADER, c, strict=True))["s/task"] for c in cells] == ["3.00", "1.50"]
    assert [c[HEADER.index("speedup")] for c in cells] == ["1.00x", "2.00x"]
    assert cells[1][HEADER.index("avg accuracy")] == "60.0%" and cells[1][HEADER.index("peak MiB")] == "2"


def test_the_test_split_keeps_each_images_label_and_shares_no_image_with_training() -> None:
    """digits()'s 80/20 split against every image in scikit-learn's order and scikit-learn's own
    targets: every label is its image's, and no image is in both splits."""
    from sklearn.datasets import load_digits

    from workloads.rotated_digits import all_digits

    d, (x, _) = load_digits(), all_digits()
    index = {x[i].numpy().tobytes(): i for i in range(len(x))}  # scikit-learn's 1797 images are distinct
    (x_train, y_train), (x_test, y_test) = digits()
    train_at = [index[im.numpy().tobytes()] for im in x_train]
    test_at = [index[im.numpy().tobytes()] for im in x_test]
    assert y_test.tolist() == d.target[test_at].tolist() and y_train.tolist() == d.target[train_at].tolist()
    assert not set(train_at) & set(test_at) and len(set(train_at) | set(test_at)) == 1797


def test_a_task_with_no_stream_batch_over_select_is_refused_by_name() -> None:
    """A training split of select rows or fewer leaves no batch to select from: a ValueError saying
    so, not torch.cat's error on an empty memory update."""
    with pytest.raises(ValueError, match="no stream batch more than select"):
        _stream(10, ocs.Config(passes=1))
