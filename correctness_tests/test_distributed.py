"""Data parallel on torch.distributed (kernels/distributed.py): 2 CPU processes (gloo, loopback)
at batch b end where 1 process at batch 2b ends, to fp32 rounding, for plain steps, gradient
accumulation, a DistributedSampler pipeline and the Meta-Weight-Net hypergradient; one gradient
all-reduce per optimizer step; rank 0's checkpoint loads into one process; a rank that raises
ends the run without a hung rank. Launched with torchrun, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from correctness_tests.ddp_cases import ALL_REDUCES, CASES
from correctness_tests.tolerances import REDUCTION, assert_close, assert_dicts_close
from kernels.distributed import DataParallel, all_mean_, process_group, shard
from kernels.feature_cache import read_safetensors

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "correctness_tests" / "ddp_worker.py"


def torchrun(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    run = torchrun(out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def _params(path: Path) -> dict[str, torch.Tensor]:
    tensors, _ = read_safetensors(path)
    return {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc/self/task (Linux)")
def test_leaving_the_group_ends_its_threads(two_ranks: Path) -> None:
    """After DDP training, leaving process_group and freeing the models frees the group and its gloo
    threads: left pinned by torch.distributed.nn.functional's defaults, they abort about 1 exit
    in 40."""
    for r in (0, 1):
        counts = json.loads((two_ranks / f"threads{r}.json").read_text())
        assert counts["after"] == counts["before"], counts


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_at_batch_b_equal_one_at_batch_2b(two_ranks: Path, case: str) -> None:
    torch.set_num_threads(1)  # as the ranks ran: same kernels, same rounding order within a rank
    model, result, _ = CASES[case](None)
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    saved = _params(two_ranks / f"{case}.safetensors")  # the file stores names sorted
    assert_dicts_close({k: saved[k] for k in expected}, expected, REDUCTION)
    for r in (0, 1):  # every rank reports the global batch's loss
        losses = json.loads((two_ranks / f"rank{r}.json").read_text())[case]["losses"]
        assert_close(torch.tensor(losses), torch.tensor(result.losses), REDUCTION)


@pytest.mark.parametrize("case", list(CASES))
def test_one_gradient_all_reduce_per_optimizer_step(two_ranks: Path, case: str) -> None:
    """Under accumulation the window's other micro-batches run under no_sync: without it DDP would
    all-reduce 5 times in the accumulation case (2 full windows and a trailing one, whose
    gradients the engine all-reduces once at the end; the equality test holds that it does)."""
    for r in (0, 1):
        assert json.loads((two_ranks / f"rank{r}.json").read_text())[case]["all_reduces"] == ALL_REDUCES[case]


def test_rank_0s_checkpoint_resumes_every_rank(two_ranks: Path) -> None:
    """load_checkpoint of rank 0's file into a fresh DDP-wrapped model on each rank gives back the
    replica that rank holds (the file's names are the unwrapped module's)."""
    for r in (0, 1):
        assert json.loads((two_ranks / f"rank{r}.json").read_text())["reloaded_equal"] is True


def test_a_failing_rank_ends_the_run_without_hanging(tmp_path: Path) -> None:
    """Rank 1 raises in its second step while rank 0 waits in that step's all-reduce: the run ends
    in seconds (the group's timeout is 120 s), not when a collective times out."""
    start = time.monotonic()
    run = torchrun(tmp_path, "fail", timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "rank 1 failed on purpose in its second step" in output and "RecursionError" not in output
    # rank 0 was in the all-reduce: its connection to rank 1 closed, or torchrun stopped it first
    assert "Connection closed by peer" in output or "SIGTERM" in output
    assert time.monotonic() - start < 60, "the surviving rank waited for the failed one"


def test_unequal_shares_of_the_ranks_are_refused_on_every_rank(two_ranks: Path) -> None:
    """6 and 2 samples of a global batch of 8: DDP averages the ranks' mean losses, so each of the 2
    would weigh 3x (1.271 for one process's 1.337, silently); every rank refuses the step alike."""
    for r in (0, 1):
        said = (two_ranks / f"uneven{r}.txt").read_text()
        assert "the ranks' batches differ in size at optimizer step 1" in said


def test_equal_shares_whose_micro_batches_differ_are_refused_on_every_rank(two_ranks: Path) -> None:
    """4 samples a rank, as micro-batches of 3 + 1 and 1 + 3: each rank weighs its micro-batches by
    its own first one's size, so DDP's mean would weigh rank 1's samples 3x rank 0's (1/4 and 1/12
    for 1/8 each); the sizes' squares tell the step apart from equal shares, and every rank refuses it."""
    for r in (0, 1):
        said = (two_ranks / f"skewed{r}.txt").read_text()
        assert "the ranks' batches differ in size at optimizer step 1" in said


def test_a_loss_parameter_one_rank_leaves_without_gradient_is_stepped_alike(two_ranks: Path) -> None:
    """Rank 1's batch never reaches the loss module's temperature (its .grad stays None): the step
    all-reduces a zero in its place, so both ranks step it on the ranks' mean gradient, equally."""
    t0, t1 = (float((two_ranks / f"temperature{r}.txt").read_text()) for r in (0, 1))
    assert t0 == t1 != 0.0


def test_a_checkpoint_rank_0_cannot_write_fails_every_rank(two_ranks: Path) -> None:
    """The run's last step (the module's run ended without a hung rank: two_ranks)."""
    assert "No such file or directory" in (two_ranks / "unwritable0.txt").read_text()
    assert "rank 0 could not write the checkpoint" in (two_ranks / "unwritable1.txt").read_text()


def test_process_group_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"), process_group():
        pass


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "tpu"}, r"device \(each rank takes cuda:LOCAL_RANK\) must be one of \('cpu', 'cuda'\)"),
    ({"device": "cpu", "backend": "mpi"}, "backend must be one of"),
    ({"device": "cpu", "backend": "nccl"}, "backend='nccl' needs device='cuda'"),
    ({"device": "cpu", "timeout_s": 0}, "timeout_s must be a finite number > 0"),
])
def test_process_group_refuses_bad_arguments(monkeypatch: pytest.MonkeyPatch, kwargs: dict, message: str) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message), process_group(**kwargs):
        pass


