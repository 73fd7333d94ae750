"""The perf gate's own tests: pytester runs small suites whose speedups are known by design.

The timed callables sleep, so their ratio is set by the test, not by the machine's noise:
reference 8 ms against optimized 2 ms is a 4x pair.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from perfgate import fidelity
from perfgate.fingerprint import slug
from perfgate.report import main as report_main
from perfgate.stats import SpeedupRow, decided, gate, imprecise, loose_baseline, speedup_interval

pytestmark = pytest.mark.paced  # perf sessions whose timed calls sleep: one a core (make correctness)

SUITE = """
import time
import pytest

SLEEP = {{"reference": 0.008, "optimized": {opt}}}

@pytest.mark.speedup(cpu={floor}, cuda={floor})
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_sleepy(perf, impl):
    perf(lambda: time.sleep(SLEEP[impl]), label="8ms")
"""
# --perf-contended=inf: these suites test the rules on speedups set by design; a busy CI host must
# not turn their designed failures unresolved (test_contention.py tests that rule)
FAST = ["--perf-device", "cpu", "--benchmark-max-time=0.15", "--benchmark-min-rounds=12", "-p", "no:cacheprovider",
        "--perf-contended=inf"]


PAIR = """
import time
from pathlib import Path
import pytest

@pytest.mark.speedup(cpu={floor})
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_{name}(perf, impl):
    {call}
"""


def _pair(pytester: pytest.Pytester, name: str, floor: float, call: str) -> None:
    """A one-off perf pair whose body is ``call`` (``impl`` in scope)."""
    pytester.makepyfile(**{f"test_{name}": PAIR.format(name=name, floor=floor, call=call)})


def _suite(pytester: pytest.Pytester, opt: float = 0.002, floor: float = 2.0) -> None:
    pytester.makepyfile(test_pair=SUITE.format(opt=opt, floor=floor))


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*FAST, *args)


def _saved(pytester: pytest.Pytester) -> list[Path]:
    return sorted((pytester.path / ".benchmarks").rglob("*.json"))


def test_pair_with_known_speedup_passes(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    result = _run(pytester, "--benchmark-json=out.json")
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*perfgate speedups*", "*sleepy*optimized*8ms*cpu*2.00x*ok*",
                                 "*--benchmark-save=NAME*", "*gate passed*"])
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert 3.2 < row["speedup"] < 4.3 and row["low"] <= row["speedup"] <= row["high"]
    assert row["floor"] == 2.0 and row["failures"] == []
    if os.access("/proc/self/clear_refs", os.W_OK):  # Linux: the CPU peak measure exists
        assert row["reference_peak_bytes"] is not None


def test_slowed_optimized_side_fails_the_session(pytester: pytest.Pytester) -> None:
    _suite(pytester, opt=0.008)  # the "optimization" lost: 1x against a 2x floor
    result = _run(pytester)
    result.assert_outcomes(passed=2)  # each benchmark ran; the gate fails the session
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*GATE FAILED: sleepy [[]optimized, 8ms] on cpu: speedup *x (95% CI *, "
                                 "* interleaved pairs) is under the floor 2.00x (the whole interval is)*"])
    # the verdict comes after pytest-benchmark's tables: a CI log's tail shows it
    out = result.stdout.str()
    assert out.rindex("benchmark 'sleepy': 2 tests") < out.index("perfgate speedups") < out.rindex("GATE FAILED")


def test_rerun_against_saved_baseline_passes(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    assert _run(pytester, "--benchmark-save=base").ret == 0
    [saved] = _saved(pytester)
    section = json.loads(saved.read_text())["perfgate"]
    assert (saved.parent.parent.parent.name, saved.parent.parent.name) == (section["slug"], "smoke")
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*compared against baseline*", "*gate passed*"])


def test_speedup_fallen_under_baseline_fails(pytester: pytest.Pytester) -> None:
    # 2x: above the floor, half the baseline's 4x and, as the rule asks, under its interval's lower
    # bound, which the save measured to within 10% of its point (stats.imprecise)
    _suite(pytester, floor=1.5)
    assert _run(pytester, "--benchmark-save=base").ret == 0
    _suite(pytester, opt=0.004, floor=1.5)
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*GATE FAILED*fell more than 20% under the stored baseline's*"])
    assert _run(pytester, "--benchmark-compare", "--perf-tolerance=0.75").ret == 0  # 2x over 4x less 75%


JITTERY = """
import random
import time
import pytest

JITTER = random.Random(0)

@pytest.mark.speedup(cpu=0.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_jittery(perf, impl):
    # the optimized side takes 0.5 to 3.5 ms a call at random: a 2x row whose few first pairs read wide,
    # over a floor no pair misses (a sleep a busy 2-vCPU guest overshoots to 7 ms still reads 0.55x)
    perf(lambda: time.sleep(0.004 if impl == "reference" else 0.0005 * (1 + 6 * JITTER.random())), label="4ms")
"""


def test_a_saved_baseline_is_timed_until_its_interval_is_narrow_enough_to_gate(pytester: pytest.Pytester) -> None:
    """A row the session saves is timed further until its interval lies within half the tolerance
    of its speedup (``stats.imprecise``): a wide baseline would shield a later run's drop (its low)
    or misplace the machine's level (its point). Unsaved, the same row stops once its floor is met."""
    pytester.makepyfile(test_jittery=JITTERY)

    def row(*args: str) -> dict:
        assert _run(pytester, "--benchmark-json=out.json", *args).ret == 0
        return json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]

    plain = row()
    assert plain["extended"] == 0 and not plain["tightened"]
    saved = row("--benchmark-save=base")
    assert saved["tightened"] and saved["extended"] > 0, saved
    assert 0.9 * saved["speedup"] <= saved["low"] <= saved["high"] <= 1.1 * saved["speedup"], saved
    assert saved["rounds"][0] > plain["rounds"][0]


def test_a_compare_names_the_baseline_rows_saved_loose(pytester: pytest.Pytester) -> None:
    """A baseline row whose interval reaches more than half the tolerance under its speedup (saved
    by a perfgate that did not measure saves precise, or past --perf-extend's budget) shields a
    drop down to that low: the compare names it; a precise one is not named."""
    _suite(pytester)
    assert _run(pytester, "--benchmark-save=base").ret == 0
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == 0 and "catch less" not in result.stdout.str()
    [saved] = _saved(pytester)
    data = json.loads(saved.read_text())
    row = data["perfgate"]["speedups"][0]
    row["low"] = 0.5 * row["speedup"]
    saved.write_text(json.dumps(data))
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["1 gated row(s) of that baseline have an interval reaching more than 10% under "
                                 "their speedup: sleepy [[]optimized] *x (from *x); a drop must clear that low*"])


