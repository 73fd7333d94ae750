"""--perf-against REV on a scratch git repository whose library sleeps: a row this tree made slower
fails and is named, one made faster is reported faster, unchanged code passes, a row REV cannot
run or that is new is not comparable; a bad REV, or one whose library does not import, stops the
session before anything is timed; nothing is left behind."""

from __future__ import annotations

import _bisect
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import pytest

from perfgate.against import COMPILED, IMPORT_CHECK, compiled_files, compiled_modules, report_lines
from perfgate.report import main as report_main

LIBRARY = """
import time

def slow_work():
    time.sleep({slow})

def fast_work():
    time.sleep({fast})
"""

SUITE = """
import time
import pytest
import mylib

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_slow(perf, impl):
    perf(lambda: time.sleep(0.008) if impl == "reference" else mylib.slow_work(), label="slow")

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_fast(perf, impl):
    perf(lambda: time.sleep(0.008) if impl == "reference" else mylib.fast_work(), label="fast")
"""

NEW = """
import time
import pytest
import mylib

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_{name}(perf, impl):
    perf(lambda: time.sleep(0.008) if impl == "reference" else mylib.{call}(), label="{name}")
"""

# short rounds; --perf-contended=inf: the designed outcomes must not turn unresolved on a busy CI host
FAST = ["-p", "no:cacheprovider", "--perf-device", "cpu", "--benchmark-max-time=0.1", "--perf-visits=1",
        "--perf-contended=inf"]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_SYSTEM": os.devnull}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
            tmp_path_factory: pytest.TempPathFactory) -> pytest.Pytester:
    """A committed project: mylib's two kernels sleep 4 ms, a perf suite times them; scratch
    folders go to a folder of the test's own (checked empty by the tests)."""
    pytester.mkpydir("mylib")
    (pytester.path / "mylib" / "__init__.py").write_text(LIBRARY.format(slow=0.004, fast=0.004))
    pytester.makepyfile(test_perf=SUITE)
    _git(pytester.path, "init", "-q", "-b", "main")
    _git(pytester.path, "add", "-A")
    _git(pytester.path, "commit", "-q", "-m", "base")
    scratch = tmp_path_factory.mktemp("scratch")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    # the sessions it runs are not xdist workers, though this test may run in one: pytest-benchmark
    # would warn that xdist disables benchmarks
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.scratch = scratch
    return pytester


def _left(pytester: pytest.Pytester) -> list[Path]:
    return list(pytester.scratch.iterdir())


def _rows(pytester: pytest.Pytester) -> dict[str, dict]:
    against = json.loads((pytester.path / "out.json").read_text())["perfgate"]["against"]
    return {r["kernel"]: r for r in against["rows"]}


@pytest.mark.paced
def test_a_slower_row_fails_a_faster_one_is_reported_and_new_ones_are_not_comparable(
        project: pytest.Pytester, capsys: pytest.CaptureFixture) -> None:
    # HEAD gains a test of a function its library lacks; this tree, uncommitted: slow_work 1.3x
    # slower, fast_work 2x faster, the function added, and a test HEAD does not have
    project.makepyfile(test_more=NEW.format(name="added", call="added"))
    _git(project.path, "add", "test_more.py")
    _git(project.path, "commit", "-q", "-m", "a test of a function the library lacks")
    (project.path / "mylib" / "__init__.py").write_text(LIBRARY.format(slow=0.0052, fast=0.002)
                                                        + "\ndef added():\n    time.sleep(0.004)\n")
    project.makepyfile(test_newer=NEW.format(name="newer", call="fast_work"))
    result = project.runpytest(*FAST, "--perf-against", "HEAD", "--benchmark-json=out.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines_random([
        "*AGAINST FAILED: slow [[]optimized, slow]: this tree is 1.*x slower than REV*",
        "*against HEAD (*): 1 row(s) slower than REV*"])
    rows = _rows(project)
    assert set(rows) == {"slow", "fast", "added", "newer"}  # the reference rows are not compared
    assert rows["slow"]["outcome"] == "FAIL" and 0.7 < rows["slow"]["ratio"] < 0.84, rows["slow"]
    assert rows["fast"]["outcome"] == "faster" and 1.6 < rows["fast"]["ratio"] < 2.2, rows["fast"]
    assert rows["slow"]["confirmed"] >= 7  # a failure, and a faster row, are timed again on fresh workers
    assert rows["fast"]["confirmed"] >= 7 and rows["fast"]["confirm_ratio"] > 1.05
    assert all(min(rows["slow"]["used"][side]) > 0 for side in ("rev", "this"))  # blocks on both workers a side
    # each worker built 3 copies of the row, and the blocks ran on more units than workers
    assert all(len(set(rows["slow"][f"{side}_units"])) > 2 for side in ("rev", "this")), rows["slow"]
    assert rows["added"]["outcome"] == "not comparable" and "added" in rows["added"]["reason"]
    assert rows["newer"]["outcome"] == "not comparable" and "new in this tree" in rows["newer"]["reason"]
    assert _left(project) == []
    # perfgate.report prints the comparison from the JSON as the session did, and draws its panel
    png = project.path / "bench.png"
    assert report_main([str(project.path / "out.json"), "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "AGAINST FAILED: slow [optimized, slow]: this tree is 1." in printed
    assert "against HEAD (" in printed and "1 row(s) slower than REV" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.paced
def test_a_baseline_drop_that_rev_shares_is_not_this_changes(project: pytest.Pytester) -> None:
    """A baseline saved when slow_work slept 4 ms (2x over its reference), HEAD's slow_work now
    8 ms, a clean tree against HEAD with --benchmark-compare: the stored baseline reads a 50% drop,
    the same session's A/B the same code: the row is unresolved, not failed (the drop came before
    REV), whether the A/B read it no slower than REV or could not settle it."""
    storage = f"--benchmark-storage=file://{project.path / 'baselines'}"
    assert project.runpytest(*FAST, storage, "--benchmark-save=base").ret == 0
    (project.path / "mylib" / "__init__.py").write_text(LIBRARY.format(slow=0.008, fast=0.004))
    _git(project.path, "commit", "-qam", "slow_work slower")
    result = project.runpytest(*FAST, storage, "--benchmark-compare", "--perf-against", "HEAD",
                               "--benchmark-json=out.json")
    slow = _rows(project)["slow"]
    assert slow["outcome"] in ("ok", "unresolved"), slow
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*slow [[]optimized, slow[]]*stored baseline's*REV: the drop is the host's*"])
    assert _left(project) == []


@pytest.mark.paced
def test_unchanged_code_passes_against_head(project: pytest.Pytester) -> None:
    # as make bench runs it: --perf-gated-only times what the comparison needs, not the references
    result = project.runpytest(*FAST, "--perf-gated-only", "--perf-against", "HEAD", "--benchmark-json=out.json")
    assert result.ret == 0, result.stdout.str()
    rows = _rows(project)
    assert set(rows) == {"slow", "fast"}
    assert {r["outcome"] for r in rows.values()} <= {"ok", "unresolved"}, rows
    result.assert_outcomes(passed=2, skipped=2)  # the references: no floor or baseline needs their speedup
    assert json.loads((project.path / "out.json").read_text())["perfgate"]["speedups"] == []
    result.stdout.fnmatch_lines(["*against HEAD (*): no row shown slower than REV by more than 5%*"])
    assert _left(project) == []


def test_a_revision_that_names_no_commit_stops_the_session(project: pytest.Pytester) -> None:
    result = project.runpytest(*FAST, "--perf-against", "HEAD~3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-against HEAD~3: not a commit of*"])
    assert _left(project) == []


def test_a_revision_whose_library_does_not_import_stops_the_session(project: pytest.Pytester) -> None:
    (project.path / "mylib" / "__init__.py").write_text("import no_such_module\n")
    _git(project.path, "commit", "-q", "-am", "broken")
    (project.path / "mylib" / "__init__.py").write_text(LIBRARY.format(slow=0.004, fast=0.004))
    result = project.runpytest(*FAST, "--perf-against", "HEAD")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-against HEAD (*): REV's library does not import (mylib): "
                                 "ModuleNotFoundError: No module named 'no_such_module'*"])
    assert _left(project) == []


