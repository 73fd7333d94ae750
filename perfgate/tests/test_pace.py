"""The core's pace: a VM's vCPUs need not run at one speed (on the Xeon 207 each in turn ran
Python, dispatched ops and GEMMs 1.3-1.6x slower for seconds, with no steal), and two kernels do
not slow alike there, so a speedup timed on a slowed core is not the machine's usual one. A pure-
Python loop is timed beside each pair; a row that misses its floor or baseline with some pairs
slowed is judged on the pairs at the usual pace, and a saved baseline stands at their speedup."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from perfgate import state as state_module
from perfgate.roofline import Limits, session_pace, usual_pace
from perfgate.state import MIN_PAIRS, GateState, Measurement, Probes, Settings
from perfgate.stats import PACE_SLOWED, SpeedupRow, gate, slowed
from perfgate.timing import HostLoad, Pace, PairLoad, interleaved, timer_for

USUAL, SLOW = 60_000.0, 90_000.0  # ns: a pace probe's two modes, 1.5x apart


def _row(**kw) -> SpeedupRow:
    fields = dict(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=8.0,
                  optimized_ms=4.0, speedup=2.0, low=1.9, high=2.1, rounds=(20, 20), interleaved=True,
                  floor=3.0, contention=0.0, pace_ns=SLOW, usual_pace_ns=USUAL)
    return SpeedupRow(**{**fields, **kw})


def test_the_probe_reads_a_positive_time_and_refuses_an_empty_loop() -> None:
    assert 0.0 < Pace(loop=200, reps=2).read() < 1e9
    with pytest.raises(ValueError, match="both >= 1"):
        Pace(loop=0)


def test_slowed_is_over_pace_slowed_times_the_usual() -> None:
    assert not slowed(None, USUAL) and not slowed(PACE_SLOWED * USUAL, USUAL)
    assert slowed(PACE_SLOWED * USUAL * 1.01, USUAL)


def test_a_miss_on_a_slowed_core_is_judged_on_the_usual_pace_pairs() -> None:
    # the pairs at the usual pace clear the floor: the miss is the pace's
    row = _row(slowed=0.6, near_pairs=8, near_speedup=4.0, near_low=3.6, near_high=4.4)
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"
    assert ("the host ran the timing thread's core slowed (a pace probe of 90 us; 60 us at this machine's usual "
            "pace) for 60% of its pairs, and its 8 pairs timed at the usual pace read 4.00x (95% CI 3.60-4.40x)"
            ) in row.unresolved[0]
    assert "the miss is the core's pace's" in row.unresolved[0]
    # a kernel slower there too fails, and says so
    slower = _row(slowed=0.6, near_pairs=8, near_speedup=2.0, near_low=1.9, near_high=2.1)
    assert gate(slower, 0.2) and slower.outcome == "FAIL"
    assert "pairs timed at the usual pace read 2.00x" in slower.failures[0]
    # too few at the usual pace: no verdict
    few = _row(slowed=0.9, near_pairs=MIN_PAIRS - 1)
    assert gate(few, 0.2) == [] and "too few timed at the usual pace to judge (6)" in few.unresolved[0]


def test_a_miss_beyond_what_the_slowed_core_explains_stands_without_usual_pairs() -> None:
    """Too few pairs at the usual pace, but with each pair's pace shortfall charged to the impl the
    row still reads under the floor (2.5x at most against 3): it fails, and says so; a bound that
    reaches the floor leaves it unresolved."""
    beyond = _row(slowed=1.0, near_pairs=0, pace_speedup=2.4, pace_bound=2.5)
    assert gate(beyond, 0.2) and beyond.outcome == "FAIL"
    assert "with each pair's slowdown charged to it, it reads 2.40x (up to 2.50x)" in beyond.failures[0]
    within = _row(slowed=1.0, near_pairs=0, pace_speedup=2.9, pace_bound=3.2)
    assert gate(within, 0.2) == [] and "too few timed at the usual pace" in within.unresolved[0]
    # against a stored baseline (4x: the line 3.2x), the charged point must fall under it too
    base = dict(floor=None, baseline=4.0, baseline_low=3.9, speedup=2.0, high=2.1, slowed=1.0, near_pairs=0)
    assert gate(_row(**base, pace_speedup=3.0, pace_bound=3.5), 0.2)
    assert gate(_row(**base, pace_speedup=3.3, pace_bound=3.5), 0.2) == []
    # a floor and a baseline: each line judged on its own (the charge clears the baseline's line,
    # 0.8 x 3.5 = 2.8x, not the floor of 3): the floor's miss stands, the baseline's is left unjudged
    both = _row(floor=3.0, baseline=3.5, baseline_low=3.4, slowed=1.0, near_pairs=0, pace_speedup=2.85,
                pace_bound=2.95)
    assert gate(both, 0.2) and "is under the floor 3.00x" in both.failures[0] and len(both.failures) == 1
    assert "is under its stored baseline: " in both.unresolved[0]
    # with the threads apart too, the pace's bound is not the placement's: no verdict
    apart = _row(slowed=1.0, apart=1.0, round_trip_ns=320.0, near_round_trip_ns=52.0, near_pairs=0,
                 pace_speedup=2.4, pace_bound=2.5)
    assert gate(apart, 0.2) == [] and apart.outcome == "unresolved"


def test_threads_apart_and_a_slowed_core_are_both_named() -> None:
    row = _row(slowed=0.3, apart=0.4, round_trip_ns=320.0, near_round_trip_ns=52.0, near_pairs=MIN_PAIRS - 1)
    gate(row, 0.2)
    assert "threads 320 ns apart" in row.unresolved[0] and "core slowed" in row.unresolved[0]
    assert "too few timed near and at the usual pace" in row.unresolved[0]


def test_every_row_is_judged_on_all_its_pairs_under_perf_contended_inf() -> None:
    row = _row(slowed=0.6, near_pairs=8, near_speedup=4.0, near_low=3.6, near_high=4.4)
    assert gate(row, 0.2, float("inf")) and row.outcome == "FAIL"


def _state(sessions: list[float]) -> GateState:
    settings = Settings(device="cpu", size="smoke", threads=1, tolerance=0.2, fingerprint={}, slug="s")
    limits = Limits("cpu", "s", None)
    limits.values["pace_sessions_ns"] = sessions
    return GateState(settings, Probes(None, None, 1), limits=limits)


def _measured(st: GateState, paces: list[float], optimized: list[float]) -> SpeedupRow:
    load = [PairLoad(wall=1.0, share=0.0, delay=0.0, pace_ns=ns) for ns in paces]
    st.results["k"] = {"reference": Measurement([8.0] * len(load), "smoke", "", None),
                       "optimized": Measurement(list(optimized), "smoke", "", None,
                                                paired=[(8.0, o) for o in optimized], load=load)}
    return st._row("k", "optimized")


def test_pairs_are_split_by_the_pace_read_beside_them() -> None:
    """Ten pairs at the usual pace (4x), ten slowed (2x, by wall time a half): the row reads its
    slowed share, the slowest reading, the usual pace and the usual pairs' own interval."""
    row = _measured(_state([USUAL]), [USUAL] * 10 + [SLOW] * 10, [2.0] * 10 + [4.0] * 10)
    assert row.slowed == pytest.approx(0.5) and row.pace_ns == SLOW and row.usual_pace_ns == USUAL
    assert row.near_pairs == 10 and row.near_speedup == pytest.approx(4.0)
    assert row.apart is None  # no placement read (one thread)
    # the slowed pairs' 4 ms relieved by 60/90: 2.67 ms, 3x; the interval's high over all pairs
    assert row.pace_bound == pytest.approx(4.0)
    slow = _measured(_state([USUAL]), [SLOW] * 10, [4.0] * 10)
    assert slow.pace_speedup == pytest.approx(3.0) == slow.pace_bound