def test_bad_input_is_refused() -> None:
    dp = DataParallel(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="sync_batchnorm=True needs CUDA"):
        dp.wrap(nn.BatchNorm1d(3), sync_batchnorm=True)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        dp.wrap("model")
    with pytest.raises(ValueError, match="first dimension divisible by the world size"):
        shard(torch.tensor(1.0))
    # refused before anything is averaged: a float tensor went first, in place, then torch refused the int one
    with pytest.raises(TypeError, match=r"tensors\[1\] is a torch.int64 tensor"):
        all_mean_([torch.zeros(2), torch.zeros(2, dtype=torch.long)])
    with pytest.raises(TypeError, match=r"tensors\[0\] is a torch.float32 tensor that requires grad"):
        all_mean_([nn.Parameter(torch.zeros(2))])
    import numpy as np

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = dp.sampler(data, seed=np.int64(3))  # kept as the int it was checked as (iterating it raised)
    assert type(sampler.seed) is int and sorted(sampler) == list(range(8))


def test_data_parallel_cli_measures_both_process_counts(tmp_path: Path) -> None:
    """The measuring CLI end to end at a tiny size: a 1-process row and a torchrun row, written out."""
    run = subprocess.run([sys.executable, "-m", "workloads.cli.data_parallel", "--workloads", "cifar_resnet",
                          "--batch", "8", "--steps", "1", "--repeats", "1", "--output-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "data_parallel.json").read_text())["rows"]
    assert [(r["processes"], r["batch/process"]) for r in rows] == [("1", "8"), ("2", "4")]
    assert all(float(r["ms/step (slowest rank)"]) > 0 for r in rows)


@pytest.mark.parametrize(("args", "message"), [
    (["--processes", "3"], "each dividing the global batch"),
    (["--repeats", "0"], "--repeats >= 1"),
    (["--processes", "one"], "comma-separated integers"),
    (["--workloads", "resnet"], "unknown ['resnet']"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--batch", "-4"], "--batch must be >= 1, got -4"),
    (["--device", "bogus"], "device must be cpu, cuda or cuda:N"),
    # the workload's own refusal, before any process is launched (a worker's traceback before)
    (["--workloads", "meta_reweight", "--processes", "1", "--batch", "200"],
     "--batch 200 for meta_reweight: a batch of 200 needs max_per_class"),
])
def test_data_parallel_cli_refuses_bad_arguments(args: list[str], message: str, capsys) -> None:
    from workloads.cli.data_parallel import main

    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err


def test_data_parallel_plot_names_each_process_count(tmp_path: Path, monkeypatch) -> None:
    """The PNG's bars (Agg, read back before the figure closes) say which process count each run
    is: the table's first column alone, the workload, named both alike (runs faked, no launch)."""
    import matplotlib.pyplot as plt

    from workloads import data_parallel
    from workloads.cli import data_parallel as cli

    def launch(args, name: str, processes: int, row_file: Path) -> data_parallel.Row:
        return data_parallel.Row(name, processes, 1, 8, 10.0 * processes, 50.0 / processes)

    figures, close = [], plt.close
    monkeypatch.setattr(cli, "launch", launch)
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    assert cli.main(["--workloads", "cifar_resnet", "--batch", "8", "--repeats", "1",
                     "--output-dir", str(tmp_path)]) == 0
    (bars,) = [ax for ax in figures[0].axes if ax.get_visible()]
    labels = [t.get_text() for t in bars.get_yticklabels()]
    assert labels == ["cifar_resnet, 1 process", "cifar_resnet, 2 processes"]
    rows = json.loads((tmp_path / "data_parallel.json").read_text())["rows"]
    assert [r["workload"] for r in rows] == ["cifar_resnet"] * 2  # the table keeps its columns


@pytest.fixture
def rank_1_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 1 of 2 (no group: the collective, where one runs, is faked by the test)."""
    import kernels.distributed as kd

    monkeypatch.setattr(kd, "rank", lambda: 1)
    monkeypatch.setattr(kd, "world_size", lambda: 2)
    monkeypatch.setattr(kd, "active", lambda: True)


@pytest.mark.usefixtures("rank_1_of_2")
def test_shard_takes_this_ranks_stride_and_refuses_an_uneven_batch() -> None:
    """Rank r of W takes rows r, r + W, ... (DistributedSampler's order), not a contiguous block."""
    assert torch.equal(shard(torch.arange(6)), torch.tensor([1, 3, 5]))
    with pytest.raises(ValueError, match="first dimension divisible by the world size 2"):
        shard(torch.arange(3))


@pytest.mark.usefixtures("rank_1_of_2")
def test_all_mean_averages_every_tensor_of_every_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other rank holds ones: each tensor becomes (t + 1) / 2 in place, float32 and float64 alike,
    whatever order the dtypes come in."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op: t.add_(1))
    tensors = [torch.arange(3.0), torch.arange(4, dtype=torch.float64).reshape(2, 2), torch.full((2,), 5.0)]
    want = [(t + 1) / 2 for t in tensors]
    out = all_mean_(tensors)
    assert out is tensors and all(torch.equal(t, w) for t, w in zip(out, want, strict=True))


@pytest.mark.usefixtures("rank_1_of_2")
def test_agree_is_true_only_where_every_rank_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other rank's flag is reduced with this one's by MIN: one rank's False is every rank's."""
    from kernels.distributed import agree

    other = {"flag": 0}

    def all_reduce(t: torch.Tensor, op) -> None:  # the other rank holds other["flag"]
        t.copy_(torch.minimum(t, torch.tensor([other["flag"]])) if op == torch.distributed.ReduceOp.MIN
                else torch.maximum(t, torch.tensor([other["flag"]])))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    assert agree(True) is False and agree(False) is False
    other["flag"] = 1
    assert agree(True) is True and agree(False) is False


def test_the_sampler_takes_this_ranks_share_with_the_seed_given() -> None:
    """DistributedSampler with this process's rank and group size, and the seed asked for: two
    seeds shuffle differently, one seed alike on every call."""
    data = torch.utils.data.TensorDataset(torch.arange(20))
    dp = DataParallel(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    one, again, other = (dp.sampler(data, seed=s) for s in (5, 5, 6))
    assert (one.rank, one.num_replicas, one.seed) == (1, 2, 5) and len(list(one)) == 10
    assert list(one) == list(again) and list(one) != list(other)


def test_a_row_summarizes_repeated_runs_by_their_median_and_range() -> None:
    from workloads.data_parallel import HEADER, Row, summary

    runs = [Row("cifar_resnet", 2, 1, 8, ms, peak) for ms, peak in ((30.0, 5.0), (10.0, None), (20.0, 7.0))]
    cells = dict(zip(HEADER, summary(runs), strict=True))
    assert (cells["ms/step (slowest rank)"], cells["ms/step range"]) == ("20.0", "10.0-30.0")
    assert (cells["runs"], cells["batch/process"], cells["peak MiB/process (largest)"]) == ("3", "4", "6")


def test_measure_reduces_the_ranks_to_the_slowest_and_largest_and_refuses_an_uneven_batch(monkeypatch) -> None:
    """Rank 0 of 2 (the all-reduce faked, the other rank's numbers 7 ms and no peak): MAX of each; a
    peak no rank measured stays None; a global batch of 3 is refused before any measuring."""
    import torch.distributed as dist

    from workloads import data_parallel

    ops = []

    def all_reduce(t, op):
        ops.append(op)
        t.copy_(torch.maximum(t, torch.tensor([7.0, -1.0], dtype=t.dtype)))

    measured = []
    monkeypatch.setattr(data_parallel.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(data_parallel, "MEASURES", {"cifar_resnet": lambda *a: measured.append(a) or (5.0, None)})
    dp = DataParallel(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    row = data_parallel.measure("cifar_resnet", 8, 1, "cpu", dp)
    assert ops == [dist.ReduceOp.MAX] and (row.processes, row.ms_per_step, row.peak_mib) == (2, 7.0, None)
    with pytest.raises(ValueError, match="global batch 3 must be a multiple of the 2 processes"):
        data_parallel.measure("cifar_resnet", 3, 1, "cpu", dp)
    assert len(measured) == 1