@pytest.mark.paced
def test_ctrl_c_in_the_comparison_leaves_nothing_behind(project: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the first row is compared (the in-process session's comparer raises it): the
    session ends interrupted, saves no baseline, and leaves no worker process and no scratch folder."""
    import multiprocessing

    import perfgate.abrun

    def interrupt(self: object, row: object, rows_left: int = 1) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(perfgate.abrun.Comparer, "time_row", interrupt)
    result = project.runpytest(*FAST, "--perf-against", "HEAD", "--benchmark-save=partial")
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()
    result.stdout.fnmatch_lines(["*interrupted: nothing saved as a baseline*"])
    assert not list((project.path / ".benchmarks").rglob("*.json"))
    assert multiprocessing.active_children() == []
    assert _left(project) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--perf-against-workers", "1"], "--perf-against-workers must be >= 2*"),
    (["--perf-against-tolerance", "0"], "--perf-against-tolerance must be in (0, 1)*"),
    (["--perf-shard", "1/2"], "--perf-against compares the whole session with REV; run it without --perf-shard"),
    (["--benchmark-disable"], "--perf-against times the perf tests against REV: benchmarks are off*"),
])
def test_settings_that_cannot_work_are_refused(project: pytest.Pytester, args: list[str], message: str) -> None:
    result = project.runpytest(*FAST, "--perf-against", "HEAD", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


def _judged(ratio: float, low: float, high: float, **confirm: float) -> tuple[str, str]:
    from perfgate.abrun import ABRow, judge

    row = ABRow("k", "optimized", "smoke", "t::k", rev_times=[1.0] * 7, this_times=[1.0] * 7, ratio=ratio,
                low=low, high=high, contention=0.0, confirmed=7 if confirm else 0, **confirm)
    return judge(row, 0.05), row.message


@pytest.mark.parametrize(("measured", "confirm", "outcome"), [
    ((1.144, 1.052, 1.438), {}, "faster"),  # not timed again (no budget left): the first stretch stands
    ((1.144, 1.052, 1.438), {"confirm_ratio": 1.30, "confirm_low": 1.12, "confirm_high": 1.45}, "faster"),
    # the H100 A/A: fresh workers read it over the line, but from under 1: not shown faster
    ((1.144, 1.052, 1.438), {"confirm_ratio": 1.058, "confirm_low": 0.96, "confirm_high": 1.20}, "ok"),
    ((1.144, 1.052, 1.438), {"confirm_ratio": 1.03, "confirm_low": 1.01, "confirm_high": 1.06}, "ok"),
    ((0.80, 0.75, 0.85), {"confirm_ratio": 0.79, "confirm_low": 0.74, "confirm_high": 0.84}, "FAIL"),
    ((0.80, 0.75, 0.85), {"confirm_ratio": 1.0, "confirm_low": 0.90, "confirm_high": 1.10}, "unresolved"),
    ((0.97, 0.93, 1.01), {}, "unresolved"),
    # a Zen 3 fidelity row slowed 1.2x: 9 pairs up to 0.93, then 400 on fresh workers wholly beyond
    # the line, but the two pools' units widen all 409 pairs' interval across it
    ((0.873, 0.791, 0.962), {"first_high": 0.93, "confirm_ratio": 0.869, "confirm_low": 0.838,
                             "confirm_high": 0.902}, "FAIL"),
    ((0.873, 0.791, 0.962), {"first_high": 0.93, "confirm_ratio": 0.93, "confirm_low": 0.89,
                             "confirm_high": 0.97}, "unresolved"),
])
def test_the_rule_on_measured_intervals(measured: tuple, confirm: dict, outcome: str) -> None:
    got, message = _judged(*measured, **confirm)
    assert got == outcome, message
    if confirm and outcome == "ok":
        assert "not shown faster" in message and f"from {confirm['confirm_low']:.3f}x" in message
    if "first_high" in confirm and outcome == "FAIL":
        assert "each stretch alone is beyond it: the first up to 0.930x" in message


def test_the_rules_lines_and_their_boundaries() -> None:
    """The line is 1 / (1 + tolerance), reached at its value; faster needs a low over 1 + tolerance."""
    line = 1.0 / 1.05
    assert _judged(0.9, 0.85, 0.951)[0] == "FAIL"  # under 1 / 1.05 = 0.9524, over 1 - 0.05
    assert _judged(0.80, 0.75, 0.85, confirm_ratio=0.9, confirm_low=0.85, confirm_high=line)[0] == "unresolved"
    assert _judged(1.2, 1.05, 1.4)[0] == "ok"
    assert _judged(1.0, 0.96, 1.04)[0] == "ok"


def test_a_second_stretch_that_reads_no_higher_than_the_interval_does_not_clear_a_slowdown() -> None:
    """A second stretch reaching the line on its high only, its ratio inside the first interval, fails."""
    assert _judged(0.80, 0.75, 0.85, confirm_ratio=0.84, confirm_low=0.70, confirm_high=1.0)[0] == "FAIL"


def test_a_slowdown_on_a_host_withholding_exactly_the_threshold_is_no_verdict() -> None:
    """The contended share counts at or above --perf-contended."""
    from perfgate.abrun import ABRow, judge
    from perfgate.stats import CONTENDED

    row = ABRow("k", "optimized", "smoke", "t::k", rev_times=[1.0] * 7, this_times=[1.0] * 7, ratio=0.8, low=0.75,
                high=0.85, contention=CONTENDED)
    assert judge(row, 0.05) == "unresolved"


@pytest.mark.parametrize(("measured", "outcome", "reading"), [
    ((1.463, 1.022, 1.997), "ok", "1.46x faster"),  # a kernel that lost its threading, beside a busy process
    ((5.844, 2.530, 7.525), "faster", "5.84x faster"),
    ((1.0, 0.96, 1.04), "ok", "as fast"),
    ((0.97, 0.93, 1.01), "unresolved", "1.03x slower"),
    ((0.8, 0.75, 0.85), "FAIL", "1.25x slower"),
])
def test_a_row_timed_on_a_busy_host_is_no_verdict_whichever_way_it_reads(measured: tuple, outcome: str,
                                                                         reading: str) -> None:
    """The withheld share at --perf-contended leaves every reading unresolved, a pass as a failure: the
    withheld time need not fall on the two sides alike. Just under it, each is judged as on a quiet host."""
    from perfgate.abrun import ABRow, judge
    from perfgate.stats import CONTENDED

    def judged(contention: float) -> ABRow:
        ratio, low, high = measured
        row = ABRow("k", "optimized", "smoke", "t::k", rev_times=[1.0] * 7, this_times=[1.0] * 7, ratio=ratio,
                    low=low, high=high, contention=contention)
        judge(row, 0.05, CONTENDED)
        return row

    busy = judged(CONTENDED)
    assert busy.outcome == "unresolved", busy.message
    assert f"this tree read {reading}" in busy.message and "withheld 5% of the CPU time" in busy.message
    assert "no verdict on the code either way" in busy.message
    assert judged(0.99 * CONTENDED).outcome == outcome


def test_a_busy_hosts_share_reaches_the_verdict_of_a_row_timed_faster(monkeypatch) -> None:
    """Pairs reading this tree 1.5x faster: ``faster`` on a quiet host; with the host withholding 30%
    of the CPU while they ran (``time_row`` keeps the share), no verdict."""
    from perfgate.abrun import Budget, judge

    outcomes = []
    for share in (0.0, 0.3):
        scripted = _Scripted(monkeypatch, lambda k: 1.5 + 0.01 * (k % 3), Budget(seconds=0.0), share=share)
        row = scripted.row()
        scripted.comparer.time_row(row)
        outcomes.append((judge(row, 0.05), row.contention))
    assert outcomes == [("faster", 0.0), ("unresolved", 0.3)]


def _units_case(offset: float, slowdown: float, seed: int) -> tuple[tuple, tuple]:
    """A row of 120 pairs on 6 units a side, block noise 10%, three of this tree's units (one
    worker's copies) ``offset`` slower for their whole life, this tree's code ``slowdown`` slower:
    (paired interval, unit-aware interval)."""
    import numpy as np

    from perfgate.stats import clustered_interval, pair_ratio_interval

    rng = np.random.default_rng(seed)
    units_rev, units_this = rng.integers(0, 6, 120), rng.integers(0, 6, 120)
    drift = rng.normal(0.0, 0.05, 120)  # the host's, shared by a pair
    rev = np.exp(drift + rng.normal(0.0, 0.1, 120))
    this = slowdown * np.exp(drift + rng.normal(0.0, 0.1, 120) + np.where(units_this < 3, np.log(offset), 0.0))
    return pair_ratio_interval(rev, this), clustered_interval(rev, this, units_rev, units_this)


def test_a_workers_lasting_offset_is_noise_not_a_slowdown() -> None:
    """Unchanged code, one of this tree's two workers 30% slow (its process state), its three
    copies with it, in 20 seeded rows: the pairs alone read this tree beyond the 5% line in most;
    the unit-aware interval fails none, at the same point."""
    line = 1 / 1.05
    cases = [_units_case(offset=1.3, slowdown=1.0, seed=seed) for seed in range(20)]
    assert sum(paired[2] < line for paired, _ in cases) >= 15
    assert not [clustered for _, clustered in cases if clustered[2] < line]
    assert all(clustered[0] == paired[0] for paired, clustered in cases)


def test_units_that_agree_cost_little_and_a_real_slowdown_still_fails() -> None:
    """No unit offsets, 20 seeded rows: the unit-aware interval holds the pairs' own, is at most
    25% wider in the median row (16%), and a 1.3x slowdown is wholly beyond the line in every row."""
    import math

    import numpy as np

    cases = [_units_case(offset=1.0, slowdown=1.0, seed=seed) for seed in range(20)]
    assert all(c[1] <= p[1] * (1 + 1e-12) and c[2] >= p[2] * (1 - 1e-12) for p, c in cases)
    assert np.median([math.log(c[2] / c[1]) / math.log(p[2] / p[1]) for p, c in cases]) < 1.25
    assert all(_units_case(offset=1.0, slowdown=1.3, seed=seed)[1][2] < 1 / 1.05 for seed in range(20))


@pytest.mark.parametrize("units, pairs, width", [(6, 60, 0.166), (2, 20, 0.9)])
def test_unit_aware_intervals_hold_the_truth_at_their_confidence(units: int, pairs: int, width: float) -> None:
    """Unchanged code, every unit of both sides offset (SD 5%, their blocks' noise 5%) in 200
    seeded rows: the unit-aware 95% interval misses 1.0 in at most 8% of them, where the pairs
    alone miss it in over 20%; with t's degrees of freedom pooled over both sides, its mean log
    width stays under ``width`` (0.156 and 0.77; t at the fewer units - 1 read 0.173 and 1.06 on
    the ratio of medians)."""
    import math

    import numpy as np

    from perfgate.stats import clustered_interval, pair_ratio_interval

    missed, paired_missed, widths = 0, 0, []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        u, v = rng.integers(0, units, pairs), rng.integers(0, units, pairs)
        drift = rng.normal(0.0, 0.05, pairs)
        rev = np.exp(drift + rng.normal(0.0, 0.05, pairs) + rng.normal(0.0, 0.05, units)[u])
        this = np.exp(drift + rng.normal(0.0, 0.05, pairs) + rng.normal(0.0, 0.05, units)[v])
        _, low, high = clustered_interval(rev, this, u, v)
        missed += not low <= 1.0 <= high
        widths.append(math.log(high / low))
        _, low, high = pair_ratio_interval(rev, this)
        paired_missed += not low <= 1.0 <= high
    assert missed <= 16 and paired_missed > 40, (missed, paired_missed)
    assert np.mean(widths) < width


def test_a_unit_per_pair_or_one_unit_is_the_paired_interval() -> None:
    """With nothing to tell units from pairs (each pair its own unit, or one unit a side), the
    unit-aware interval is the pairs' own."""
    import numpy as np

    from perfgate.stats import clustered_interval, pair_ratio_interval

    rng = np.random.default_rng(0)
    rev, this = np.exp(rng.normal(0.0, 0.1, 30)), np.exp(rng.normal(0.0, 0.1, 30))
    paired = pair_ratio_interval(rev, this)
    for units in (np.arange(30), np.zeros(30, dtype=int)):
        assert clustered_interval(rev, this, units, units) == pytest.approx(paired, rel=1e-12)


def test_unit_aware_intervals_need_matching_counts() -> None:
    from perfgate.stats import clustered_interval

    with pytest.raises(ValueError, match="equal counts"):
        clustered_interval([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0, 1], [0, 1, 2])


def _confirmed(first_slow: float, second: list[tuple[float, float]], noise: float, seed: int,
               settle: bool = True, share: float = 0.0) -> str:
    """The outcome of a row whose first stretch (14 pairs) read this tree ``first_slow`` times
    slower, timed again on a scripted second stretch: pair k of it is this tree ``second[k][0]``
    times slower at log noise ``second[k][1]`` (the last entry repeats), each side on 4 units."""
    import numpy as np

    from perfgate.abrun import ABRow, Budget, Comparer, Stretch, judge

    rng = np.random.default_rng(seed)

    class Scripted(Comparer):
        def pairs(self, row: ABRow, count: int, into, loads) -> None:
            for _ in range(count):
                k = len(into) - 14
                slow, sd = second[min(k, len(second) - 1)]
                into.rev.append(float(np.exp(rng.normal(0, sd))))
                into.this.append(float(slow * np.exp(rng.normal(0, sd))))
                into.rev_units.append(100 + k % 4)
                into.this_units.append(100 + (k + 1) % 4)
                loads.append((1.0, share))  # the host's withheld share while the pair ran

    row = ABRow("k", "optimized", "smoke", "t::k", rev_times=list(np.exp(rng.normal(0, noise, 14))),
                this_times=list(first_slow * np.exp(rng.normal(0, noise, 14))),
                rev_units=[k % 4 for k in range(14)], this_units=[(k + 2) % 4 for k in range(14)], contention=0.0)
    first = Stretch(row.rev_times, row.this_times, row.rev_units, row.this_units)
    row.ratio, row.low, row.high = first.interval(0.95)  # as time_row leaves it
    comparer = Scripted(None, 0.05, Budget(extend_s=5.0))
    if not settle:
        comparer._settle = lambda *args: None
    comparer.confirm(row)
    return judge(row, 0.05)


def test_a_second_stretch_that_straddles_is_timed_further_before_it_clears_a_slowdown() -> None:
    """A 1.2x slowdown whose second stretch, on fresh workers, starts noisy and light (1.075x at log
    noise 0.25 for 14 pairs, then 1.2x at 0.05): stopped at 14 pairs it reads above both stretches'
    interval and straddles the line, so "the host changed" leaves the row unresolved; timed on
    while it straddles, it FAILs. A first stretch slowed by the host alone (the second unchanged,
    log noise 0.1) fails no more rows with that than without it."""
    noisy_start = [(1.075, 0.25)] * 14 + [(1.2, 0.05)]
    with_settle = [_confirmed(1.2, noisy_start, 0.05, seed) for seed in range(10)]
    without = [_confirmed(1.2, noisy_start, 0.05, seed, settle=False) for seed in range(10)]
    assert with_settle == ["FAIL"] * 10
    assert without.count("unresolved") >= 2
    host_blip = [(1.0, 0.1)]
    assert ([_confirmed(1.2, host_blip, 0.05, seed) for seed in range(40)].count("FAIL")
            == [_confirmed(1.2, host_blip, 0.05, seed, settle=False) for seed in range(40)].count("FAIL"))


class _Scripted:
    """A Comparer whose pairs read REV/this ``ratio(k)`` for pair k, each block on a unit of its own, 1 s a pair
    on a fake clock, the host withholding ``share``."""

    def __init__(self, monkeypatch, ratio, budget, share: float = 0.0):
        import types

        import perfgate.abrun as A

        clock = [0.0]
        monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

        class Comparer(A.Comparer):
            def pairs(self, row, count: int, into, loads) -> None:
                for _ in range(count):
                    k = len(into)
                    into.rev.append(ratio(k))
                    into.this.append(1.0)
                    into.rev_units.append(2 * k)
                    into.this_units.append(2 * k + 1)
                    loads.append((1.0, share))
                    clock[0] += 1.0

        self.comparer = Comparer(None, 0.05, budget)

    def row(self):
        from perfgate.abrun import ABRow

        return ABRow("k", "optimized", "smoke", "t::k")


def test_a_rows_planned_pairs_stop_when_its_early_interval_clears_the_line(monkeypatch) -> None:
    """Planned pairs are cut short once the 99% (``state.EARLY``) interval clears the line, not the 95% one."""
    from perfgate.abrun import Budget
    from perfgate.state import MIN_PAIRS

    scripted = _Scripted(monkeypatch, lambda k: 1.0 + 0.001 * (k % 5), Budget(seconds=100.0))
    row = scripted.row()
    scripted.comparer.time_row(row)
    assert len(row.rev_times) > MIN_PAIRS and row.low >= 1 / 1.05


def test_a_straddling_row_is_extended_up_to_max_pairs_and_its_share_of_the_budget(monkeypatch) -> None:
    """A row straddling the line after its planned pairs is extended, doubling, up to MAX_PAIRS in all and
    within its share of what is left."""
    from perfgate.abrun import MAX_PAIRS, Budget
    from perfgate.state import MIN_PAIRS

    straddling = lambda k: 0.9 if k % 2 else 1.0  # noqa: E731
    scripted = _Scripted(monkeypatch, straddling, Budget(seconds=0.0, extend_s=1e6, total_s=1e6))
    row = scripted.row()
    assert scripted.comparer.time_row(row) and len(row.rev_times) == MIN_PAIRS  # planned pairs only
    scripted.comparer.extend(row)
    assert len(row.rev_times) == MAX_PAIRS
    scripted = _Scripted(monkeypatch, straddling, Budget(seconds=0.0, extend_s=100.0, total_s=40.0))
    row = scripted.row()
    scripted.comparer.time_row(row)
    assert scripted.comparer.extension_s(rows_left=4) == 10.0
    scripted.comparer.extend(row, rows_left=4)  # 10 s: 7 pairs, then 3
    assert len(row.rev_times) == 17
    assert scripted.comparer.extension_s(rows_left=3) == 10.0  # (40 - 10) / 3


def test_a_row_built_again_is_timed_on_the_first_builds_units() -> None:
    """A copy built again in the same worker (to be measured further) is the unit the first build's copy of
    its index was: in the same process it may land where the dropped one was, so it adds no unit."""
    import types

    from perfgate.abrun import ABRow, Budget, Comparer, Stretch

    class Pool:
        per_side = 1
        workers = [types.SimpleNamespace(side=side, index=0, name=side) for side in ("rev", "this")]

        def side(self, name: str) -> list:
            return [w for w in self.workers if w.side == name]

        def ask(self, worker, op: str, timeout: float, **kwargs) -> dict:
            if op == "build":
                return {"ok": True, "warm_s": 0.01, "builds": 1, "label": ""}
            return {"ok": True, "times": [0.01], "share": None}

    comparer, row = Comparer(Pool(), 0.05, Budget()), ABRow("k", "optimized", "smoke", "t::k")
    got = Stretch(row.rev_times, row.this_times, row.rev_units, row.this_units)
    for _ in range(2):
        assert comparer.build(ABRow("k", "optimized", "smoke", "t::k"), {})
        comparer.pairs(row, 1, got, [])
    assert len(set(row.rev_units)) == 1 and len(set(row.this_units)) == 1


class _Builds:
    """A pool of 2 workers a side whose builds make ``made(n)`` copies for the n-th build asked (``None``:
    as many as asked) and take ``seconds`` on a fake clock each, or fail where ``fails(n)``; every ask kept."""

    def __init__(self, monkeypatch, made, seconds: float = 1.0, fails=lambda n: False) -> None:
        import types

        import perfgate.abrun as A

        self.clock, self.asked = [0.0], []
        monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: self.clock[0]))
        self.made, self.seconds, self.fails = made, seconds, fails
        self.per_side = 2
        self.workers = [types.SimpleNamespace(side=side, index=i, name=f"{side}{i}") for side in ("rev", "this")
                        for i in range(2)]

    def side(self, name: str) -> list:
        return [w for w in self.workers if w.side == name]

    def ask(self, worker, op: str, timeout: float, **kwargs) -> dict:
        if op != "build":
            return {"ok": True, "times": [0.01], "share": None}
        self.asked.append((kwargs["row"], kwargs["builds"], kwargs["build_s"]))
        n = len(self.asked)
        self.clock[0] += self.seconds
        if self.fails(n):
            return {"ok": False, "reason": "MemoryError"}
        made = self.made(n)
        return {"ok": True, "warm_s": 0.01, "builds": kwargs["builds"] if made is None else made, "label": ""}


def _built_again(pool: _Builds) -> tuple:
    """Row k built and timed on ``pool``, another row built after it, then k built again: (k, its
    first units a side, its units a side after 200 more pairs, the asks of that last build)."""
    from perfgate.abrun import ABRow, Budget, Comparer, Stretch

    comparer = Comparer(pool, 0.05, Budget(seconds=0.0))
    row = ABRow("k", "optimized", "smoke", "t::k")
    assert comparer.build(row, {"row": "t::k"})
    comparer.time_row(row)
    first = [set(row.rev_units), set(row.this_units)]
    assert comparer.build(ABRow("j", "optimized", "smoke", "t::j"), {"row": "t::j"})  # another row between
    asked = len(pool.asked)
    fresh = ABRow("k", "optimized", "smoke", "t::k")
    assert comparer.build_again(row, fresh, {"row": "t::k"}) and not fresh.broken
    comparer.pairs(row, 200, Stretch(row.rev_times, row.this_times, row.rev_units, row.this_units), [])
    return row, first, [set(row.rev_units), set(row.this_units)], pool.asked[asked:]


@pytest.mark.parametrize(("first_copies", "again"), [(1, (2, float("inf"))), (3, (3, 3.0))])
def test_a_row_built_on_too_few_units_is_built_again_with_a_new_unit_a_worker(monkeypatch, first_copies: int,
                                                                              again) -> None:
    """A straddling row whose workers built one copy each (2 units a side: its units' offsets read at 1
    degree of freedom) is built again with one copy more a worker, built whatever it takes: its further
    pairs land on 4 units a side, the first builds' 2 among them, whatever another row built in between.
    A row built on 3 copies a worker is built again as it was built first (COPIES within COPIES_S)."""
    from perfgate.abrun import COPIES, COPIES_S, MIN_UNITS

    assert (COPIES, COPIES_S) == (3, 3.0) and MIN_UNITS == 3
    # row k's first build as told, row j's between on 3 copies a worker, k's again as asked
    pool = _Builds(monkeypatch, lambda n: first_copies if n <= 4 else 3 if n <= 8 else None)
    _, first, units, asked = _built_again(pool)
    assert all(len(u) <= 2 * first_copies for u in first)
    assert asked == [("t::k", *again)] * 4  # every worker, as the rule says
    assert all(len(u) == 2 * again[0] and f <= u for f, u in zip(first, units, strict=True))


def test_a_slow_build_or_a_failed_extra_copy_builds_the_row_again_as_it_was(monkeypatch) -> None:
    """No extra copy where the row's build took its slowest worker over EXTRA_COPY_S (its cost is not the
    extension budget's); where the build with the extra copy fails on this tree's side (its memory), the row
    is built again as it was, not failed: 2 units a side either way."""
    from perfgate.abrun import EXTRA_COPY_S

    assert EXTRA_COPY_S == 30.0
    slow = _Builds(monkeypatch, lambda n: 1, seconds=31.0)  # one copy a worker within COPIES_S
    _, _, units, asked = _built_again(slow)
    assert [a[1:] for a in asked] == [(3, 3.0)] * 4 and all(len(u) == 2 for u in units)
    failing = _Builds(monkeypatch, lambda n: 1, fails=lambda n: n == 12)  # this tree's second worker, extra copy
    _, _, units, asked = _built_again(failing)
    assert [a[1:] for a in asked] == [(2, float("inf"))] * 4 + [(3, 3.0)] * 4 and all(len(u) == 2 for u in units)


def test_a_worker_lost_on_an_earlier_row_is_no_unit_of_a_later_one(monkeypatch) -> None:
    """Row j built on 3 copies a worker, then REV's second worker lost: row k, built on one copy by REV's
    worker left and two by each of this tree's, has 1 unit on REV's side, not the lost worker's 3 besides,
    so it is built again with an extra copy a worker."""
    from perfgate.abrun import ABRow, Budget, Comparer

    pool = _Builds(monkeypatch, lambda n: 3 if n <= 4 else 1 if n == 5 else 2 if n <= 7 else None)
    comparer = Comparer(pool, 0.05, Budget(seconds=0.0))
    assert comparer.build(ABRow("j", "optimized", "smoke", "t::j"), {"row": "t::j"})
    pool.workers.remove(pool.side("rev")[1])
    row = ABRow("k", "optimized", "smoke", "t::k")
    assert comparer.build(row, {"row": "t::k"})
    comparer.time_row(row)
    assert comparer.build_again(row, ABRow("k", "optimized", "smoke", "t::k"), {"row": "t::k"})
    assert [a[1:] for a in pool.asked[7:]] == [(2, float("inf")), (3, float("inf")), (3, float("inf"))]


def test_a_row_stopped_mid_extension_is_read_on_every_pair_it_has(monkeypatch) -> None:
    """Ctrl-C during a row's extension: its interval is that of all its pairs, not its planned pairs' alone."""
    from perfgate.abrun import Budget
    from perfgate.stats import pair_ratio_interval

    def ratio(k: int) -> float:
        if k == 12:
            raise KeyboardInterrupt
        return 0.9 if k % 2 else 1.0

    scripted = _Scripted(monkeypatch, ratio, Budget(seconds=0.0, extend_s=1e6, total_s=1e6))
    row = scripted.row()
    scripted.comparer.time_row(row)
    with pytest.raises(KeyboardInterrupt):
        scripted.comparer.extend(row)
    assert len(row.rev_times) == 12  # 6 pairs at 0.9: the median ratio moved from the planned pairs' 1.0
    assert (row.ratio, row.low, row.high) == pytest.approx(pair_ratio_interval(row.rev_times, row.this_times))
    assert row.ratio == pytest.approx(0.9 ** 0.5)


def test_a_row_decided_by_its_planned_pairs_is_not_extended(monkeypatch) -> None:
    """A row whose planned pairs clear the line (either way) is not reported straddling: nothing to extend."""
    from perfgate.abrun import Budget

    for ratio in (lambda k: 1.0 + 0.001 * (k % 3), lambda k: 0.8 + 0.001 * (k % 3)):
        scripted = _Scripted(monkeypatch, ratio, Budget(seconds=0.0, extend_s=100.0))
        assert not scripted.comparer.time_row(scripted.row())


def test_a_second_stretch_is_at_least_twice_min_pairs_and_keeps_the_first_stretchs_contention(monkeypatch) -> None:
    """A row timed again gets 2 x MIN_PAIRS fresh pairs, all counted as ``confirmed``; the host's withheld share is
    the larger of the two stretches'."""
    from perfgate.abrun import Budget
    from perfgate.state import MIN_PAIRS

    scripted = _Scripted(monkeypatch, lambda k: 0.5 + 0.001 * (k % 3), Budget(seconds=0.0, extend_s=10.0))
    row = scripted.row()
    scripted.comparer.time_row(row)
    assert len(row.rev_times) == MIN_PAIRS
    row.contention = 0.3
    scripted.comparer.confirm(row)
    assert row.confirmed == 2 * MIN_PAIRS and len(row.rev_times) == 3 * MIN_PAIRS and row.contention == 0.3


def _needs_build(project: pytest.Pytester, build: str) -> None:
    """REV's library imports a module its build writes (untracked: this tree has it built)."""
    init = project.path / "mylib" / "__init__.py"
    init.write_text("import mylib._built  # noqa: F401\n" + init.read_text())
    (project.path / "mylib" / "_built.py").write_text("")
    (project.path / ".gitignore").write_text("_built.py\n")
    if build:
        project.makeini(f"[pytest]\nperfgate_against_build = {build}\n")
    _git(project.path, "add", "-A")
    _git(project.path, "commit", "-q", "-m", "a library with a build step")


def test_the_build_command_runs_in_revs_copy_before_its_import(project: pytest.Pytester) -> None:
    _needs_build(project, """{python} -c "open('mylib/_built.py', 'w').close()\"""")
    result = project.runpytest(*FAST, "--perf-against", "HEAD", "--collect-only", "-q")
    assert result.ret == 0, result.stderr.str()
    assert _left(project) == []


def test_without_its_build_command_revs_library_does_not_import(project: pytest.Pytester) -> None:
    _needs_build(project, "")
    result = project.runpytest(*FAST, "--perf-against", "HEAD", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*REV's library does not import (mylib): *No module named 'mylib._built'*"])


def test_a_failing_build_command_stops_the_session(project: pytest.Pytester) -> None:
    _needs_build(project, """{python} -c "import sys; sys.exit('no C compiler')\"""")
    result = project.runpytest(*FAST, "--perf-against", "HEAD", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-against HEAD (*): perfgate_against_build [[]*] failed in REV's copy "
                                 "(exit 1): no C compiler*"])
    assert _left(project) == []


def test_a_folder_rev_is_used_as_it_is_without_the_build_command(project: pytest.Pytester,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    _needs_build(project, """{python} -c "import sys; sys.exit('no C compiler')\"""")
    other = tmp_path_factory.mktemp("other")  # a copy the user built: its mylib/_built.py is there
    shutil.copytree(project.path / "mylib", other / "mylib")
    result = project.runpytest(*FAST, f"--perf-against={other}", "--collect-only", "-q")
    assert result.ret == 0, result.stderr.str()
    assert (other / "mylib" / "_built.py").is_file()


def test_a_folder_rev_that_is_the_rootdir_is_refused_naming_the_one_word_form(
        project: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Written as two words, a folder with its own config becomes pytest's rootdir (pytest picks it
    before it knows a plugin's options): both sides would be that copy, so the session stops. A
    copy of the project kept inside the folder (a worktree in the checkout) is another copy."""
    other = tmp_path_factory.mktemp("other")
    shutil.copytree(project.path / "mylib", other / "mylib")
    (other / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    result = project.runpytest(*FAST, "--perf-against", str(other), "test_perf.py", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{other}: that folder is this session's rootdir*write --perf-against={other}"])
    assert project.runpytest(*FAST, f"--perf-against={other}", "test_perf.py", "--collect-only", "-q").ret == 0
    itself = project.runpytest(*FAST, f"--perf-against={project.path}", "--collect-only", "-q")  # this very copy
    assert itself.ret == pytest.ExitCode.USAGE_ERROR
    inner = project.path / "worktree"  # a copy of the project inside it, with its own config
    shutil.copytree(project.path / "mylib", inner / "mylib")
    shutil.copy(project.path / "test_perf.py", inner / "test_perf.py")
    (inner / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    monkeypatch.chdir(inner)
    nested = project.runpytest(*FAST, f"--perf-against={project.path}", "test_perf.py", "--collect-only")
    assert nested.ret == 0, nested.stderr.str()
    nested.stdout.fnmatch_lines([f"rootdir: {inner}"])


def test_a_tree_whose_every_package_holds_perf_tests_has_no_library_to_compare(project: pytest.Pytester) -> None:
    """A package holding a plain test is still the library; one holding a perf test is not."""
    inside = project.path / "mylib" / "test_inside.py"
    inside.write_text("def test_inside():\n    pass\n")
    assert project.runpytest(*FAST, "--perf-against", "HEAD", "--collect-only", "-q").ret == 0
    inside.write_text("def test_inside(perf):\n    pass\n")
    result = project.runpytest(*FAST, "--perf-against", "HEAD", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-against: no library package found under*perfgate_against_library*"])


def test_the_import_check_names_the_compiled_modules_revs_library_loads(tmp_path: Path) -> None:
    """A compiled module (here a copy of CPython's own _bisect, loaded as mylib._bisect) is named;
    the session notes one this tree's library loaded and REV's did not (the line below)."""
    if not str(getattr(_bisect, "__file__", "")).endswith(".so"):
        pytest.skip("this CPython has _bisect built in, not as a shared library to copy")
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("from mylib import _bisect, plain  # noqa: F401\n")
    (tmp_path / "mylib" / "plain.py").write_text("")
    shutil.copy(_bisect.__file__, tmp_path / "mylib" / Path(_bisect.__file__).name)
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(tmp_path), "mylib"], capture_output=True,
                          text=True, check=True)
    assert done.stdout.splitlines()[-1] == COMPILED + json.dumps(["mylib._bisect"])
    assert compiled_modules(["_bisect"]) == ["_bisect"] and compiled_modules(["mylib"]) == []
    note = "REV's copy loaded no mylib._bisect, which this tree's library has"
    assert ("warn", note) in report_lines([], "HEAD (abc)", 2, 1.0, 0.05, notes=[note])


def test_the_import_check_loads_the_compiled_modules_a_library_imports_when_first_used(tmp_path: Path) -> None:
    """A C part the package does not import at its own import (kernels._standardize: at a first
    fit) is REV's too: no note says REV's rows ran without it; one that does not load is left out."""
    if not str(getattr(_bisect, "__file__", "")).endswith(".so"):
        pytest.skip("this CPython has _bisect built in, not as a shared library to copy")
    (tmp_path / "mylib" / "sub").mkdir(parents=True)
    for init in ("mylib/__init__.py", "mylib/sub/__init__.py"):
        (tmp_path / init).write_text("")
    suffix = next(s for s in EXTENSION_SUFFIXES if _bisect.__file__.endswith(s))
    shutil.copy(_bisect.__file__, tmp_path / "mylib" / "sub" / f"_bisect{suffix}")
    (tmp_path / "mylib" / f"_broken{suffix}").write_bytes(b"not a shared library")
    assert compiled_files(tmp_path, ["mylib"]) == ["mylib._broken", "mylib.sub._bisect"]
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(tmp_path), "mylib"], capture_output=True,
                          text=True, check=True)
    assert done.stdout.splitlines()[-1] == COMPILED + json.dumps(["mylib.sub._bisect"])


@pytest.mark.parametrize("mode", ["worker lost", "rebuild failed", "ctrl-c", "this tree's worker lost"])
def test_a_slower_row_not_timed_again_leaves_its_failure_standing_unconfirmed(monkeypatch, tmp_path,
                                                                               mode: str) -> None:
    """This tree 1.3x slower; one fresh worker of REV's dies while the row is timed again, or the
    fresh pool cannot build it, or Ctrl-C lands among its second stretch's pairs: the first
    stretch's verdict stands (a failure), judged on its own pairs (none of the second's half-taken),
    with a note that says it was not timed again; never 'not comparable'. One of this tree's dies: a
    failure for that, its message naming the death, and no such note."""
    import random
    import types

    import perfgate.against as A
    from perfgate.abrun import Budget
    from perfgate.workers import WorkerGone

    pools = []

    class Worker:
        def __init__(self, side: str, index: int) -> None:
            self.side, self.index, self.name = side, index, f"{side}{index}"

    class FakePool:
        def __init__(self, hellos, per_side) -> None:
            self.per_side, self.n, self.blocks = per_side, len(pools), 0
            self.workers = [Worker(side, i) for side in ("rev", "this") for i in range(per_side)]
            self.rng = random.Random(self.n)
            pools.append(self)

        def start(self) -> None:
            pass

        def close(self) -> None:
            pass

        def side(self, name: str) -> list:
            return [w for w in self.workers if w.side == name]

        def ask(self, w, op, timeout, **kw) -> dict:
            if op == "build":
                if self.n == 1 and mode == "rebuild failed":
                    return {"ok": False, "reason": "out of memory"}
                return {"ok": True, "warm_s": 0.001, "builds": 1}
            if op == "drop":
                return {"ok": True}
            self.blocks += 1
            if self.n == 1 and self.blocks == 5 and mode == "ctrl-c":
                raise KeyboardInterrupt
            dies = {"worker lost": "rev", "this tree's worker lost": "this"}.get(mode)
            if self.n == 1 and self.blocks >= 5 and w.side == dies and len(self.side(dies)) == self.per_side:
                self.workers.remove(w)  # a worker of the fresh pool dies while timing again
                raise WorkerGone(f"{w.name} died (exit -9)")
            t = (1.0 if w.side == "rev" else 1.3) * (1 + 0.01 * self.rng.random())
            return {"ok": True, "times": [t], "share": None}

    monkeypatch.setattr(A, "Pool", FakePool)
    for side in ("rev", "this"):  # the test exists at REV and here
        (tmp_path / side).mkdir()
        (tmp_path / side / "test_k.py").write_text("def test_k(perf):\n    pass\n")
    ag = A.Against.__new__(A.Against)
    ag.per_side, ag.tolerance, ag.rows, ag.notes, ag.problem = 2, 0.05, [], [], ""
    item = types.SimpleNamespace(path=tmp_path / "this" / "test_k.py", originalname="test_k",
                                 nodeid="test_k.py::test_k", module=types.SimpleNamespace(__name__="test_k"),
                                 callspec=types.SimpleNamespace(params={}))
    state = types.SimpleNamespace(results={"k": {"optimized": types.SimpleNamespace(label="")}},
                                  settings=types.SimpleNamespace(size="smoke", contended=0.05))
    first: list[int] = []
    judge = A.judge

    def judged(row, *args):  # the first stretch's pairs, as the session judges them
        first.append(len(row.rev_times))
        return judge(row, *args)

    monkeypatch.setattr(A, "judge", judged)
    compare = lambda: ag._compare({}, [(item, "k", "optimized")], tmp_path / "rev",  # noqa: E731
                                  tmp_path / "this", state, Budget(seconds=0.0, extend_s=1.0))
    if mode == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            compare()
    else:
        compare()
    (row,) = ag.rows
    assert judge(row, 0.05) == "FAIL" and ag.failed() == [row], (row.reason, row.outcome)
    assert len(row.rev_times) == len(row.this_times) == len(row.rev_units) == first[0]
    unconfirmed = [n for n in ag.notes if "was not timed again" in n and "unconfirmed" in n]
    if mode == "this tree's worker lost":
        assert "could not run it: this" in row.message and "died (exit -9)" in row.message and not unconfirmed
        return
    why = {"worker lost": "rev", "rebuild failed": "out of memory", "ctrl-c": "interrupted"}[mode]
    assert [n for n in unconfirmed if why in n], ag.notes


@pytest.mark.parametrize(("fails", "outcome"), [
    ("this build", "FAIL"), ("this block", "FAIL"), ("this rebuild limit", "not comparable"),
    ("rev build", "not comparable")])
def test_this_trees_worker_breaking_on_a_row_fails_it(fails: str, outcome: str) -> None:
    """This tree's worker dying, hanging or raising on a row the session itself ran (an OOM, a
    crash in a C part, an error on a later call) is a failure, never 'not comparable' (which
    passed the session: the review's case); REV failing to run it, or the rebuild's own limit (a
    fixture it cannot give), is not comparable."""
    from perfgate.abrun import ABRow, Budget, Comparer, judge
    from perfgate.workers import WorkerGone

    class Worker:
        def __init__(self, side: str) -> None:
            self.side, self.index, self.name = side, 0, f"perfgate-{side}-0"

    class Pool:
        per_side = 1
        workers = [Worker("rev"), Worker("this")]

        def side(self, name: str) -> list:
            return [w for w in self.workers if w.side == name]

        def ask(self, w, op, timeout, **kw) -> dict:
            if op == "build" and fails == f"{w.side} build":
                raise WorkerGone(f"{w.name} died (exit -9)")
            if op == "build" and fails == "this rebuild limit":
                return {"ok": False, "reason": "takes the fixture 'x'", "not_comparable": True}
            if op == "build":
                return {"ok": True, "warm_s": 0.001, "builds": 1}
            if fails == "this block" and w.side == "this":
                return {"ok": False, "reason": "RuntimeError: out of memory"}
            return {"ok": True, "times": [0.001], "share": None}

    row = ABRow("k", "optimized", "smoke", "t::k")
    comparer = Comparer(Pool(), 0.05, Budget(seconds=0.0, extend_s=0.0))
    try:
        if comparer.build(row, {}):
            comparer.time_row(row)
    except WorkerGone:
        pass  # the phase's handler goes on with the next row
    assert judge(row, 0.05) == outcome, row
    if outcome == "FAIL":
        assert "this tree's worker could not run it" in row.message and "perfgate-this-0" in row.message


def test_the_workers_time_with_the_sessions_timer_settings() -> None:
    """Both sides' workers get the session's --perf-l2-flush, --benchmark-timer clock,
    --benchmark-disable-gc (they timed with a bare perf_counter, GC on, no flush: another
    configuration than the one the session's rows, and its fingerprint, name) and allocator; only
    this tree's side wraps its timed calls with the session's wrapper."""
    import time
    import types

    import perfgate.against as A

    ag = A.Against.__new__(A.Against)
    ag.library = ["mylib"]
    options = {"benchmark_timer": "time.process_time", "benchmark_disable_gc": True}
    ag.config = types.SimpleNamespace(getoption=options.__getitem__)
    wrap = object()
    settings = types.SimpleNamespace(fingerprint={"malloc": "cache", "l2_flush": True}, device="cpu", size="smoke",
                                     threads=1, wrap=wrap)
    for side in ("rev", "this"):
        hello = ag._hello(side, Path("/nowhere"), types.SimpleNamespace(settings=settings), None)
        assert hello.l2_flush and hello.disable_gc and hello.host_timer is time.process_time
        assert hello.malloc == "cache" and hello.wrap is (wrap if side == "this" else None)
    settings.fingerprint["malloc"] = "default"
    assert ag._hello("rev", Path("/nowhere"), types.SimpleNamespace(settings=settings), None).malloc == "default"


def test_an_incomplete_comparison_never_closes_on_a_pass_line() -> None:
    from perfgate.abrun import ABRow, judge
    from perfgate.against import report_lines

    row = ABRow("k", "optimized", "smoke", "t::x", reason="every this worker is gone")
    judge(row, 0.05)
    lines = report_lines([row], "HEAD~1", 2, 10.0, 0.05, problem="every this worker is gone")
    assert lines[-1][0] == "fail" and "incomplete" in lines[-1][1]
    assert not any(style == "pass" for style, _ in lines)


def test_a_row_timed_late_gets_its_share_of_the_extension_budget(monkeypatch) -> None:
    """``--perf-against-budget`` is the extensions' seconds: rows before a straddling one that
    spent far more than it on their own planned pairs leave it the extension the first row gets."""
    import random
    import types

    import perfgate.abrun as A

    clock = [0.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Worker:
        def __init__(self, side: str, index: int) -> None:
            self.side, self.index, self.name = side, index, f"{side}{index}"

    class FakePool:
        """Blocks of ``block_s`` each on the fake clock; this tree ``slower`` times REV's at log noise."""
        per_side = 2

        def __init__(self, block_s: float, slower: float, noise: float) -> None:
            self.block_s, self.slower, self.noise, self.rng = block_s, slower, noise, random.Random(1)
            self.workers = [Worker(side, i) for side in ("rev", "this") for i in range(2)]

        def side(self, name: str) -> list[Worker]:
            return [w for w in self.workers if w.side == name]

        def ask(self, worker: Worker, op: str, timeout: float, **kwargs) -> dict:
            clock[0] += self.block_s
            base = 1.0 if worker.side == "rev" else self.slower
            return {"ok": True, "times": [base * math.exp(self.rng.gauss(0.0, self.noise))], "share": None}

    def late_pairs(rows_before: int) -> int:
        budget = A.Budget(seconds=0.0, extend_s=50.0, total_s=100.0)
        comparer = A.Comparer(FakePool(30.0, 1.0, 0.001), 0.05, budget)
        comparer.blocks = {"rev": (1, 0, 0.01), "this": (1, 0, 0.01)}
        for k in range(rows_before):  # each clearly unchanged, its 7 pairs 420 s on the clock
            assert not comparer.time_row(A.ABRow("early", "optimized", "smoke", f"t::early{k}"))
        comparer.pool = FakePool(0.05, 1.045, 0.08)  # this tree 4.5% slower: its interval straddles 0.952
        row = A.ABRow("late", "optimized", "smoke", "t::late")
        assert comparer.time_row(row)
        comparer.extend(row, rows_left=1)
        return len(row.rev_times)

    first = late_pairs(0)
    assert first > A.MIN_PAIRS
    assert late_pairs(2) == first


def test_a_second_stretch_on_a_busy_host_is_no_verdict() -> None:
    """A row timed again while the host withheld 30% of the CPU: as a first stretch so measured,
    no verdict (the second stretch's share was measured, then left out: the row FAILed)."""
    steady = [(1.2, 0.05)]
    assert [_confirmed(1.2, steady, 0.05, seed) for seed in range(5)] == ["FAIL"] * 5
    assert [_confirmed(1.2, steady, 0.05, seed, share=0.3) for seed in range(5)] == ["unresolved"] * 5


def test_both_sides_time_blocks_of_one_shape() -> None:
    """Unchanged code whose warm call reads 0.09 s on REV's workers and 0.11 s on this tree's
    (either side of WARM_S): both sides get the same calls and warming calls a block."""
    from perfgate.abrun import ABRow, Comparer

    class Worker:
        def __init__(self, side: str, index: int) -> None:
            self.side, self.index, self.name = side, index, f"{side}{index}"

    class Pool:
        per_side = 2
        workers = [Worker(side, i) for side in ("rev", "this") for i in range(2)]

        def ask(self, worker: Worker, op: str, timeout: float, **kwargs) -> dict:
            return {"ok": True, "warm_s": 0.09 if worker.side == "rev" else 0.11, "builds": 1}

    comparer = Comparer(Pool(), 0.05, None)
    assert comparer.build(ABRow("k", "optimized", "smoke", "t::k"), {})
    (rev_calls, rev_warm, rev_s), (this_calls, this_warm, this_s) = comparer.blocks["rev"], comparer.blocks["this"]
    assert (rev_calls, rev_warm) == (this_calls, this_warm) and (rev_s, this_s) == (0.09, 0.11)


def test_a_test_method_is_not_comparable_as_a_method_not_as_new(monkeypatch, tmp_path) -> None:
    """A perf test written in a class: the workers cannot rebuild it by name, so its row says so
    (it read 'new in this tree' though REV's file had it)."""
    import types

    import perfgate.against as A
    from perfgate.abrun import Budget

    for side in ("rev", "this"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "test_k.py").write_text("class TestK:\n    def test_k(self, perf):\n        pass\n")
    ag = A.Against.__new__(A.Against)
    ag.per_side, ag.tolerance, ag.rows, ag.notes, ag.problem = 2, 0.05, [], [], ""
    item = types.SimpleNamespace(path=tmp_path / "this" / "test_k.py", originalname="test_k",
                                 nodeid="test_k.py::TestK::test_k", cls=type("TestK", (), {}))
    state = types.SimpleNamespace(results={"k": {"optimized": types.SimpleNamespace(label="")}},
                                  settings=types.SimpleNamespace(size="smoke", contended=0.05))

    class NoPool:
        def __init__(self, hellos, per_side) -> None:
            self.workers = []

        def start(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(A, "Pool", NoPool)
    ag._compare({}, [(item, "k", "optimized")], tmp_path / "rev", tmp_path / "this", state,
                Budget(seconds=0.0, extend_s=1.0))
    (row,) = ag.rows
    assert "a test method (TestK.test_k)" in row.reason and "new in this tree" not in row.reason


def test_a_compiled_module_older_than_its_source_is_named(tmp_path: Path) -> None:
    """This side times whatever its last install built: a C source edited since is named (REV's
    copy is built afresh), one built after its last edit is not."""
    from perfgate.against import stale_builds

    suffix = EXTENSION_SUFFIXES[0]
    (tmp_path / "mylib").mkdir()
    for stem, source_first in (("_old", False), ("_fresh", True)):
        source, built = tmp_path / "mylib" / f"{stem}.c", tmp_path / "mylib" / f"{stem}{suffix}"
        for path in (source, built) if source_first else (built, source):
            path.write_text("")
        later = max(source.stat().st_mtime, built.stat().st_mtime) + 10
        os.utime(built if source_first else source, (later, later))
    assert stale_builds(tmp_path, ["mylib"]) == [("mylib._old", tmp_path / "mylib" / "_old.c")]
    header = tmp_path / "mylib" / "_shared.h"  # edited since either was built: both may include it
    header.write_text("")
    newest = max(p.stat().st_mtime for p in (tmp_path / "mylib").iterdir()) + 10
    os.utime(header, (newest, newest))
    old = tmp_path / "mylib" / "_old.c"
    want = [("mylib._fresh", header), ("mylib._old", old), ("mylib._old", header)]
    assert stale_builds(tmp_path, ["mylib"]) == want


def test_a_source_as_old_as_its_build_is_not_stale(tmp_path: Path) -> None:
    from perfgate.against import stale_builds

    (tmp_path / "mylib").mkdir()
    for path in (tmp_path / "mylib" / "_same.c", tmp_path / "mylib" / f"_same{EXTENSION_SUFFIXES[0]}"):
        path.write_text("")
        os.utime(path, (1e9, 1e9))
    assert stale_builds(tmp_path, ["mylib"]) == []


def test_a_rev_has_a_test_function_only_where_its_module_defines_one(tmp_path: Path) -> None:
    """A worker rebuilds a test function by its module's name for it: one at the top level, async
    or not; a method, or a function nested in another, is not one it can find."""
    from perfgate.against import defines

    path = tmp_path / "test_k.py"
    path.write_text("async def test_a(perf):\n    pass\n\n\n"
                    "class TestK:\n    def test_b(self, perf):\n        pass\n\n\n"
                    "def helper():\n    def test_c(perf):\n        pass\n")
    assert defines(path, "test_a") and not defines(path, "test_b") and not defines(path, "test_c")
    assert not defines(tmp_path / "gone.py", "test_a")
    path.write_text("def test_a(perf:\n")
    assert not defines(path, "test_a")


def test_against_settings_are_checked_at_their_bounds() -> None:
    from perfgate.against import Against

    Against(None, "HEAD", 2, 0.05, 0.0)  # no extension budget: accepted
    for args, message in (((2, 1.0, 240.0), "--perf-against-tolerance must be in (0, 1), got 1.0"),
                          ((2, 0.05, math.nan), "--perf-against-budget must be seconds >= 0, got nan"),
                          ((2, 0.05, -1.0), "--perf-against-budget must be seconds >= 0, got -1.0")):
        with pytest.raises(pytest.UsageError) as error:
            Against(None, "HEAD", *args)
        assert str(error.value) == message


def test_revs_copy_lacking_this_trees_compiled_module_or_the_library_is_named(tmp_path: Path) -> None:
    """The import check run on a folder REV: a compiled module this tree has and REV's copy did not
    load is a note; a REV with none of the library's packages stops the session, naming them."""
    import types

    from perfgate.against import Against
    from perfgate.checkout import Revision

    if not str(getattr(_bisect, "__file__", "")).endswith(".so"):
        pytest.skip("this CPython has _bisect built in, not as a shared library to copy")
    this, rev = tmp_path / "this", tmp_path / "rev"
    for root in (this, rev):
        (root / "mylib").mkdir(parents=True)
        (root / "mylib" / "__init__.py").write_text("")
    shutil.copy(_bisect.__file__, this / "mylib" / Path(_bisect.__file__).name)  # built here only
    ag = Against(types.SimpleNamespace(rootpath=this), str(rev), 2, 0.05, 0.0)
    ag.revision, ag.root, ag.library = Revision(str(rev), folder=rev), rev, ["mylib"]
    ag._check_imports()
    assert ag.notes == ["REV's copy loaded no mylib._bisect, which this tree's library has (a compiled module not "
                        "built there, or one REV predates): REV's rows run without it"]
    ag.library = ["otherlib"]
    with pytest.raises(pytest.UsageError, match=r"REV has none of the library packages \['otherlib'\]"):
        ag._check_imports()


def test_the_report_reads_each_sides_time_and_names_what_it_could_not_compare() -> None:
    from perfgate.abrun import ABRow

    timed = ABRow("k", "optimized", "smoke", "t::k", rev_times=[0.00102] * 3, this_times=[0.001] * 3, ratio=1.02,
                  low=0.93, high=1.1, outcome="unresolved", message="t::k: straddles the line")
    new = ABRow("n", "optimized", "smoke", "t::n", outcome="not comparable",
                message="t::n: not comparable: new in this tree")
    lines = report_lines([timed, new], "HEAD~1 (abc)", 2, 12.0, 0.05)
    assert lines[2][1].split() == ["k", "optimized", "smoke", "1.020", "1.000", "1.020x", "0.930-1.100", "3",
                                   "unresolved"]
    assert ("warn", "unresolved: t::k: straddles the line") in lines
    assert ("note", "t::n: not comparable: new in this tree") in lines
    assert lines[-1] == ("warn", "against HEAD~1 (abc): no row shown slower than REV by more than 5% (0 within "
                                 "it, 0 faster, 1 unresolved: no verdict)")


def test_a_side_with_no_worker_left_stops_the_phase() -> None:
    import types

    from perfgate.against import _check_sides
    from perfgate.workers import WorkerGone

    _check_sides(types.SimpleNamespace(side=lambda name: [f"{name}0"]))
    with pytest.raises(WorkerGone, match="every this worker is gone"):
        _check_sides(types.SimpleNamespace(side=lambda name: [] if name == "this" else [f"{name}0"]))


def _perf_item(root: Path, name: str, impl: str = "optimized") -> Any:
    """A collected perf test ``name``'s ``impl`` row in ``root``/this/test_k.py, as the phase reads it."""
    import types

    return types.SimpleNamespace(path=root / "this" / "test_k.py", originalname=name, name=f"{name}[{impl}]",
                                 nodeid=f"test_k.py::{name}[{impl}]", cls=None,
                                 module=types.SimpleNamespace(__name__="test_k"),
                                 callspec=types.SimpleNamespace(params={"impl": impl}),
                                 iter_markers=lambda name=None: iter(()))


def test_only_the_claimed_impls_this_tree_ran_are_compared(tmp_path: Path) -> None:
    import types

    from perfgate.against import Against

    ag = Against(None, "HEAD", 2, 0.05, 0.0)
    ag.items = [_perf_item(tmp_path, "test_k", "reference"), _perf_item(tmp_path, "test_k"),
                _perf_item(tmp_path, "test_j")]  # test_j's row did not run here (skipped, failed)
    state = types.SimpleNamespace(results={"k": {"reference": None, "optimized": None}})
    assert [(kernel, impl) for _, kernel, impl in ag._targets(state)] == [("k", "optimized")]


class _Straddling:
    """A stand-in for perfgate's Comparer in ``_compare_with``: every row built, its planned pairs 7 at
    1.0 with an interval straddling the line (0.9-1.1), 10 s of extension each; tests override the rest."""

    def __init__(self, pool: object, tolerance: float, budget: object) -> None:
        self.planned: dict = {}

    def build(self, row: Any, request: dict) -> bool:
        return True

    def build_again(self, row: Any, fresh: Any, request: dict) -> bool:
        return self.build(fresh, request)

    def time_row(self, row: Any) -> bool:
        import types

        self.planned[row.nodeid] = types.SimpleNamespace(pair_s=1.0)
        row.rev_times, row.this_times, row.contention = [1.0] * 7, [1.0] * 7, 0.0
        row.ratio, row.low, row.high = 1.0, 0.9, 1.1
        return True

    def extension_s(self, rows_left: int = 1) -> float:
        return 10.0

    def use(self, pool: object) -> None:
        pass

    def drop(self, row: Any) -> None:
        pass


def _compare_with(monkeypatch, tmp_path: Path, comparer: type, kernels: str) -> Any:
    """``Against._compare`` over one row per letter of ``kernels`` (test_k.py's test_<letter>, impl
    optimized) with ``comparer`` for perfgate's Comparer and a pool that starts nothing; a Ctrl-C or a
    side's last worker lost ends it as it ends ``Against.run``."""
    import types

    import perfgate.against as A
    from perfgate.abrun import Budget
    from perfgate.workers import WorkerGone

    class Pool:
        def __init__(self, hellos: dict, per_side: int) -> None:
            pass

        def start(self) -> None:
            pass

        def close(self) -> None:
            pass

        def side(self, name: str) -> list:  # a worker on each side, for _check_sides
            return [name]

    monkeypatch.setattr(A, "Comparer", comparer)
    monkeypatch.setattr(A, "Pool", Pool)
    for side in ("rev", "this"):
        (tmp_path / side).mkdir()
        tests = "".join(f"def test_{k}(perf):\n    pass\n\n\n" for k in kernels)
        (tmp_path / side / "test_k.py").write_text(tests)
    ag = A.Against(None, "HEAD", 2, 0.05, 0.0)
    state = types.SimpleNamespace(results={k: {"optimized": types.SimpleNamespace(label="")} for k in kernels},
                                  settings=types.SimpleNamespace(size="smoke", contended=0.05))
    targets = [(_perf_item(tmp_path, f"test_{k}"), k, "optimized") for k in kernels]
    try:
        ag._compare({}, targets, tmp_path / "rev", tmp_path / "this", state, Budget())
    except KeyboardInterrupt:
        ag.interrupted = True
    except WorkerGone as exc:
        ag.problem = str(exc)
    return ag


def test_straddling_rows_are_extended_after_every_rows_planned_pairs_cheapest_first(monkeypatch,
                                                                                   tmp_path: Path) -> None:
    """The rows straddling after their planned pairs are built again and extended once every row has
    had its planned pairs, the cheapest pair first, each told the rows left to extend (itself included);
    a row decided by its planned pairs is not; a row read faster, as a slower one is, is timed again
    on fresh workers before its verdict stands."""
    import types

    import perfgate.against as A
    from perfgate.abrun import Budget

    events, confirmed = [], []
    pair_s = {"k": 2.0, "j": 1.0, "i": 0.5}  # i is decided by its planned pairs

    class Comparer:
        def __init__(self, pool: object, tolerance: float, budget: Budget) -> None:
            self.planned = {}

        def use(self, pool: object) -> None:
            pass

        def build(self, row: A.ABRow, request: dict) -> bool:
            events.append(("build", row.kernel))
            return True

        def build_again(self, row: A.ABRow, fresh: A.ABRow, request: dict) -> bool:
            return self.build(fresh, request)

        def time_row(self, row: A.ABRow) -> bool:  # straddling, but for i
            events.append(("planned", row.kernel))
            self.planned[row.nodeid] = types.SimpleNamespace(pair_s=pair_s[row.kernel])
            row.rev_times, row.this_times, row.contention = [1.0] * 7, [1.0] * 7, 0.0
            row.ratio, row.low, row.high = 1.0, (0.99 if row.kernel == "i" else 0.9), 1.1
            return row.kernel != "i"

        def extension_s(self, rows_left: int = 1) -> float:
            return 10.0

        def extend(self, row: A.ABRow, rows_left: int = 1) -> None:  # this tree 1.14x faster
            events.append(("extend", row.kernel, rows_left))
            row.ratio, row.low, row.high = 1.144, 1.052, 1.438

        def confirm(self, row: A.ABRow) -> None:
            confirmed.append(row.kernel)
            row.confirm_ratio = 1.144

        def drop(self, row: A.ABRow) -> None:
            pass

    ag = _compare_with(monkeypatch, tmp_path, Comparer, "kji")
    assert events == [("build", "k"), ("planned", "k"), ("build", "j"), ("planned", "j"), ("build", "i"),
                      ("planned", "i"), ("build", "j"), ("extend", "j", 2), ("build", "k"), ("extend", "k", 1),
                      ("build", "j"), ("build", "k")]  # the last two: fresh workers, to be timed again
    assert confirmed == ["j", "k"] and [r.outcome for r in ag.rows] == ["faster", "faster", "ok"]


def test_a_straddling_row_this_trees_worker_cannot_build_again_fails_without_being_timed_again(
        monkeypatch, tmp_path: Path) -> None:
    """This tree's worker breaks on the row's second build: FAIL, and no fresh workers are started for a
    verdict the break already fixes."""

    import perfgate.against as A

    builds, confirmed = [], []

    class Comparer(_Straddling):
        def build(self, row: A.ABRow, request: dict) -> bool:
            builds.append(row.kernel)
            if len(builds) > 1:
                row.broken = "this worker 0: MemoryError"
            return len(builds) == 1

        def confirm(self, row: A.ABRow) -> None:
            confirmed.append(row.kernel)

    ag = _compare_with(monkeypatch, tmp_path, Comparer, "k")
    assert builds == ["k", "k"] and confirmed == [] and ag.rows[0].outcome == "FAIL"


def test_a_failure_left_unconfirmed_by_a_ctrl_c_in_the_extensions_says_so(monkeypatch, tmp_path: Path) -> None:
    """Row k fails on its planned pairs and waits to be timed again; Ctrl-C lands while row j, straddling,
    is extended: j is judged on the pairs it has and k's failure stands, each with its note, and nothing
    more is timed."""

    import perfgate.against as A

    events = []

    class Comparer(_Straddling):
        def build(self, row: A.ABRow, request: dict) -> bool:
            events.append(("build", row.kernel))
            return True

        def time_row(self, row: A.ABRow) -> bool:  # k: this tree 1.25x slower, decided; j straddles
            super().time_row(row)
            if row.kernel == "k":
                row.ratio, row.low, row.high = 0.8, 0.75, 0.85
            return row.kernel == "j"

        def extend(self, row: A.ABRow, rows_left: int = 1) -> None:
            events.append(("extend", row.kernel))
            raise KeyboardInterrupt

        def use(self, pool: object) -> None:
            raise AssertionError("fresh workers started after Ctrl-C")

    ag = _compare_with(monkeypatch, tmp_path, Comparer, "kj")
    assert ag.interrupted and events == [("build", "k"), ("build", "j"), ("build", "j"), ("extend", "j")]
    assert ag.rows[0].outcome == "FAIL" and ag.rows[0].confirm_ratio is None
    assert ag.notes == ["j [optimized] stopped being measured further (interrupted): judged on the 7 pairs it has",
                        "k [optimized] was not timed again on fresh workers (interrupted): its first stretch's "
                        "verdict stands, unconfirmed"]


LOST = "stopped being measured further (rev1 died (exit -9)): judged on the 14 pairs it has"


@pytest.mark.parametrize(("case", "extended", "outcome", "notes", "confirmed"), [
    ("REV's worker", (1.02, 0.97, 1.06), "ok", [LOST], []),
    ("REV's worker", (0.8, 0.75, 0.85), "FAIL", [LOST], ["k"]),
    ("REV's last worker", (0.8, 0.75, 0.85), "FAIL",
     [LOST, "was not timed again on fresh workers (every rev worker is gone): its first stretch's verdict stands, "
      "unconfirmed"], []),
    ("this tree's worker", (1.02, 0.97, 1.06), "FAIL", [], []),
], ids=["REV's, within", "REV's, slower", "REV's last, slower", "this tree's"])
def test_a_worker_lost_mid_extension(monkeypatch, tmp_path: Path, case: str, extended: tuple, outcome: str,
                                     notes: list, confirmed: list) -> None:
    """A worker dies while a straddling row is extended, after 7 more pairs. REV's: the row is judged on
    every pair it has (the extension reads them, as after Ctrl-C), with a note, never 'not comparable';
    read slower, it is timed again on fresh workers as any failure, unless that was REV's last worker (the
    phase stops, and the note says it was not timed again). This tree's: FAIL, no note, not timed again."""

    import perfgate.against as A
    from perfgate.workers import WorkerGone

    timed_again = []

    class Comparer(_Straddling):
        def extend(self, row: A.ABRow, rows_left: int = 1) -> None:
            row.rev_times, row.this_times = [1.0] * 14, [1.0] * 14
            row.ratio, row.low, row.high = extended
            who = "this1" if case == "this tree's worker" else "rev1"
            if who == "this1":
                row.broken = "this1 died (exit -9)"  # as Comparer._block sets it
            raise WorkerGone(f"{who} died (exit -9)")

        def confirm(self, row: A.ABRow) -> None:
            timed_again.append(row.kernel)
            row.confirm_ratio = 0.8

    def last_worker_gone(pool: object) -> None:
        raise WorkerGone("every rev worker is gone")

    if case == "REV's last worker":
        monkeypatch.setattr(A, "_check_sides", last_worker_gone)
    ag = _compare_with(monkeypatch, tmp_path, Comparer, "k")
    assert ag.notes == [f"k [optimized] {note}" for note in notes]
    assert A.judge(ag.rows[0], 0.05) == outcome and timed_again == confirmed
    assert ag.problem == ("every rev worker is gone" if case == "REV's last worker" else "")


def test_the_last_rev_worker_lost_in_a_build_stops_the_phase(monkeypatch, tmp_path: Path) -> None:
    """REV's last worker dies while row k is built (Comparer.build reads that as REV unable to run it):
    the phase stops with the problem, so the run cannot pass on rows all 'not comparable'; j is not built."""
    import perfgate.against as A
    from perfgate.workers import WorkerGone

    built, rev_left = [], [1]

    class Comparer(_Straddling):
        def build(self, row: A.ABRow, request: dict) -> bool:
            built.append(row.kernel)
            rev_left[0] = 0
            row.reason = "REV cannot run it: rev0 died (exit -9)"
            return False

    def check_sides(pool: object) -> None:
        if not rev_left[0]:
            raise WorkerGone("every rev worker is gone")

    monkeypatch.setattr(A, "_check_sides", check_sides)
    ag = _compare_with(monkeypatch, tmp_path, Comparer, "kj")
    assert built == ["k"] and ag.problem == "every rev worker is gone" and [r.kernel for r in ag.rows] == ["k"]


def test_a_straddling_row_whose_share_fits_no_pair_stands_on_its_planned_pairs() -> None:
    """No budget left for a pair: the row is not built again, and keeps its planned pairs' interval."""
    import types

    import perfgate.against as A

    class Comparer:
        planned = {"t::k": types.SimpleNamespace(pair_s=2.0)}

        def extension_s(self, rows_left: int = 1) -> float:
            return 1.0

        def build_again(self, row: A.ABRow, fresh: A.ABRow, request: dict) -> bool:
            raise AssertionError("built again with no budget for a pair")

    row = A.ABRow("k", "optimized", "smoke", "t::k", ratio=1.0, low=0.9, high=1.1)
    A.Against(None, "HEAD", 2, 0.05, 0.0)._extend(Comparer(), row, {}, 1)
    assert (row.ratio, row.low, row.high) == (1.0, 0.9, 1.1)


def test_a_straddling_row_that_cannot_be_built_again_is_judged_on_its_planned_pairs_or_fails() -> None:
    """REV's worker cannot build it again: a note, and the planned pairs' interval stands; this tree's worker
    broke on it: a failure, as in the first build."""
    import types

    import perfgate.against as A

    for side, outcome in (("rev", "unresolved"), ("this", "FAIL")):
        class Comparer:
            planned = {"t::k": types.SimpleNamespace(pair_s=1.0)}

            def extension_s(self, rows_left: int = 1) -> float:
                return 10.0

            def build_again(self, row: A.ABRow, fresh: A.ABRow, request: dict, side=side) -> bool:
                row = fresh
                if side == "this":
                    row.broken = "this worker 0: MemoryError"
                else:
                    row.reason = "REV cannot run it: MemoryError"
                return False

        ag = A.Against(None, "HEAD", 2, 0.05, 0.0)
        row = A.ABRow("k", "optimized", "smoke", "t::k", rev_times=[1.0] * 7, this_times=[1.0] * 7,
                      ratio=1.0, low=0.9, high=1.1)
        ag._extend(Comparer(), row, {}, 1)
        assert A.judge(row, 0.05) == outcome, row.message
        assert (len(ag.notes) == 1 and "judged on its planned pairs" in ag.notes[0]) == (side == "rev")


def test_rows_the_phase_did_not_finish_keep_their_reason_or_get_why_it_stopped(monkeypatch,
                                                                               tmp_path: Path) -> None:
    """Every worker of a side gone at the second of three rows: the first keeps its own reason, the
    second and the third, never reached, are not comparable for the phase's problem, once each."""
    import types

    import perfgate.against as A
    from perfgate.checkout import Revision
    from perfgate.workers import WorkerGone

    def compare(self: A.Against, hellos: dict, targets: list, *args: object) -> None:
        self.rows.append(A.ABRow("k", "optimized", "smoke", "t::k", reason="new in this tree"))
        self.rows.append(A.ABRow("j", "optimized", "smoke", "t::j"))  # being timed when the side was lost
        raise WorkerGone("every this worker is gone")

    monkeypatch.setattr(A.Against, "_compare", compare)
    (tmp_path / "scratch").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))  # the session's own scratch folder
    options = {"benchmark_max_time": "1.0", "benchmark_timer": "time.perf_counter", "benchmark_disable_gc": False}
    ag = A.Against(types.SimpleNamespace(rootpath=tmp_path, getoption=options.__getitem__), "HEAD", 2, 0.05, 0.0)
    ag.revision, ag.root, ag.library = Revision(str(tmp_path), folder=tmp_path), tmp_path, ["mylib"]
    ag.items = [_perf_item(tmp_path, name) for name in ("test_k", "test_j", "test_m")]
    settings = types.SimpleNamespace(size="smoke", contended=0.05, extend_s=1.0, all_visits=False, device="cpu",
                                     threads=1, wrap=None, fingerprint={})
    state = types.SimpleNamespace(results={k: {"optimized": None} for k in "kjm"}, settings=settings)
    try:
        ag.run(state)
    finally:
        ag.close()
    assert ag.problem == "every this worker is gone"
    assert [(r.kernel, r.reason) for r in ag.rows] == [("k", "new in this tree"), ("j", ag.problem),
                                                       ("m", ag.problem)]
    assert {r.outcome for r in ag.rows} == {"not comparable"}
    assert list((tmp_path / "scratch").iterdir()) == []


def _phased_pairs(seed: int, pairs: int = 60, slowdown: float = 1.0) -> tuple[Any, Any]:
    """Interleaved pairs on a host with phases, as the A/A runs on the 2-vCPU hosts read (the two
    sides' log block times correlated 0.09-0.85, median 0.5): each pair's two blocks share the host's state (a
    slow phase in 30% of the pairs, 25% slower), and each block has its own heavy-tailed noise
    (Student's t, 3 degrees of freedom, scale 5%); this tree's code ``slowdown`` slower."""
    import numpy as np

    rng = np.random.default_rng(seed)
    phase = np.where(rng.random(pairs) < 0.3, 0.25, 0.0) + rng.normal(0.0, 0.03, pairs)
    rev = np.exp(phase + 0.05 * rng.standard_t(3, pairs))
    this = slowdown * np.exp(phase + 0.05 * rng.standard_t(3, pairs))
    return rev, this


def test_the_pairs_median_ratio_holds_the_truth_and_is_narrower_than_the_ratio_of_medians() -> None:
    """Unchanged code on a phased host, 200 seeded rows of 60 pairs: the sign test's interval of the
    pairs' median ratio misses 1.0 in at most 5% of them (its level), and is narrower than the ratio
    of the two sides' medians with its paired bootstrap in the median row by over a fifth: each
    pair's ratio cancels the phase its two blocks shared, where each side's median keeps it."""
    import numpy as np

    from perfgate.stats import pair_ratio_interval, speedup_interval

    missed, widths = 0, []
    for seed in range(200):
        rev, this = _phased_pairs(seed)
        point, low, high = pair_ratio_interval(rev, this)
        assert low <= point <= high
        missed += not low <= 1.0 <= high
        _, b_low, b_high = speedup_interval(rev, this, paired=True, n_resamples=500)
        widths.append(math.log(high / low) / math.log(b_high / b_low))
    assert missed <= 10, missed
    assert np.median(widths) < 0.8, np.median(widths)


def test_the_pairs_median_ratio_reads_a_slowdown() -> None:
    """A 1.2x slower tree on the phased host: the interval lies wholly beyond the 5% line in
    every one of 20 seeded rows of 60 pairs, its point within 5% of 1 / 1.2."""
    from perfgate.stats import pair_ratio_interval

    for seed in range(20):
        point, _, high = pair_ratio_interval(*_phased_pairs(seed, slowdown=1.2))
        assert high < 1 / 1.05
        assert point == pytest.approx(1 / 1.2, rel=0.05)


def test_the_pairs_median_ratio_is_unbounded_on_too_few_pairs_and_refuses_unequal_counts() -> None:
    from perfgate.stats import pair_ratio_interval

    assert pair_ratio_interval([1.0, 2.0, 1.5, 1.2, 1.1], [1.0, 1.0, 1.0, 1.0, 1.0])[1:] == (0.0, math.inf)
    with pytest.raises(ValueError, match="equal, nonzero counts"):
        pair_ratio_interval([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="equal, nonzero counts"):
        pair_ratio_interval([], [])


def test_the_units_widen_any_statistic_of_the_pairs_alike() -> None:
    """``clustered_interval(base=...)`` (the replay of the statistic the A/B read before): the
    units' offsets add the same variance to either statistic's interval, and with nothing to tell
    units from pairs it is that statistic's own interval."""
    import numpy as np

    from perfgate.stats import clustered_interval, pair_ratio_interval, speedup_interval

    def medians(rev: Any, this: Any, confidence: float) -> tuple[float, float, float]:
        return speedup_interval(rev, this, confidence, paired=True)

    rng = np.random.default_rng(3)
    units = rng.integers(0, 4, 80)
    rev = np.exp(rng.normal(0.0, 0.1, 80))
    this = np.exp(rng.normal(0.0, 0.1, 80) + np.where(units < 2, 0.1, 0.0))  # two of this tree's units 10% off
    added = []
    for base in (pair_ratio_interval, medians):
        point, low, high = base(rev, this, 0.95)
        wide = clustered_interval(rev, this, np.arange(80), units, base=base)
        assert wide[0] == point and wide[1] < low and wide[2] > high
        added.append(math.log(wide[2] / point) ** 2 - math.log(high / point) ** 2)
        one = np.zeros(80, dtype=int)
        assert clustered_interval(rev, this, np.arange(80), one, base=base) == pytest.approx((point, low, high))
    assert added[0] == pytest.approx(added[1], rel=1e-9) and added[0] > 0


def test_too_few_pairs_stay_unbounded_whatever_the_units() -> None:
    """5 pairs give the sign test no 95% bound; units 30% apart widen nothing into a bound."""
    from perfgate.stats import clustered_interval

    rev, this = [1.0, 1.1, 0.9, 1.3, 1.3], [1.0, 1.0, 1.0, 1.3, 1.3]
    _, low, high = clustered_interval(rev, this, [0, 0, 0, 1, 1], [0, 0, 0, 1, 1])
    assert (low, high) == (0.0, math.inf)


WORKER_HEAP = """
import ctypes, json, shutil, sys
from perfgate.abworker import Hello, Worker

worker = Worker(Hello(side="this", root=sys.argv[1], library=(), device="cpu", size="smoke", threads=None,
                      malloc=sys.argv[2], scratch=sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def call():  # a call's 1 MiB temporary: where the heap puts it
    p = libc.malloc(1 << 20)
    libc.free(p)
    return p

shifted = [worker.timer.rounds((call, None), 3)[1] for _ in range(30)]
shift, worker.timer.shift = worker.timer.shift, None
unshifted = [worker.timer.rounds((call, None), 3)[1] for _ in range(30)]
shutil.rmtree(worker.tmp)
print(json.dumps({"malloc": worker.malloc, "shift": shift is not None,
                  "shifted": len(set(shifted)), "unshifted": len(set(unshifted))}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap (the cache malloc mode)")
def test_a_workers_blocks_land_at_another_place_of_the_heap_each(tmp_path: Path) -> None:
    """Under the cache malloc mode a worker's timer holds a spacer of random size over each block
    (timing.HeapShift), so a call's buffers land at another place of the heap each block, not where
    the worker's heap happened to put them for its whole life; without it they land at one place.
    Under glibc's default mode there is no spacer (past the mmap threshold it would be mapped apart
    and move nothing)."""
    def run(malloc: str) -> dict:
        done = subprocess.run([sys.executable, "-c", WORKER_HEAP, str(tmp_path), malloc],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    cache = run("cache")
    assert cache["malloc"] == "cache" and cache["shift"]
    assert cache["unshifted"] == 1  # the same place block after block: the lasting layout
    assert cache["shifted"] >= 20  # of 30 blocks, each at its own place
    default = run("default")
    assert default["malloc"] == "default" and not default["shift"]


def test_a_worker_adds_copies_only_while_the_hosts_memory_holds_them(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """Every copy of every worker is alive at once: a worker adds a copy only while one more as large
    as its last fits beside a first copy for each worker still to build and MEMORY_RESERVE (at 4 workers
    a side a 24 GB host ran out of memory building adamw_bandwidth's 0.8 GB copies, 3 a worker). Its
    first copy is always built; unread memory limits nothing."""
    import types

    from perfgate import abworker, timing

    gib, reserve = 1 << 30, abworker.MEMORY_RESERVE
    assert abworker.copy_fits(gib, 3, 2 * gib, available=7 * gib + reserve)
    assert not abworker.copy_fits(gib, 3, 2 * gib, available=7 * gib + reserve - 1)
    module = tmp_path / "rowmod.py"
    module.write_text("def test_row():\n    pass\n")
    host = {"rss": gib, "available": 4 * gib + reserve}

    def build_one(*args: object) -> tuple[object, dict]:  # a copy holds 1 GiB of the host's memory
        host["rss"] += gib
        host["available"] -= gib
        return object(), {"first_s": 0.0, "warm_s": 0.0}

    monkeypatch.setattr(timing, "proc_status_bytes", lambda key: host["rss"])
    monkeypatch.setattr(timing, "available_memory", lambda: host["available"])
    worker = types.SimpleNamespace(rows={}, _build_one=build_one)

    def build(others: int) -> dict:
        return abworker.Worker.build(worker, "row", "rowmod", str(module), "test_row", {}, "k", "optimized",
                                     builds=3, build_s=math.inf, others=others)

    # 2 workers to build after this one, each to grow by a first copy's 1 GiB: one more copy needs
    # 3 GiB beside the reserve; 3 GiB are left after the first copy, 2 after the second
    assert build(others=2) == {"first_s": 0.0, "warm_s": 0.0, "builds": 2}
    assert len(worker.rows["row"]) == 2
    host["available"] = 4 * gib + reserve
    assert build(others=0)["builds"] == 3  # the last worker to build: room for all three
    host["available"] = 0
    assert build(others=0)["builds"] == 1  # no room: the first copy only, as a worker must time one
    monkeypatch.setattr(timing, "available_memory", lambda: None)
    assert build(others=7)["builds"] == 3  # unread: as before