def test_the_usual_pace_is_the_faster_of_the_machines_sessions_and_the_scan() -> None:
    assert usual_pace([USUAL, SLOW, USUAL], [], [SLOW] * 4) == USUAL
    assert usual_pace([SLOW], [USUAL], [SLOW] * 4) == USUAL == usual_pace([USUAL], [SLOW], [])
    # the session's own lower quartile, where its pairs ran faster than both
    assert usual_pace([SLOW], [SLOW], [USUAL] * 3 + [SLOW]) == USUAL == session_pace([USUAL] * 3 + [SLOW])
    assert usual_pace([], [], []) is None
    assert session_pace([]) is None and session_pace([float("inf"), 0.0]) is None
    # a session slowed throughout reads nothing slowed against itself; all of it against the
    # machine's sessions, or against a CPU the scan found at the usual pace
    assert _measured(_state([]), [SLOW] * 10, [4.0] * 10).slowed == 0.0
    assert _measured(_state([USUAL]), [SLOW] * 10, [4.0] * 10).slowed == 1.0
    scanned = _state([])
    scanned.scans.append(USUAL)
    assert _measured(scanned, [SLOW] * 10, [4.0] * 10).slowed == 1.0


class _OnCpu(Pace):
    """A probe that reads SLOW on CPU 0 and USUAL elsewhere (the CPU the thread is allowed now)."""

    def read(self) -> float:
        return SLOW if os.sched_getaffinity(0) == {0} else USUAL


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the scan moves threads on Linux only")
def test_the_scan_reads_each_cpu_and_puts_the_thread_back() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2 or 0 not in allowed:
        pytest.skip("the scan needs CPU 0 and another")
    assert _OnCpu().scan() == USUAL and os.sched_getaffinity(0) == allowed
    assert _OnCpu().scan(most=1) == SLOW  # CPU 0 alone
    os.sched_setaffinity(0, {0})
    try:
        assert _OnCpu().scan() is None  # one CPU: nothing to choose from
    finally:
        os.sched_setaffinity(0, allowed)
    cpu, pace = _OnCpu().fastest()
    assert cpu != 0 and pace == USUAL and os.sched_getaffinity(0) == allowed


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the scan moves threads on Linux only")
def test_a_failures_second_stretch_runs_on_the_fastest_cpu_at_one_thread() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2 or 0 not in allowed:
        pytest.skip("needs CPU 0 and another")
    st = _state([USUAL])
    st.probes = Probes(None, HostLoad(threads=1, pace=_OnCpu()), 1)
    with st._on_fastest_cpu():
        inside = os.sched_getaffinity(0)
    assert len(inside) == 1 and 0 not in inside and os.sched_getaffinity(0) == allowed
    st.settings = Settings(device="cpu", size="smoke", threads=2, tolerance=0.2, fingerprint={}, slug="s")
    with st._on_fastest_cpu():  # more threads: the probe moves none of the others, so none
        assert os.sched_getaffinity(0) == allowed


