"""What every workload CLI shares: --output-dir's files (workloads/output.py), --device checked
before any work, and each CLI runnable as ``python -m``."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import dataclass
from importlib import import_module

import pytest

from workloads.output import write_results

CLIS = ["cifar_resnet", "meta_reweight", "ocs", "spectral_probe", "vit_rope"]


@dataclass(frozen=True)
class _Cfg:
    steps: int = 3
    device: str = "cpu"


def test_write_results_gives_csv_json_and_png(tmp_path) -> None:
    header, cells = ["run", "ms/step", "speedup"], [["reference", "12.0", "1.00x"], ["optimized", "4.0", "3.00x"]]
    curves = {"training loss per step": {"reference": [2.3, 2.1, 1.9], "optimized": [2.3, 2.0, 1.8]}}
    paths = write_results(tmp_path / "out", "demo", header, cells, config=_Cfg(), device="cpu",
                          time_column="ms/step", curves=curves)
    assert [p.name for p in paths] == ["demo.csv", "demo.json", "demo.png"]
    record = json.loads(paths[1].read_text())
    on = f"cpu ({record['machine']['device_name']}), {record['machine']['threads']} threads"
    assert [row[:-1] for row in csv.reader(paths[0].open())] == [header, *cells]
    assert [row[-1].split(", torch")[0] for row in csv.reader(paths[0].open())] == ["machine", on, on]
    assert record["rows"][1] == {"run": "optimized", "ms/step": "4.0", "speedup": "3.00x"}
    assert record["config"] == {"steps": 3, "device": "cpu"} and record["curves"] == curves
    assert record["machine"]["device_type"] == "cpu" and record["machine"]["threads"] >= 1
    assert record["machine"]["malloc"] == "default"
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 10_000
    with pytest.raises(ValueError, match="time_column 'ms' is not a column"):
        write_results(tmp_path, "demo", header, cells, config=_Cfg(), device="cpu", time_column="ms")


def test_an_interrupted_write_leaves_the_previous_run_whole(tmp_path, monkeypatch) -> None:
    """The three files are written under temporary names and renamed over the previous run's: a run
    stopped while drawing its PNG leaves the earlier set as it was (its CSV beside the earlier
    JSON, before), and no temporary file. The PNG's title names the machine, as the JSON does."""
    import workloads.output as output

    header = ["run", "ms/step"]
    write_results(tmp_path, "demo", header, [["run B", "20.0"]], config=_Cfg(), device="cpu",
                  time_column="ms/step")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    titles = []

    def stopped(path, title, *args):
        titles.append(title)
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "_plot", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_results(tmp_path, "demo", header, [["run C", "30.0"]], config=_Cfg(), device="cpu",
                      time_column="ms/step")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert titles[0].startswith("demo\ncpu (") and "threads, torch" in titles[0]


def test_the_png_shows_where_the_time_went_and_the_accuracy_kept(tmp_path) -> None:
    """Time in parts (stacked) and a metric column (its own panel); a column that is not in the
    table is refused by name."""
    header = ["run", "features s", "train s", "test accuracy"]
    cells = [["reference (sklearn, fp32 features)", "6.0", "1.0", "93.1%"], ["optimized", "1.0", "0.9", "93.4%"]]
    png = write_results(tmp_path, "probe", header, cells, config=_Cfg(), device="cpu",
                        time_column=["features s", "train s"], metric_column="test accuracy")[2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="metric_column 'accuracy' is not a column"):
        write_results(tmp_path, "probe", header, cells, config=_Cfg(), device="cpu", time_column="train s",
                      metric_column="accuracy")
    with pytest.raises(ValueError, match="time_column 'total s' is not a column"):
        write_results(tmp_path, "probe", header, cells, config=_Cfg(), device="cpu",
                      time_column=["features s", "total s"])


@pytest.mark.parametrize("cli", CLIS)
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:99"])
def test_a_bad_device_is_a_one_line_usage_error(cli: str, device: str, capsys) -> None:
    main = import_module(f"workloads.cli.{cli}").main
    with pytest.raises(SystemExit) as exc:
        main(["--device", device])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: device" in err and "cpu" in err, err