def test_imprecise_is_half_the_tolerance_either_side_and_never_a_peers() -> None:
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=4.0, low=3.6, high=4.4, rounds=(9, 9))
    assert not imprecise(row, 0.2)  # 4.0 +- 10%
    row.low = 3.59
    assert imprecise(row, 0.2) and not imprecise(row, 0.3)
    row.low, row.high = 3.6, 4.41
    assert imprecise(row, 0.2)
    assert decided(row, 0.2) and not decided(row, 0.2, saving=True)  # no rule applies, but it is saved
    row.peer = True  # a peer's row is reported, never gated by a baseline
    assert not imprecise(row, 0.2) and decided(row, 0.2, saving=True)
    row.peer, row.baseline, row.baseline_low = False, 5.0, 4.5  # a stored baseline's low within 10%
    assert not loose_baseline(row, 0.2)
    row.baseline_low = 4.49
    assert loose_baseline(row, 0.2) and not loose_baseline(row, 0.3)
    row.peer = True
    assert not loose_baseline(row, 0.2)


def test_baseline_from_another_fingerprint_is_refused(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    assert _run(pytester, "--benchmark-save=base").ret == 0
    [saved] = _saved(pytester)
    data = json.loads(saved.read_text())
    data["machine_info"]["perfgate"]["device_name"] = "Some Other CPU"
    other = pytester.path / "other.json"
    other.write_text(json.dumps(data))
    result = _run(pytester, f"--benchmark-compare={other}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*refuses to compare against a baseline from another machine fingerprint*"])


@pytest.mark.parametrize("damage", ["truncated", "fields", "interrupted"])
def test_a_damaged_stored_run_is_named_not_skipped_or_crashed_on(pytester: pytest.Pytester, damage: str) -> None:
    """A newest baseline cut short (pytest-benchmark skips it with a warning and compares against
    the older one), missing its rows' fields (pytest-benchmark's compare stopped with an
    INTERNALERROR), or saved by an interrupted session: a usage error naming the file."""
    _suite(pytester)
    assert _run(pytester, "--benchmark-save=old").ret == 0
    assert _run(pytester, "--benchmark-save=new").ret == 0
    newest = _saved(pytester)[-1]
    text = newest.read_text()
    data = json.loads(text)
    if damage == "truncated":
        newest.write_text(text[: len(text) // 2])
    elif damage == "fields":
        for row in data["perfgate"]["speedups"]:
            del row["speedup"]
        newest.write_text(json.dumps(data))
    else:
        data["perfgate"]["interrupted"] = True
        newest.write_text(json.dumps(data))
    why = {"truncated": "not readable as JSON", "fields": "speedup row 0 has no valid 'speedup'",
           "interrupted": "saved by an interrupted session"}[damage]
    for args in (["--benchmark-compare"], ["--perf-shard", "1/1"]):  # the shard plan reads the newest too
        result = _run(pytester, *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, args
        result.stderr.fnmatch_lines([f"*{newest.name}: {why}*", "*Restore it*or move it out of*"])
    other = pytester.path / "elsewhere.json"  # given by path, outside the storage
    newest.rename(other)
    result = _run(pytester, f"--benchmark-compare={other}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*elsewhere.json: {why}*"])


INTERRUPTED = """
import time
import pytest

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_sleepy(perf, impl):
    perf(lambda: time.sleep(0.004 if impl == "reference" else 0.002))

def test_zz_ctrl_c():
    raise KeyboardInterrupt
"""


def test_an_interrupted_session_saves_no_baseline(pytester: pytest.Pytester) -> None:
    """Ctrl-C after the pairs ran: nothing saved to the storage, the JSON marked interrupted (and a
    copy of it refused as a baseline, above)."""
    pytester.makepyfile(test_int=INTERRUPTED)
    # in a subprocess: an inline run would hand the KeyboardInterrupt to this session
    result = pytester.runpytest_subprocess(*FAST, "--benchmark-save=partial", "--benchmark-json=out.json")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert _saved(pytester) == []
    assert json.loads((pytester.path / "out.json").read_text())["perfgate"]["interrupted"] is True
    result.stdout.fnmatch_lines(["*interrupted: nothing saved as a baseline*"])
    pytester.makepyfile(test_int=INTERRUPTED.replace("raise KeyboardInterrupt", "pass"))
    assert _run(pytester, "--benchmark-save=whole").ret == 0  # the same suite, not interrupted: saved
    [saved] = _saved(pytester)
    assert json.loads(saved.read_text())["perfgate"]["interrupted"] is False


def test_an_impl_timed_before_its_reference_is_paired_once_it_runs(pytester: pytest.Pytester) -> None:
    """A parametrize list that does not start with the reference (or --ff): the impl's pairs are
    timed when the reference has run, so its row is interleaved like any other (it was judged on
    two unpaired runs, with no second look at a failure)."""
    pytester.makepyfile(test_pair=SUITE.format(opt=0.002, floor=2.0).replace('["reference", "optimized"]',
                                                                             '["optimized", "reference"]'))
    result = _run(pytester, "--benchmark-json=out.json")
    assert result.ret == 0, result.stdout.str()
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert row["interleaved"] and 3.2 < row["speedup"] < 4.3, row


def test_a_failing_session_saves_no_baseline(pytester: pytest.Pytester) -> None:
    """A run that misses its floor is not saved (pytest-benchmark saved it before the gate's failure
    was counted, and the next --benchmark-compare judged against the regressed speedups); nor is
    one whose tests fail. The same suite, passing, is saved."""
    _suite(pytester, opt=0.008)  # 1x against a 2x floor
    result = _run(pytester, "--benchmark-save=regressed")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _saved(pytester) == []
    result.stdout.fnmatch_lines(["*the session failed: nothing saved as a baseline*"])
    _suite(pytester)
    pytester.makepyfile(test_broken="def test_broken():\n    assert False\n")
    assert _run(pytester, "--benchmark-save=broken").ret == pytest.ExitCode.TESTS_FAILED
    assert _saved(pytester) == []
    (pytester.path / "test_broken.py").unlink()
    assert _run(pytester, "--benchmark-save=whole").ret == 0
    assert len(_saved(pytester)) == 1


def test_report_names_and_skips_a_bad_file(pytester: pytest.Pytester, capsys) -> None:
    _suite(pytester)
    assert _run(pytester, "--benchmark-save=one").ret == 0
    bad = _saved(pytester)[0].parent / "0002_bad.json"
    bad.write_text("{not json")
    os.chdir(pytester.path)  # the report reads .benchmarks/ under the working folder
    assert report_main([]) == 0
    captured = capsys.readouterr()
    skipped = f"skipping {bad.relative_to(pytester.path)}: not readable as JSON"
    assert "sleepy" in captured.out and skipped in captured.err


MEMORY = """
import time
import pytest

MIB = {{"reference": 96, "optimized": {opt_mib}}}

@pytest.mark.memory(cpu={floor}, cuda={floor})
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_hungry(perf, impl):
    def call():
        buf = bytearray(MIB[impl] * 2**20)  # zero-filled: every page touched
        time.sleep(0.002)
        return len(buf)
    perf(call, label="alloc")
"""


def test_memory_floor_is_gated(pytester: pytest.Pytester) -> None:
    """96 MiB against 12 MiB saves 87.5%: a 50% floor passes, a 95% floor fails."""
    pytester.makepyfile(test_mem=MEMORY.format(opt_mib=12, floor=0.5))
    result = _run(pytester, "--benchmark-json=out.json")
    assert result.ret == 0, result.stdout.str()
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert 0.08 < row["memory_ratio"] < 0.2 and row["memory_floor"] == 0.5
    result.stdout.fnmatch_lines(["*hungry*optimized*alloc*8?% (>=50%)*ok*"])
    pytester.makepyfile(test_mem=MEMORY.format(opt_mib=12, floor=0.95))
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*GATE FAILED: hungry*saved 8*% of the reference*under the floor 95%"])


def test_memory_grown_over_baseline_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mem=MEMORY.format(opt_mib=12, floor=0.3))
    assert _run(pytester, "--benchmark-save=base").ret == 0
    # saves 62.5%: over the floor, more than 20% under 87.5% (read a few stray pages either side of it)
    pytester.makepyfile(test_mem=MEMORY.format(opt_mib=36, floor=0.3))
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*GATE FAILED: hungry*saved 6?.?% of the reference's peak memory, more than 20% "
                                 "under the stored baseline's 8?.?%*"])