def test_a_session_joins_the_machines_usual_paces_after_its_rows_are_judged(tmp_path: Path) -> None:
    st = _state([USUAL])
    _measured(st, [SLOW] * 10, [4.0] * 10)
    (row,) = st.compute_rows()
    assert row.slowed == 1.0 and st.limits.values["pace_sessions_ns"] == [USUAL, SLOW]
    # a stored file keeps the last sessions
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(Limits("cpu", "s", None).values), encoding="utf8")
    limits = Limits("cpu", "s", path)
    for _ in range(20):
        limits.note_usual_pace([USUAL])
    limits.save()
    assert Limits("cpu", "s", path).pace_history == [USUAL] * 15


@pytest.mark.parametrize("sessions", [60.0, [60.0, -1.0], [60.0, "slow"], [60.0, None]])
def test_a_limits_file_with_bad_pace_sessions_is_refused(tmp_path: Path, sessions) -> None:
    from perfgate.roofline import BadLimits, read_limits

    path = tmp_path / "limits.json"
    path.write_text(json.dumps({**Limits("cpu", "s", None).values, "pace_sessions_ns": sessions}),
                    encoding="utf8")
    with pytest.raises(BadLimits, match="pace_sessions_ns"):
        read_limits(path, "s")


class _Readings:
    def __init__(self) -> None:
        self.n = 0

    def read(self) -> float:
        self.n += 1
        return 1000.0 * self.n


def test_each_pair_takes_the_slower_of_the_readings_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostLoad, "share", lambda self, before, after: (0.1, 0.0, 0.0))
    load: list[PairLoad] = []
    noop = (lambda: None, None)
    interleaved(timer_for("cpu"), noop, noop, 3, (1, 1), host=HostLoad(threads=1, pace=_Readings()), load=load)
    assert [p.pace_ns for p in load] == [2000.0, 3000.0, 4000.0]