@pytest.mark.parametrize("cli", CLIS)
def test_every_cli_runs_as_a_module(cli: str) -> None:
    proc = subprocess.run([sys.executable, "-m", f"workloads.cli.{cli}", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"python -m workloads.cli.{cli}" in proc.stdout and "--output-dir" in proc.stdout


@pytest.mark.parametrize("cli", CLIS)
def test_an_output_dir_that_cannot_be_made_fails_before_the_run(cli: str, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        import_module(f"workloads.cli.{cli}").main(["--output-dir", str(tmp_path / "file" / "out")])
    assert exc.value.code == 2 and "error: --output-dir" in capsys.readouterr().err


@pytest.mark.parametrize(("cli", "argv", "message"), [
    ("vit_rope", ["--cifar", "/nonexistent"], "no CIFAR-10 files under '/nonexistent'"),
    ("ocs", ["--mnist", "/nonexistent"], "no MNIST files under '/nonexistent'"),
    ("meta_reweight", ["--accumulation", "0"], "accumulation must be an int in [1, batch=100], got 0"),
    ("meta_reweight", ["--accumulation", "3"], "accumulation 3 must divide the batch (100)"),
    ("spectral_probe", ["--dim", "4"], "dim (4) must be >= rank (8)"),  # a traceback from the data before
])
def test_bad_data_paths_and_sizes_are_one_line_errors(cli: str, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        import_module(f"workloads.cli.{cli}").main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_median_step_ms_times_only_the_steps_after_warmup_in_milliseconds(monkeypatch) -> None:
    """A fake clock: 2 warm-up steps of 100 s, then steps of 1, 3 and 2 ms: the median of all three
    timed ones, 2 ms (not the middle call's, not over the last two, not in seconds)."""
    import workloads.common as common

    durations = iter([100.0, 100.0, 1e-3, 3e-3, 2e-3])
    clock = [0.0]

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return clock[0]

    def step() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(common, "time", FakeTime)
    assert common.median_step_ms([step] * 5, 2, "cpu") == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no timed step: the calls must outnumber warmup=2"):
        common.median_step_ms([lambda: None] * 2, 2, "cpu")


def test_a_cuda_index_past_the_last_device_is_refused(monkeypatch) -> None:
    """On a machine with one CUDA device (faked), cuda:0 is accepted and cuda:1 refused by name."""
    import torch

    from workloads.common import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda:0")
    check_device("cuda")
    with pytest.raises(ValueError, match=r"has 1 CUDA device\(s\), cuda:0 to cuda:0"):
        check_device("cuda:1")


def test_the_amp_recipe_is_fp16_with_a_scaler_on_cuda_and_bf16_on_cpu_at_its_accumulation() -> None:
    import torch

    from kernels.training import Recipe
    from workloads.common import amp_recipe

    assert amp_recipe("cuda:0", 3) == Recipe(torch.float16, grad_scaler=True, accumulation=3)
    assert amp_recipe("cpu", 3) == Recipe(torch.bfloat16, accumulation=3)
    assert amp_recipe("cpu") == Recipe(torch.bfloat16)


def test_a_markdown_table_has_one_separator_cell_per_column() -> None:
    from workloads.common import markdown

    assert markdown(["a", "b", "c"], [["1", "2", "3"]]) == ["| a | b | c |", "|---|---|---|", "| 1 | 2 | 3 |"]


def test_table_cells_are_read_as_numbers_for_the_png() -> None:
    """Times, speedups and percentages plot as their numbers; '-' (no measure) as NaN."""
    import math

    from workloads.output import _number

    assert (_number("12.5"), _number("4.50x"), _number("81.0%")) == (12.5, 4.5, 81.0)
    assert math.isnan(_number("-"))


def test_rows_and_labels_must_match_the_header(tmp_path) -> None:
    """A label per row, a cell per column: a mismatch is refused, not written as a shorter row."""
    header, cells = ["run", "ms/step"], [["a", "1.0"], ["b", "2.0"]]
    with pytest.raises(ValueError, match=r"names must give one label per row of cells \(2\), got 1"):
        write_results(tmp_path, "demo", header, cells, config=_Cfg(), device="cpu", time_column="ms/step",
                      names=["a"])
    with pytest.raises(ValueError):
        write_results(tmp_path, "demo", header, [["a", "1.0"], ["b"]], config=_Cfg(), device="cpu",
                      time_column="ms/step")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left


def test_the_output_dir_is_made_with_its_missing_parents(tmp_path) -> None:
    paths = write_results(tmp_path / "a" / "b", "demo", ["run", "ms/step"], [["a", "1.0"]], config=_Cfg(),
                          device="cpu", time_column="ms/step")
    assert all(p.is_file() and p.parent == tmp_path / "a" / "b" for p in paths)