@pytest.mark.parametrize("select", [(), ("-k", "reference")])
def test_memory_floor_must_be_a_fraction(pytester: pytest.Pytester, select: tuple[str, ...]) -> None:
    """A malformed marker is a usage error at collection, before anything is timed, also where
    -k leaves the impl it is about out."""
    pytester.makepyfile(test_mem=MEMORY.format(opt_mib=12, floor=70))
    result = _run(pytester, *select)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_hungry*: a memory floor is a fraction saved in [[]0, 1), got 70*"])
    assert "perfgate speedups" not in result.stdout.str()


def test_first_run_without_baseline_passes_with_hint(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*no stored baseline compared*--benchmark-save=NAME*"])


def test_declared_work_gives_a_throughput_ratio(pytester: pytest.Pytester) -> None:
    """Same time, twice the bytes: a 2x throughput ratio, and GB/s in the JSON."""
    _pair(pytester, "stream", 1.5,
          'perf(lambda: time.sleep(0.004), work_bytes=4e6 if impl == "reference" else 8e6)')
    assert _run(pytester, "--benchmark-json=out.json").ret == 0
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert 1.8 < row["speedup"] < 2.2
    assert 0.8 < row["reference_gbps"] < 1.0 and 1.6 < row["optimized_gbps"] < 2.0


PEERS = """
import time
import pytest

SLEEP = {{"reference": 0.012, "optimized": {opt}, "peer": {peer}}}

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.speedup(cpu={floor}, over="peer")
@pytest.mark.parametrize("impl", ["reference", {order}])
def test_sleepy(perf, impl):
    perf(lambda: time.sleep(SLEEP[impl]), label="12ms")
"""


@pytest.mark.parametrize("order", ['"optimized", "peer"', '"peer", "optimized"',
                                   '"optimized", pytest.param("peer")'])
def test_speedup_over_a_peer_is_timed_against_it_and_gated(pytester: pytest.Pytester, order: str) -> None:
    """A speedup(over=) row pairs the two impls directly, whichever ran first, and is gated by its floor."""
    pytester.makepyfile(test_peers=PEERS.format(opt=0.002, peer=0.006, floor=2.0, order=order))
    result = _run(pytester, "--benchmark-json=out.json")
    assert result.ret == 0, result.stdout.str()
    rows = {r["impl"]: r for r in json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"]}
    assert set(rows) == {"optimized", "peer", "optimized vs peer"}
    row = rows["optimized vs peer"]
    assert 2.5 < row["speedup"] < 3.3 and row["interleaved"] and row["floor"] == 2.0
    assert 5.0 < row["reference_ms"] < 8.0 and 1.5 < row["optimized_ms"] < 3.0  # the peer's side, ours
    result.stdout.fnmatch_lines(["*sleepy*optimized vs peer*12ms*ok*", "*gate passed*"])

    # the peer caught up
    pytester.makepyfile(test_peers=PEERS.format(opt=0.002, peer=0.002, floor=2.0, order=order))
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*GATE FAILED: sleepy [[]optimized vs peer, 12ms]*under the floor 2.00x*"])


def test_rows_about_a_peer_are_not_gated_by_the_baseline(pytester: pytest.Pytester) -> None:
    """A peer that got faster or slower since the baseline moves its rows (the peer's over the
    reference, ours over the peer) without failing the session; ours over the reference is gated."""
    order = '"optimized", "peer"'
    pytester.makepyfile(test_peers=PEERS.format(opt=0.002, peer=0.006, floor=0.1, order=order))
    assert _run(pytester, "--benchmark-save=base").ret == 0  # ours 6x, the peer 2x, ours over it 3x
    for peer in (0.002, 0.024):  # the peer caught up (ours over it 1x), then fell behind (it: 0.5x)
        pytester.makepyfile(test_peers=PEERS.format(opt=0.002, peer=peer, floor=0.1, order=order))
        result = _run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(["*sleepy*optimized vs peer*(peer, not gated)*ok*", "*gate passed*"])
        rows = {r["impl"]: r for r in json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"]}
        moved = rows["optimized vs peer"] if peer == 0.002 else rows["peer"]
        assert moved["peer"] and moved["speedup"] < 0.5 * moved["baseline"]
    pytester.makepyfile(test_peers=PEERS.format(opt=0.005, peer=0.006, floor=0.1, order=order))  # ours lost
    result = _run(pytester, "--benchmark-compare")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*GATE FAILED: sleepy [[]optimized, 12ms]*under the stored baseline's*"])
    assert "GATE FAILED: sleepy [optimized vs peer" not in result.stdout.str()


def test_blas_and_openmp_pools_run_at_the_sessions_threads(pytester: pytest.Pytester) -> None:
    """numpy's BLAS pool (a peer like scikit-learn runs on it) is pinned to --perf-threads while
    impls are timed, and given back its thread count after the session."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    before = [p["num_threads"] for p in threadpoolctl.threadpool_info()]
    _pair(pytester, "pools", 0.1, "import json, threadpoolctl\n    "
          "perf(lambda: time.sleep(0.002))\n    "
          "Path(impl).write_text(json.dumps([p['num_threads'] for p in threadpoolctl.threadpool_info()]))")
    assert _run(pytester, "--perf-threads=1").ret == 0
    for impl in ("reference", "optimized"):
        pools = json.loads((pytester.path / impl).read_text())
        assert pools and set(pools) == {1}, pools  # numpy's OpenBLAS is loaded here: at least one pool
    assert [p["num_threads"] for p in threadpoolctl.threadpool_info()] == before


def test_speedup_over_an_impl_the_test_lacks_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_peers=PEERS.format(opt=0.002, peer=0.006, floor=2.0, order='"optimized", "peeer"'))
    result = _run(pytester)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*speedup(impl='optimized', over='peer') names 'peer', which is not one of "
                                 "the test's impls*"])


def test_perf_test_without_impl_param_fails_clearly(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(perf):\n    perf(lambda: None)\n")
    result = _run(pytester)
    result.assert_outcomes(errors=1)  # raised in the fixture's setup
    result.stdout.fnmatch_lines(["*must be parametrized over 'impl'*"])


def test_benchmark_disable_runs_once_and_says_the_gate_did_not_run(pytester: pytest.Pytester) -> None:
    _pair(pytester, "counted", 1000.0, 'perf(lambda: Path(impl).open("a").write("x"))')
    result = _run(pytester, "--benchmark-disable")
    assert result.ret == 0
    result.assert_outcomes(passed=2)
    # disabled: one call, nothing sized or timed, and the fixture counts as used
    assert (pytester.path / "optimized").read_text() == "x"
    assert "was not used at all" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*2 perf call(s) ran once with benchmarks disabled*the gate did not run*"])


def test_benchmark_only_selects_perf_tests(pytester: pytest.Pytester) -> None:
    _suite(pytester, opt=0.008)
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = _run(pytester, "--benchmark-only")
    result.assert_outcomes(passed=2, skipped=1)  # the perf pair runs and is gated
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_two_tests_with_one_kernel_name_are_refused(pytester: pytest.Pytester) -> None:
    body = SUITE.format(opt=0.002, floor=2.0)
    pytester.makepyfile(test_a=body, test_b=body)
    result = _run(pytester)
    result.stdout.fnmatch_lines(["*two perf tests measure sleepy [[]reference]*rename one*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_baseline_of_another_size_is_not_compared(pytester: pytest.Pytester) -> None:
    _suite(pytester, floor=1.5)
    assert _run(pytester, "--benchmark-save=base", "--perf-size=full").ret == 0
    _suite(pytester, opt=0.004, floor=1.5)  # half the full-size baseline's speedup
    result = _run(pytester, "--benchmark-compare", "--perf-size=smoke")
    assert result.ret == 0  # baselines are stored per size: none at smoke
    result.stdout.fnmatch_lines(["*no stored baseline compared*"])
    other = next(iter(_saved(pytester)))  # pointing at the full-size file explicitly: no rows match
    result = _run(pytester, f"--benchmark-compare={other}", "--perf-size=smoke")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*compared against baseline*0 of 1 row(s) have a stored speedup at size smoke*"])


def test_unavailable_device_is_a_usage_error(pytester: pytest.Pytester) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    _suite(pytester)
    result = pytester.runpytest("--perf-device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no CUDA device is available*"])


def test_report_prints_table_and_draws_chart(pytester: pytest.Pytester, capsys) -> None:
    _suite(pytester)
    assert _run(pytester, "--benchmark-json=a.json").ret == 0
    assert _run(pytester, "--benchmark-json=b.json").ret == 0
    png = pytester.path / "chart.png"
    code = report_main([str(pytester.path / "a.json"), str(pytester.path / "b.json"), "--png", str(png)])
    assert code == 0
    out = capsys.readouterr().out
    assert "sleepy" in out and "speedup" in out and "floor" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speedup_interval_covers_the_true_ratio() -> None:
    rng = np.random.default_rng(0)
    ref, opt = 4.0 + rng.normal(0, 0.1, 30), 1.0 + rng.normal(0, 0.03, 30)
    point, low, high = speedup_interval(ref, opt)
    assert low < 4.0 < high and low <= point <= high and high - low < 0.3
    with pytest.raises(ValueError, match="at least 2 rounds"):
        speedup_interval([1.0], [1.0, 2.0])


@pytest.mark.parametrize("n, confidence, k", [(4, 0.99, 0), (7, 0.99, 0), (8, 0.99, 1), (5, 0.95, 0), (6, 0.95, 1),
                                               (7, 0.95, 1), (10, 0.95, 2), (20, 0.95, 6), (40, 0.95, 14)])
def test_paired_intervals_hold_the_sign_test_s(n: int, confidence: float, k: int) -> None:
    """Interleaved pairs' interval reaches at least the k-th lowest and k-th highest pair ratio,
    k the sign test's (P(Binomial(n, 1/2) < k) within the tail): on a few pairs a percentile
    bootstrap reads inside them, and under 6 pairs (95%) or 8 (99%) no k exists: unbounded."""
    from scipy import stats

    tail = (1.0 - confidence) / 2.0
    assert stats.binom.cdf(k - 1, n, 0.5) <= tail < stats.binom.cdf(k, n, 0.5)  # the table's k is the sign test's
    for seed in range(20):
        rng = np.random.default_rng(seed)
        common = rng.normal(0.0, 0.1, n)
        ref, opt = 3.0 * np.exp(common + rng.normal(0.0, 0.05, n)), np.exp(common + rng.normal(0.0, 0.05, n))
        _, low, high = speedup_interval(ref, opt, confidence, paired=True)
        ratios = np.sort(ref / opt)
        if k == 0:
            assert (low, high) == (0.0, math.inf)
        else:
            assert low <= ratios[k - 1] and high >= ratios[n - k]


BAD_CALL = """
import pytest
nan = float("nan")

@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("bad", {bad})
def test_bad(perf, impl, bad):
    perf(lambda: None, **bad)
"""


def test_perf_arguments_are_refused_by_name_before_anything_is_timed(pytester: pytest.Pytester) -> None:
    """work_bytes scales a row's speedup and interval, so a NaN would pass any floor: it, and the
    round counts and callables, are refused with the argument's name."""
    bad = [{"work_bytes": float("nan")}, {"work_bytes": 0}, {"work_bytes": True}, {"work_bytes": "1e6"},
           {"rounds": 0}, {"rounds": 2.5}, {"warmup_rounds": -1}, {"setup": 3}]
    pytester.makepyfile(test_bad=BAD_CALL.format(bad=repr(bad)))
    result = _run(pytester, "-p", "no:randomly")
    result.assert_outcomes(failed=2 * len(bad))
    out = result.stdout.str()
    for name in ("work_bytes", "rounds", "warmup_rounds", "setup"):
        assert f"perf({name}=...) must be" in out
    assert "GATE FAILED" not in out


def test_a_speedup_from_no_time_fails() -> None:
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu",
                     reference_ms=4.0, optimized_ms=1.0, speedup=float("nan"), low=0.0, high=float("inf"),
                     rounds=(9, 9), floor=2.0)
    assert gate(row, 0.2) and row.outcome == "FAIL" and "finite times > 0" in row.failures[0]


def test_a_speedup_from_a_zero_time_fails() -> None:
    """A reference timed at 0 ms gives no speedup: the row fails, floor or not."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu",
                     reference_ms=0.0, optimized_ms=1.0, speedup=0.0, low=0.0, high=0.0, rounds=(9, 9))
    assert gate(row, 0.2) and row.outcome == "FAIL" and "finite times > 0" in row.failures[0]


def test_gate_rules() -> None:
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu",
                     reference_ms=4.0, optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9))
    assert gate(row, 0.2) == [] and row.outcome == "ok"
    row.floor = 3.5  # the interval reaches the floor: met
    assert gate(row, 0.2) == [] and row.outcome == "ok"
    row.floor = 3.6  # straddled: no evidence either way, not a failure
    assert gate(row, 0.2) == [] and row.straddles_floor and row.outcome == "unresolved"
    assert "straddles the floor 3.60x" in row.unresolved[0]
    row.floor = 4.6  # the whole interval under the floor: evidence of a miss
    assert "is under the floor 4.60x" in gate(row, 0.2)[0] and row.outcome == "FAIL" and not row.unresolved
    row.floor, row.baseline = 3.0, 5.7  # 4.0 < 0.8 x 5.7 = 4.56, and high 4.5 < 5.7
    assert "fell more than 20%" in gate(row, 0.2)[0]
    row.baseline = 4.9  # the interval is under 4.9, but 4.0 is not 20% under it (3.92)
    assert gate(row, 0.2) == []
    assert row.outcome == "ok"
    row.baseline, row.high = 5.1, 5.2  # 20% under (4.08), but the interval reaches 5.1: straddled
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"
    assert "more than 20% under the stored baseline's 5.10x, but its interval reaches" in row.unresolved[0]
    row.baseline, row.baseline_low, row.high = 5.7, 4.4, 4.5  # 20% under, but the baseline's interval
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"  # reaches this one: either run's noise
    assert "reaches the baseline's (4.40x and up)" in row.unresolved[0]
    row.baseline_low = 4.6
    assert "under the baseline's, 4.60x and up" in gate(row, 0.2)[0]
    row.peer = True  # a row about a peer library: its baseline is reported, not gated
    assert gate(row, 0.2) == []
    row.peer, row.baseline, row.baseline_low, row.high = False, 4.9, None, 4.5
    row.memory_floor = 0.3
    assert gate(row, 0.2) == []  # no peak on this platform: reported unmeasured, not failed
    row.reference_peak_bytes, row.optimized_peak_bytes = 0, 0
    assert "measured 0 bytes" in gate(row, 0.2)[0]
    row.reference_peak_bytes, row.optimized_peak_bytes = 100, 80  # saves 20%
    assert "under the floor 30%" in gate(row, 0.2)[0]
    row.optimized_peak_bytes = 59  # saves 41%
    assert gate(row, 0.2) == []
    row.memory_baseline = 0.4  # the baseline saved 60%: 41% < 0.8 x 60%
    assert "more than 20% under the stored baseline's 60.0%" in gate(row, 0.2)[0]
    row.memory_baseline, row.memory_floor = 0.4, None  # rows without a memory floor are not memory-gated
    assert gate(row, 0.2) == []


def test_an_interval_whose_high_is_the_floor_straddles_it() -> None:
    """An interval whose high is the floor (``low < floor <= high``) straddles it: neither met nor missed."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu",
                     reference_ms=4.0, optimized_ms=1.5, speedup=2.7, low=2.5, high=3.0, rounds=(9, 9), floor=3.0)
    assert gate(row, 0.2) == [] and row.straddles_floor and row.outcome == "unresolved"


def test_a_speedup_exactly_the_tolerance_under_its_baseline_has_not_fallen_more() -> None:
    """A speedup at (1 - tolerance) x the baseline has not fallen more than the tolerance: no failure."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=4.0, low=3.8, high=4.2, rounds=(9, 9), baseline=5.0,
                     baseline_low=4.9)
    assert gate(row, 0.2) == [] and row.outcome == "ok"


def test_an_interval_whose_high_is_the_baselines_low_still_reaches_it() -> None:
    """A speedup fallen past the tolerance whose high is the baseline's low still reaches it: unresolved."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=3.0, low=2.8, high=3.5, rounds=(9, 9), baseline=4.0,
                     baseline_low=3.5)
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"