# 8 ms references; ours takes SLOWED_S on a slowed core (4 ms: 2x, under the floor of 3) and USUAL_S
# at the usual pace: 2 ms (4x, the unchanged kernel) or, regressed, 4 ms as well
SUITE = """
import os
import time
import pytest

@pytest.mark.speedup(cpu=3.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_paced(perf, impl):
    usual, slowed = float(os.environ["PERFGATE_TEST_USUAL_S"]), float(os.environ["PERFGATE_TEST_SLOWED_S"])
    opt = lambda: time.sleep(slowed if os.environ.get("PERFGATE_TEST_SLOWED") == "1" else usual)
    perf(opt if impl == "optimized" else lambda: time.sleep(0.008), label="8ms")
"""
FAST = ["--perf-device", "cpu", "--benchmark-max-time=0.1", "--benchmark-min-rounds=8",
        "-p", "no:cacheprovider", "--benchmark-json=out.json", "--perf-visits=1"]


@pytest.fixture
def slowed_host(monkeypatch: pytest.MonkeyPatch, quiet_host: None):
    """The pace probe reads SLOW while PERFGATE_TEST_SLOWED is 1, else USUAL; the session starts
    slowed and the host runs the core at its usual pace again while the session waits for it
    (``GateState._await_usual``). The machine's limits store USUAL as its usual pace."""
    pytest.importorskip("torch")
    monkeypatch.setattr(Pace, "read",
                        lambda self: SLOW if os.environ.get("PERFGATE_TEST_SLOWED") == "1" else USUAL)
    monkeypatch.setattr(state_module, "PLACEMENT_WAIT_S", 0.3)
    # no scan: the usual pace is the one the machine's limits.json stores (the session's own pairs
    # start slowed, so their lower quartile cannot be it)
    monkeypatch.setattr(Pace, "scan", lambda self, seconds=0.0, every=0.1, most=64: None)
    await_usual = GateState._await_usual

    def wait(self: GateState) -> None:
        os.environ["PERFGATE_TEST_SLOWED"] = "0"
        await_usual(self)

    monkeypatch.setattr(GateState, "_await_usual", wait)

    def run(pytester: pytest.Pytester, usual_s: float, *args: str, slowed_s: float = 0.004):
        monkeypatch.setenv("PERFGATE_TEST_USUAL_S", str(usual_s))
        monkeypatch.setenv("PERFGATE_TEST_SLOWED_S", str(slowed_s))
        monkeypatch.setenv("PERFGATE_TEST_SLOWED", "1")
        pytester.makepyfile(test_paced=SUITE)
        storage = pytester.path / ".benchmarks"
        _store_usual(storage)
        result = pytester.runpytest(*FAST, f"--benchmark-storage=file://{storage}", *args)
        return result, json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"][0]

    return run


def _store_usual(storage: Path) -> None:
    """The machine's limits file with USUAL as its sessions' usual pace (at torch's threads: the
    floors apply)."""
    import torch

    from perfgate.fingerprint import fingerprint, slug
    from perfgate.timing import configure_malloc

    name = slug(fingerprint("cpu", torch.get_num_threads(), configure_malloc("cache"), l2_flush=False))
    path = storage / name / "limits.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(json.dumps({**Limits("cpu", name, None).values, "pace_sessions_ns": [USUAL]}),
                        encoding="utf8")


@pytest.mark.paced
def test_an_unchanged_kernel_timed_on_a_slowed_core_is_not_failed(pytester: pytest.Pytester,
                                                                  slowed_host) -> None:
    """Its first pairs, all slowed, miss the floor; timed again at the usual pace they read 4x."""
    result, row = slowed_host(pytester, 0.002)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["perfgate: the host ran the timing thread's core slowed*"])
    # passed on all its pairs, or with the miss left to the pace: never failed, and its usual pairs read 4x
    assert row["slowed"] > 0 and row["outcome"] in ("ok", "unresolved")
    assert row["usual_pace_ns"] == USUAL and row["near_speedup"] == pytest.approx(4.0, rel=0.25)


@pytest.mark.paced
def test_a_slower_kernel_timed_on_a_slowed_core_still_fails(pytester: pytest.Pytester, slowed_host) -> None:
    result, row = slowed_host(pytester, 0.004)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["GATE FAILED: paced ?optimized, 8ms? on cpu: *is under the floor 3.00x*pairs "
                                 "timed at the usual pace read [12].*x*"])