def test_a_peer_row_under_its_baseline_is_neither_measured_further_nor_failed() -> None:
    """A peer row fallen under its baseline, its interval reaching the baseline's or not, is ok."""
    row = SpeedupRow(kernel="k", impl="optimized vs peer", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=3.0, low=2.8, high=3.9, rounds=(9, 9), baseline=4.0,
                     baseline_low=3.8, peer=True)
    assert gate(row, 0.2) == [] and row.outcome == "ok" and not row.unresolved
    row.high = 3.1
    assert gate(row, 0.2) == [] and row.outcome == "ok"


def test_a_memory_saving_exactly_at_its_floor_meets_it() -> None:
    """Saved exactly the memory floor's fraction is not under it."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9), memory_floor=0.5,
                     reference_peak_bytes=100, optimized_peak_bytes=50)
    assert gate(row, 0.2) == [] and row.outcome == "ok"


def test_a_peer_rows_memory_is_not_gated_by_the_baseline() -> None:
    """A row about a peer keeps its memory floor but is not failed by its stored baseline's saving."""
    row = SpeedupRow(kernel="k", impl="optimized vs peer", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9), memory_floor=0.1,
                     memory_baseline=0.2, reference_peak_bytes=100, optimized_peak_bytes=50, peer=True)
    assert gate(row, 0.2) == [] and row.outcome == "ok"
    row.optimized_peak_bytes = 95  # under its floor: the floor still applies
    assert "under the floor 10%" in gate(row, 0.2)[0]


def test_a_session_without_rows_says_no_verdict() -> None:
    """No rows and no failures: no closing line, never "gate passed"."""
    from perfgate.stats import verdict

    assert verdict([], "at or above their floors", "--perf-extend 60 s") == []


def test_an_unresolved_row_turns_the_pass_line_into_gate_not_failed() -> None:
    """An unresolved row and no failure close on "gate not failed", counting it, never "gate passed"."""
    from perfgate.stats import verdict

    rows = [SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                       optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9), floor=f)
            for f in (3.0, 4.0)]
    for row in rows:
        gate(row, 0.2)
    lines = verdict(rows, "at or above their floors", "--perf-extend 60 s")
    assert lines[-1][0] == "warn" and "gate not failed: 1 speedup(s) at or above their floors, 1 unresolved" in \
        lines[-1][1]


def test_a_declared_floor_no_row_checked_fails_the_verdict() -> None:
    """A floor ``missed`` under --perf-require-floors is a failure beside passing rows."""
    from perfgate.stats import verdict

    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9))
    gate(row, 0.2)
    lines = verdict([row], "at or above their floors", "--perf-extend 60 s", ["k [lean] not measured"])
    assert ("fail", "GATE FAILED: k [lean] not measured") in lines and not any(s == "pass" for s, _ in lines)