@pytest.mark.paced
def test_a_baseline_saved_on_a_slowed_core_stands_at_its_usual_pace_pairs(pytester: pytest.Pytester,
                                                                          slowed_host) -> None:
    """Saved while the core ran slowed for some pairs: a later run is held to the usual pairs'
    speedup (4x), not to the mix of all pairs (a 1.5x slower kernel at the usual pace, 2.67x, must
    fall more than 20% under it)."""
    _, saved = slowed_host(pytester, 0.002, "--benchmark-save=base")
    assert saved["slowed"] > 0 and saved["near_speedup"] is not None
    assert saved["speedup"] < saved["near_speedup"] == pytest.approx(4.0, rel=0.25)
    stored = json.loads(next((pytester.path / ".benchmarks").rglob("0001_base.json")).read_text())
    assert stored["perfgate"]["speedups"][0]["near_speedup"] == saved["near_speedup"]


@pytest.mark.paced
def test_a_row_saved_with_every_pair_on_a_slowed_core_is_timed_again_at_the_usual_pace(
        pytester: pytest.Pytester, slowed_host) -> None:
    """No miss to time again (the kernel reads 4x at either pace), but no pair at the usual pace
    either: a saved baseline would stand at the host's unusual state, so the row is extended once
    the host runs the core as usual, and stands at those pairs."""
    result, saved = slowed_host(pytester, 0.002, "--benchmark-save=base", slowed_s=0.002)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["extended: paced ?optimized? +* interleaved pairs at the session's end, its "
                                 "interval was wider than a saved baseline may be, or too few of its pairs were "
                                 "timed as the host usually runs: *"])
    assert saved["slowed"] < 1.0 and saved["near_pairs"] >= MIN_PAIRS and saved["near_speedup"] is not None


def _hellos(device: str) -> dict:
    from perfgate.abworker import Hello

    return {side: Hello(side=side, root=".", library=("k",), device=device, size="smoke", threads=1,
                        malloc="cache") for side in ("rev", "this")}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning is Linux's")
def test_against_pins_both_blocks_of_a_pair_to_one_cpu() -> None:
    """--perf-against's two sides run in two processes, each on the CPU it last ran on: on the CPU
    device both blocks of a pair run on one CPU, chosen at random a pair, so both read its pace."""
    from perfgate.abrun import ABRow, Budget, Comparer, Stretch, pair_cpus

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin to")

    class FakePool:
        hellos, per_side = _hellos("cpu"), 1

        def __init__(self) -> None:
            self.asked: list[int | None] = []

        def side(self, side: str) -> list:
            import types

            return [types.SimpleNamespace(side=side, index=0, name=side)]

        def ask(self, worker, op: str, timeout: float, **kw) -> dict:
            self.asked.append(kw.get("cpu"))
            return {"ok": True, "times": [0.001], "share": None}

    assert pair_cpus(FakePool()) == allowed
    assert pair_cpus(type("Cuda", (), {"hellos": _hellos("cuda")})()) is None and pair_cpus(None) is None
    pool = FakePool()
    comparer = Comparer(pool, 0.05, Budget())
    comparer.blocks = {"rev": (1, 0, 0.001), "this": (1, 0, 0.001)}
    comparer.pairs(ABRow("k", "optimized", "smoke", "t::k"), 20, Stretch(), [])
    assert all(cpu in allowed for cpu in pool.asked)
    assert all(a == b for a, b in zip(pool.asked[::2], pool.asked[1::2], strict=True))  # a pair: one CPU
    assert len(set(pool.asked)) > 1  # the pairs sample the CPUs


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning is Linux's")
def test_a_worker_times_a_block_on_the_cpu_asked_and_is_allowed_its_cpus_again() -> None:
    """``Worker.block`` on a worker's state (a real Worker would change this process's imports)."""
    import types

    from perfgate.abworker import Worker

    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    seen: list[set[int]] = []
    worker = types.SimpleNamespace(rows={"r": [((lambda: seen.append(os.sched_getaffinity(0))), None)]},
                                   timer=timer_for("cpu"), host=HostLoad(threads=1))
    Worker.block(worker, "r", calls=2, warm=0, cpu=cpu)
    assert seen and all(s == {cpu} for s in seen) and os.sched_getaffinity(0) == allowed