def test_a_row_timed_against_a_peer_is_about_the_peer() -> None:
    """A comparison row (its impl timed against a peer) is a peer row: its stored baseline does not gate it."""
    from perfgate.state import GateState, Measurement, Probes, Settings, Stored

    settings = Settings(device="cpu", size="smoke", threads=1, tolerance=0.2, fingerprint={}, slug="x")
    stored = Stored(speedups={"k::optimized vs peer::smoke": (5.0, 4.8)})
    st = GateState(settings, Probes(None, None, 1), stored=stored)
    st.results["k"] = {"reference": Measurement([8.0] * 9, "smoke", "", None),
                       "peer": Measurement([4.0] * 9, "smoke", "", None),
                       "optimized vs peer": Measurement([2.0] * 9, "smoke", "", None, paired=[(4.0, 2.0)] * 9,
                                                        against="peer")}
    row = st._row("k", "optimized vs peer")
    assert row.peer and row.baseline == 5.0 and row.outcome == "ok"


def test_a_negative_memory_baseline_loosens_by_the_tolerance() -> None:
    """A baseline whose optimized impl used more memory than the reference (saved -20%): the
    tolerance loosens it to -24%, as it loosens a positive one; (1 - tol) x -20% would tighten it
    to -16% and fail a run that saved -19%, better than the baseline."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu",
                     reference_ms=4.0, optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9),
                     memory_floor=0.0, memory_baseline=1.2, reference_peak_bytes=100, optimized_peak_bytes=119)
    failures = gate(row, 0.2)
    assert not any("stored baseline" in f for f in failures), failures  # -19% is over the baseline's -20%
    row.optimized_peak_bytes = 125  # saves -25%: more than 20% of |-20%| under it
    assert any("more than 20% under the stored baseline's -20.0%" in f for f in gate(row, 0.2))


def test_slug_is_a_safe_folder_name() -> None:
    fp = {"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "threads": 16,
          "torch": "2.14.1+cu130", "cuda": "13.0", "python": "3.11", "malloc": "n/a", "thp_alloc": False}
    assert slug(fp) == "cuda-NVIDIA_H100_80GB_HBM3-t16-torch2.14.1_cu130-cuda13.0-py3.11"


def test_slowdown_hook_slows_only_the_optimized_side(pytester: pytest.Pytester) -> None:
    """-p perfgate.slowdown --perf-slowdown 2 turns the 4x pair into 2x; it is refused below 1 and
    for a baseline, and without the plugin perfgate has no such option."""
    _suite(pytester, floor=1.0)
    slowdown = ("-p", "perfgate.slowdown")
    assert _run(pytester, *slowdown, "--perf-slowdown=2", "--benchmark-json=out.json").ret == 0
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert 1.7 < row["speedup"] < 2.2
    result = _run(pytester, *slowdown, "--perf-slowdown=0.5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-slowdown must be >= 1*"])
    result = _run(pytester, *slowdown, "--perf-slowdown=1.5", "--benchmark-save=slow")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*Slowed(factor=1.5)*cannot be a baseline*"])
    result = _run(pytester, "--perf-slowdown=2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --perf-slowdown=2*"])


def test_a_wrapper_is_handed_the_tests_own_callable(pytester: pytest.Pytester) -> None:
    """pytest_perfgate_wrap_timed's wrapper gets the callable the test handed to ``perf``, not one
    ending in a device synchronize: a wrapper of a GPU call would otherwise stretch a synchronized
    call, which the unwrapped side never makes."""
    pytester.makeconftest("""
def pytest_perfgate_wrap_timed(config, device):
    def wrap(impl, run):
        assert run.__name__ == "body", f"the wrapper got {run.__name__}, not the test's callable"
        return run
    return wrap
""")
    _pair(pytester, "wrapped", 0.5, "def body(): time.sleep(0.002)\n    perf(body)")
    result = _run(pytester)
    result.assert_outcomes(passed=2)


def test_a_baseline_drop_on_a_row_shown_no_slower_than_rev_is_not_a_failure() -> None:
    """Under --perf-against, a row that fell under its stored baseline but that the same session's
    A/B did not show slower than REV (ok, faster or unresolved) is unresolved (the host's between
    sessions, or before REV), not failed: the A/B is the evidence about this change. Where the A/B
    did not compare it (None, or REV cannot run it) or failed it, the baseline's drop fails."""
    row = SpeedupRow(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=4.0,
                     optimized_ms=1.0, speedup=4.0, low=3.5, high=4.5, rounds=(9, 9), baseline=5.7)
    for against in (None, "not comparable", "FAIL"):
        row.against = against
        assert "fell more than 20%" in gate(row, 0.2)[0] and row.outcome == "FAIL"
    for against, said in (("ok", "no slower than REV"), ("faster", "no slower than REV"),
                          ("unresolved", "could not tell it slower than REV")):
        row.against = against
        assert gate(row, 0.2) == [] and row.outcome == "unresolved"
        assert said in row.unresolved[0]
    row.floor = 4.6  # a floor's miss is not the baseline's: it stands whatever REV reads
    assert "is under the floor 4.60x" in gate(row, 0.2)[0]


def _fake_run(opt_ms: list[float], speedup: float, failures: list[str]) -> dict:
    return {"benchmarks": [{"extra_info": {"kernel": "k", "impl": "optimized"}, "stats": {"data": opt_ms}},
                           {"extra_info": {"kernel": "k", "impl": "reference"}, "stats": {"data": [4.0] * 9}}],
            "perfgate": {"tolerance": 0.2, "speedups": [{"kernel": "k", "impl": "optimized", "speedup": speedup,
                                                         "high": 1.05 * speedup, "failures": failures}]}}


def test_fidelity_rules() -> None:
    rng = np.random.default_rng(0)
    base = _fake_run(list(1.0 + rng.normal(0, 0.01, 20)), 4.0, [])
    same = fidelity.verdicts(base, _fake_run(list(1.0 + rng.normal(0, 0.01, 20)), 3.9, []))["k"]
    assert not any(same.values())
    slow = fidelity.verdicts(base, _fake_run(list(1.5 + rng.normal(0, 0.01, 20)), 2.7, ["fell"]))["k"]
    alarms = {rule: v for rule, v in slow.items() if rule != "perfgate: unresolved"}
    assert all(alarms.values()) and not slow["perfgate: unresolved"]
    host = fidelity.verdicts(base, _fake_run(list(1.2 + rng.normal(0, 0.01, 20)), 4.0, []))["k"]
    # a slower host: both sides slowed, the speedup rules hold
    assert host == {"perfgate": False, "pytest-benchmark median:10%": True, "asv (x1.1 + Mann-Whitney)": True,
                    "10% of the speedup": False, "perfgate: unresolved": False,
                    "perfgate before: under the baseline's point": False}
    about = {"fingerprint": {"device_type": "cpu"}, "commit": "abc", "dirty": False, "rev": None, "rev_sha": None}
    results = {fidelity.UNCHANGED: [{"k": same}], "caught at x1.5": [{"k": slow}, {"k": same}],
               fidelity.LOST: [{"k": slow}], "seconds": [10.0, 20.0, 30.0], "about": [about]}
    lines = fidelity.table(results)
    assert lines[0] == "| rule | false alarms, unchanged | caught at x1.5 | caught, kernels lost |"
    assert lines[2].startswith("| perfgate | 0/1 (0%) | 1/2 (50%) | 1/1 (100%) |")
    assert lines[-1].endswith("seconds a run, median of 3: 20.0")
    # the same study as data (--json): it round-trips through JSON, counts as the table does
    data = json.loads(json.dumps(fidelity.summary(results, fidelity.RULES, ["t.py", "--runs", "1"])))
    assert data["command"] == ["python", "-m", "perfgate.fidelity", "t.py", "--runs", "1"]
    assert data["about"] == about
    assert data["counts"]["perfgate"] == {fidelity.UNCHANGED: [0, 1], "caught at x1.5": [1, 2],
                                          fidelity.LOST: [1, 1]}
    assert data["runs"]["caught at x1.5"][0]["k"]["perfgate"] is True and data["seconds"] == [10.0, 20.0, 30.0]
    assert fidelity.conditions([1.5, 4.0], "my.plugin") == [
        (fidelity.UNCHANGED, []), ("caught at x1.5", ["--perf-slowdown=1.5"]),
        ("caught at x4", ["--perf-slowdown=4.0"]), (fidelity.LOST, ["-p", "my.plugin"])]


DRIFT = """
import time
import pytest

HOST = {"calls": 0}

def work(ms):
    HOST["calls"] += 1
    time.sleep(ms / 1000 * (2 if HOST["calls"] > 40 else 1))  # the host halves its speed for good

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_drift(perf, impl):
    perf(lambda: work(8 if impl == "reference" else 2), rounds=30, label="drift")
"""


def test_interleaved_rounds_cancel_a_host_change(pytester: pytest.Pytester) -> None:
    """The host slows 2x after the reference's own rounds: timed apart, the 4x pair would read 2x;
    the interleaved pairs see both sides slowed together and read 4x."""
    pytester.makepyfile(test_drift=DRIFT)
    assert _run(pytester, "--benchmark-json=out.json").ret == 0
    data = json.loads((pytester.path / "out.json").read_text())
    row = data["perfgate"]["speedups"][0]
    assert row["interleaved"] and 3.6 < row["speedup"] < 4.4
    medians = {b["extra_info"]["impl"]: b["stats"]["median"] for b in data["benchmarks"]}
    assert 1.7 < medians["reference"] / medians["optimized"] < 2.3  # what the separate rounds say
    with pytest.raises(ValueError, match="equal counts"):
        speedup_interval([1.0, 2.0, 3.0], [1.0, 2.0], paired=True)


LATER = """
import time
from pathlib import Path
import pytest

def work(impl):  # the optimized side is 4x faster until test_zz_later has run, then as slow
    fast = impl == "optimized" and not Path("later").exists()
    time.sleep(0.002 if fast else 0.008)

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_pair(perf, impl):
    perf(lambda: work(impl), rounds=30, label="visits")

def test_zz_later():
    Path("later").write_text("x")
"""


def test_later_visits_run_after_every_test(pytester: pytest.Pytester) -> None:
    """With 3 visits a third of the interleaved rounds are timed during the test and two thirds
    at the session's end, after test_zz_later made both sides equal: the row reads ~1x.
    With 1 visit it reads the 4x of the test's own moment."""
    pytester.makepyfile(test_later=LATER)
    rows = {}
    for visits, more in ((1, ()), (3, ("--perf-all-visits",)), ("3 decided", ())):
        (pytester.path / "later").unlink(missing_ok=True)
        # max-time 3 s: every run's pair count is the rounds' 30, not capped by its own medians
        args = (f"--perf-visits={str(visits)[0]}", "--benchmark-max-time=3", "--benchmark-json=v.json", *more)
        assert _run(pytester, *args).ret == 0
        rows[visits] = json.loads((pytester.path / "v.json").read_text())["perfgate"]["speedups"][0]
    assert 3.2 < rows[1]["speedup"] < 4.4 and rows[1]["visits"] == 1 and rows[1]["skipped"] == 0
    assert 0.8 < rows[3]["speedup"] < 1.2 and rows[3]["visits"] == 3 and rows[3]["skipped"] == 0
    # the stopping rule: a row with no floor or baseline to decide is decided by its first visit
    decided = rows["3 decided"]
    assert 3.2 < decided["speedup"] < 4.4 and decided["visits"] == 1
    assert decided["skipped"] == rows[3]["rounds"][0] - decided["rounds"][0] > 0
    result = _run(pytester, "--perf-visits=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-visits must be >= 1*"])


def test_cpu_floors_apply_only_at_the_default_threads(pytester: pytest.Pytester) -> None:
    """A 1x pair under a 2x floor fails at torch's default threads; at another thread count the
    floor (measured at the default) is not applied, and the run says so."""
    import torch

    from perfgate import session

    default = session._DEFAULT_THREADS[0] if session._DEFAULT_THREADS else torch.get_num_threads()
    other = 1 if default != 1 else 2
    _suite(pytester, opt=0.008)
    assert _run(pytester, f"--perf-threads={default}").ret == pytest.ExitCode.TESTS_FAILED
    result = _run(pytester, f"--perf-threads={other}", "--benchmark-json=out.json")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"*floors are set at torch's default {default} thread(s)*not applied*",
                                 f"*gate passed: 1 speedup(s) without speedup floors (not applied at "
                                 f"--perf-threads {other})*"])
    assert torch.get_num_threads() == default  # the inner session gave the thread count back
    assert json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]["floor"] is None


def test_cpu_floors_apply_only_under_the_caching_malloc(pytester: pytest.Pytester) -> None:
    """Floors are claims under --perf-malloc cache (where they were measured): under glibc's
    default malloc the same 1x pair passes without them, and the run and its JSON say so."""
    _suite(pytester, opt=0.008)
    result = _run(pytester, "--perf-malloc=default", "--benchmark-json=out.json")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*floors are set*under --perf-malloc cache; under --perf-malloc default they are "
                                 "not applied*", "*gate passed: 1 speedup(s) without speedup floors (not applied "
                                 "under --perf-malloc default)*"])
    section = json.loads((pytester.path / "out.json").read_text())["perfgate"]
    assert section["floors_applied"] is False and section["speedups"][0]["floor"] is None



NOISY = """
import random
import time
from pathlib import Path
import pytest

RNG = random.Random(0)

def optimized():  # 4x or 1x by a seeded coin until test_zz_settle has run, then {settled} for good
    settled = Path("settled").exists()
    time.sleep(({settled} if settled else RNG.choice([0.010, 0.040])))

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_noisy(perf, impl):
    perf((lambda: time.sleep(0.040)) if impl == "reference" else optimized, rounds=8, label="noisy")

def test_zz_settle():
    Path("settled").write_text("x")
"""


@pytest.mark.parametrize(("settled", "outcome"), [(0.010, "ok"), (0.040, "FAIL")])
def test_straddled_floor_is_measured_further(pytester: pytest.Pytester, settled: float, outcome: str) -> None:
    """A row whose pairs read 4x or 1x by a coin straddles its 2x floor. With no budget to extend
    it is reported unresolved and the session passes; with one, the pairs timed after the host
    settled (at 4x, or at 1x) resolve it: met, or missed."""
    pytester.makepyfile(test_noisy=NOISY.format(settled=settled))
    args = ("--perf-visits=1", "--benchmark-json=out.json")
    result = _run(pytester, "--perf-extend=0", *args)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*noisy*2.00x*unresolved*",
                                 "*UNRESOLVED: noisy [[]optimized*straddles the floor 2.00x*",
                                 "*gate not failed: 0 speedup(s) at or above their floors, 1 unresolved*"])
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert row["outcome"] == "unresolved" and row["extended"] == 0 and row["failures"] == []
    (pytester.path / "settled").unlink()
    result = _run(pytester, "--perf-extend=20", *args)
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert row["outcome"] == outcome and row["extended"] > 0, row
    assert result.ret == (0 if outcome == "ok" else pytest.ExitCode.TESTS_FAILED)
    extended = f"extended: noisy [[]optimized[]] +{row['extended']} interleaved pairs*{outcome}"
    result.stdout.fnmatch_lines([extended])
    result = _run(pytester, "--perf-extend=-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


COIN = """
import random
import time
from pathlib import Path
import pytest

RNG = random.Random(0)

def optimized():  # ./sleep: seconds, or "coin S": 8x or 1x by a seeded coin until test_zz_settle, then S
    how = Path("sleep").read_text().split()
    time.sleep(RNG.choice([0.005, 0.040]) if how[0] == "coin" else float(how[-1]))

@pytest.mark.speedup(cpu=0.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_coin(perf, impl):
    perf((lambda: time.sleep(0.040)) if impl == "reference" else optimized, rounds=8, label="coin")

def test_zz_settle():
    Path("sleep").write_text(Path("sleep").read_text().split()[-1])
"""


def test_straddled_baseline_is_measured_further(pytester: pytest.Pytester) -> None:
    """Saved at 4x, the row reads about 2.8x on pairs at 8x or 1x by a coin: more than 20% under
    the baseline on its point, but with an interval that reaches the baseline's. With no budget to
    extend it is unresolved; with one, the pairs timed after the host settled (at 4x, or at 2x)
    resolve it: met, or missed."""
    pytester.makepyfile(test_coin=COIN)
    sleep = pytester.path / "sleep"
    sleep.write_text("0.010")
    assert _run(pytester, "--benchmark-save=base").ret == 0
    args = ("--perf-visits=1", "--benchmark-json=out.json", "--benchmark-compare")
    sleep.write_text("coin 0.010")
    result = _run(pytester, "--perf-extend=0", *args)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*UNRESOLVED: coin [[]optimized*more than 20% under the stored baseline's*"])
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert row["outcome"] == "unresolved" and row["extended"] == 0 and row["failures"] == [], row
    for settled, outcome in (("0.010", "ok"), ("0.020", "FAIL")):
        sleep.write_text(f"coin {settled}")
        result = _run(pytester, "--perf-extend=20", *args)
        row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
        assert row["outcome"] == outcome and row["extended"] > 0, row
        assert result.ret == (0 if outcome == "ok" else pytest.ExitCode.TESTS_FAILED)
        result.stdout.fnmatch_lines([f"extended: coin [[]optimized[]] +* pairs*straddled the floor 0.50x or the "
                                     f"stored baseline's*{outcome}"])


VARIANT = """
import time
import pytest

@pytest.mark.speedup(cpu=3.0, variant="bf16*")
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_keyed(perf, impl):
    perf(lambda: time.sleep(0.008 if impl == "reference" else 0.004), label="keyed", variant="{variant}")
"""


@pytest.mark.parametrize(("variant", "ret"), [("bf16+channels_last", pytest.ExitCode.TESTS_FAILED), ("fp32", 0)])
def test_floor_keyed_to_a_variant(pytester: pytest.Pytester, variant: str, ret: int) -> None:
    """A floor declared for the bf16 recipe gates a run that chose it (2x against 3x fails) and
    is not applied, with the reason in the table, to a run that chose fp32."""
    pytester.makepyfile(test_keyed=VARIANT.format(variant=variant))
    result = _run(pytester, "--benchmark-json=out.json")
    assert result.ret == ret
    if ret:
        result.stdout.fnmatch_lines(["*GATE FAILED: keyed*under the floor 3.00x*"])
    else:
        result.stdout.fnmatch_lines(["*keyed*- (set for bf16[*], ran fp32)*ok*"])
    row = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]
    assert row["variant"] == variant and (row["floor"] is None) == (variant == "fp32")


def test_two_floors_for_one_row_are_refused(pytester: pytest.Pytester) -> None:
    """Which of two applicable markers wins must not hang on decorator order."""
    pytester.makepyfile(test_two=VARIANT.format(variant="bf16").replace(
        '@pytest.mark.speedup(cpu=3.0, variant="bf16*")', '@pytest.mark.speedup(cpu=3.0, variant="bf16*")\n'
        '@pytest.mark.speedup(cpu=1.5)'))
    result = _run(pytester)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*2 speedup markers apply to impl 'optimized' on cpu at size smoke*"])
