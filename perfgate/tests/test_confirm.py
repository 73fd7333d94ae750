"""A failure is timed again before it stands: a row that misses its floor or baseline gets a second
stretch of interleaved pairs at the session's end (``GateState.confirm``), and fails only if that
stretch misses too. A host state that slowed one stretch and not the other leaves it unresolved
(or passed, where all its pairs together clear the floor); a kernel that got slower misses in
both and fails."""

from __future__ import annotations

import json

import pytest

from perfgate.stats import SpeedupRow, gate, row_from_dict

# ours at 8 ms, the reference's time: 1x, under the floor of 3. "a_passing" is slow only during its
# own test (test_b_host_quiet makes it fast before the session's end); "c_lost" is slow throughout.
SUITE = """
import time
import pytest

SLOW = {"a_passing": True}

def sleepy(perf, impl, slow):
    perf(lambda: time.sleep(0.008 if impl == "reference" or slow() else 0.002), label="8ms")

@pytest.mark.speedup(cpu=3.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_a_passing(perf, impl):
    sleepy(perf, impl, lambda: SLOW["a_passing"])

def test_b_host_quiet():
    SLOW["a_passing"] = False

@pytest.mark.speedup(cpu=3.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_c_lost(perf, impl):
    sleepy(perf, impl, lambda: True)
"""
FAST = ["--perf-device", "cpu", "--benchmark-max-time=0.1", "--benchmark-min-rounds=8", "-p", "no:cacheprovider",
        "--perf-visits=1", "--perf-contended=inf"]


def _row(**kw) -> SpeedupRow:
    fields = dict(kernel="k", impl="optimized", size="smoke", label="", device="cpu", reference_ms=8.0,
                  optimized_ms=4.0, speedup=2.0, low=1.9, high=2.1, rounds=(10, 10), interleaved=True,
                  floor=3.0, contention=0.0)
    return SpeedupRow(**{**fields, **kw})


def test_a_miss_the_second_stretch_does_not_repeat_is_unresolved() -> None:
    row = _row(confirmed=20, confirm_speedup=4.0, confirm_high=4.2)
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"
    again = "20 pairs timed again at the session's end read 4.00x (up to 4.20x): the host changed"
    assert again in row.unresolved[0]


def test_a_miss_the_second_stretch_repeats_fails_and_says_both() -> None:
    row = _row(confirmed=20, confirm_speedup=2.0, confirm_high=2.2)
    failures = gate(row, 0.2)
    assert row.outcome == "FAIL" and len(failures) == 1
    assert "is under the floor 3.00x (the whole interval is); 20 pairs timed again" in failures[0]


def test_a_second_stretch_that_straddles_the_floor_is_no_failure() -> None:
    row = _row(confirmed=7, confirm_speedup=2.8, confirm_high=3.1)
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"


def test_a_second_stretch_that_reads_as_the_first_fails_whatever_its_high() -> None:
    """Beside a copy loop a lost kernel's 7 pairs timed again read 1.05x, their interval up to
    3.36x on one noisy pair, over a floor of 3.3: the stretches agree, so the failure stands."""
    row = _row(speedup=0.97, low=0.87, high=1.21, floor=3.3, confirmed=7, confirm_speedup=1.05, confirm_high=3.36)
    failures = gate(row, 0.2)
    assert row.outcome == "FAIL" and "7 pairs timed again at the session's end read 1.05x" in failures[0]
    base = dict(floor=None, baseline=4.0, baseline_low=3.8, speedup=2.0, low=1.9, high=2.6)
    assert gate(_row(**base, confirmed=7, confirm_speedup=2.5, confirm_high=4.0), 0.2)


def test_a_second_stretch_reading_at_the_intervals_high_does_not_disagree() -> None:
    """A second stretch reading at the interval's high, not above it, leaves the miss standing."""
    row = _row(confirmed=7, confirm_speedup=2.1, confirm_high=3.5)
    assert gate(row, 0.2) and row.outcome == "FAIL"


def test_a_second_stretch_whose_high_is_the_floor_reaches_it() -> None:
    """A second stretch above the first whose high is exactly the floor reaches it: unresolved."""
    row = _row(confirmed=7, confirm_speedup=2.8, confirm_high=3.0)
    assert gate(row, 0.2) == [] and row.outcome == "unresolved"


def test_a_second_stretch_clears_a_baseline_miss_by_either_of_its_rules() -> None:
    """A second stretch within the tolerance, or reaching the baseline's low, leaves a baseline miss unresolved."""
    base = dict(floor=None, baseline=4.0, baseline_low=3.8)  # fails under 3.2 with the interval under 3.8
    within = _row(**base, confirmed=9, confirm_speedup=3.3, confirm_high=3.6)
    assert gate(within, 0.2) == [] and within.outcome == "unresolved"
    reaches = _row(**base, confirmed=9, confirm_speedup=3.0, confirm_high=3.8)
    assert gate(reaches, 0.2) == [] and reaches.outcome == "unresolved"


def test_a_baseline_miss_is_confirmed_the_same_way() -> None:
    base = dict(floor=None, baseline=4.0, baseline_low=3.8)
    assert gate(_row(**base, confirmed=9, confirm_speedup=2.0, confirm_high=2.1), 0.2)  # repeats: fails
    row = _row(**base, confirmed=9, confirm_speedup=3.9, confirm_high=4.1)
    assert gate(row, 0.2) == [] and "under its stored baseline, but 9 pairs timed again" in row.unresolved[0]


def test_the_second_stretch_survives_a_json_round_trip() -> None:
    """A merge (``python -m perfgate.report --merge``) gates rows read back from the shards' JSON:
    the same verdict."""
    for again in (4.2, 2.2):
        row = _row(confirmed=20, confirm_speedup=again - 0.2, confirm_high=again)
        gate(row, 0.2)
        back = row_from_dict(row.as_dict())
        gate(back, 0.2)
        assert (back.outcome, back.failures, back.unresolved) == (row.outcome, row.failures, row.unresolved)


@pytest.mark.paced
def test_a_session_times_a_failure_again_and_fails_only_what_repeats(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_twice=SUITE)
    result = pytester.runpytest(*FAST, "--benchmark-json=out.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines_random([
        "timed again: a_passing ?optimized? +* interleaved pairs at the session's end, its first pairs missed: "
        "these read [34].*x (up to *x); all *: *",
        "timed again: c_lost ?optimized? +* these read [01].[09]*x *, FAIL",
        "GATE FAILED: c_lost ?optimized, 8ms? on cpu: * is under the floor 3.00x (the whole interval is); * pairs "
        "timed again at the session's end read [01].[09]*x (up to *x)",
    ])
    assert "GATE FAILED: a_passing" not in result.stdout.str()
    rows = {r["kernel"]: r for r in json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"]}
    # all its pairs may pass (the second stretch outnumbers the first) or straddle: never a failure
    assert rows["a_passing"]["outcome"] in ("ok", "unresolved") and rows["a_passing"]["confirm_speedup"] > 3.0
    assert rows["c_lost"]["outcome"] == "FAIL" and rows["c_lost"]["confirm_high"] < 3.0
    for row in rows.values():
        # its 7 pairs, 7 again (and, where all of them straddle the floor, an extension: one more visit)
        assert row["rounds"][0] - 7 >= row["confirmed"] >= 7 and row["visits"] == 2 + bool(row["extended"]), row


@pytest.mark.paced
def test_no_second_stretch_without_the_budget_for_one(pytester: pytest.Pytester) -> None:
    """--perf-extend 0: no pairs at the session's end, so a missed floor fails as measured."""
    pytester.makepyfile(test_twice=SUITE)
    result = pytester.runpytest(*FAST, "--perf-extend=0", "--benchmark-json=out.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines_random(["GATE FAILED: a_passing ?optimized, 8ms? on cpu: * is under the floor "
                                        "3.00x (the whole interval is)"])
    rows = json.loads((pytester.path / "out.json").read_text())["perfgate"]["speedups"]
    assert [r["confirmed"] for r in rows] == [0, 0]


@pytest.mark.parametrize(("again", "fails"), [(2.0, True), (1.0, False)])
def test_a_failure_the_extension_brings_is_timed_again(again: float, fails: bool) -> None:
    """A row straddling its floor is extended; where the extension's pairs (a host state that
    halved the kernel's speed) pull it under, it is timed again, as any failure is, and fails
    only if that stretch misses too."""
    import types

    import numpy as np

    from perfgate.state import Floors, GateState, Measurement, Probes, Settings, Visits

    rng = np.random.default_rng(1)
    paired = [(float(3.05 * (1 + 0.1 * rng.standard_normal())), 1.0) for _ in range(20)]
    settings = Settings(device="cpu", size="smoke", threads=1, tolerance=0.2, fingerprint={}, slug="x",
                        extend_s=60.0)
    st = GateState(settings, Probes(timer=types.SimpleNamespace(cost=lambda t: t * 1e-3), host=None, threads=1),
                   floors=Floors())
    st.floors.speed[("k", "optimized")] = 3.0
    st.results = {"k": {"reference": Measurement([3.0] * 5, "smoke", "", None),
                        "optimized": Measurement([1.0] * 5, "smoke", "", None, paired=paired)}}
    st.later.timers[("k", "optimized")] = Visits("k", "optimized", None, None, (1, 1), [])
    calls: list[int] = []

    def time_pairs(later, pairs: int) -> None:  # the extension slow; the stretch timed again at ``again``
        m = st.results["k"]["optimized"]
        m.paired += [(3.05, 2.0 if len(calls) < 2 else again)] * pairs
        calls.append(pairs)

    st._time_pairs = time_pairs
    assert st._row("k", "optimized").outcome == "unresolved"
    (row,) = st.compute_rows()
    assert row.extended > 0 and row.confirmed > 0, (calls, row.extended, row.confirmed)
    assert (row.outcome == "FAIL") == fails, (row.outcome, row.failures, row.unresolved)


def _state(paired: list[tuple[float, float]], again: float, extend_s: float = 60.0, skipped: int = 0):
    """A session: row ``k [optimized]`` at ``paired``, floor 3, later pairs at ``again``x; its pair counts."""
    import types

    from perfgate.state import Floors, GateState, Measurement, Probes, Settings, Visits

    settings = Settings(device="cpu", size="smoke", threads=1, tolerance=0.2, fingerprint={}, slug="x",
                        extend_s=extend_s)
    st = GateState(settings, Probes(timer=types.SimpleNamespace(cost=lambda t: t), host=None, threads=1),
                   floors=Floors())
    st.floors.speed[("k", "optimized")] = 3.0
    st.results = {"k": {"reference": Measurement([3.0] * 5, "smoke", "", None),
                        "optimized": Measurement([1.0] * 5, "smoke", "", None, paired=list(paired))}}
    st.later.timers[("k", "optimized")] = Visits("k", "optimized", None, None, (1, 1), [])
    if skipped:
        st.later.skipped[("k", "optimized")] = skipped
    calls: list[int] = []

    def time_pairs(later, pairs: int) -> None:
        st.results["k"]["optimized"].paired += [(again, 1.0)] * pairs
        calls.append(pairs)

    st._time_pairs = time_pairs
    return st, calls


def test_a_failure_is_timed_again_for_the_pairs_it_was_given_and_at_least_min_pairs() -> None:
    """A second stretch times as many pairs as the row was given (timed and skipped), at least MIN_PAIRS."""
    from perfgate.state import MIN_PAIRS

    st, calls = _state([(2.0, 1.0)] * 6, again=2.0)
    (row,) = st.compute_rows()
    assert calls == [MIN_PAIRS] and row.confirmed == MIN_PAIRS and row.outcome == "FAIL"
    assert row.confirm_speedup == pytest.approx(2.0) and row.confirm_high == pytest.approx(2.0)
    st, calls = _state([(2.0, 1.0)] * 8, again=2.0, extend_s=600.0, skipped=10)
    (row,) = st.compute_rows()
    assert calls == [18] and row.confirmed == 18 and row.rounds[0] == 26


def test_a_second_stretch_is_read_at_the_verdicts_confidence() -> None:
    """``confirm_speedup`` and ``confirm_high`` are the second stretch's own 95% interval."""
    from perfgate.stats import speedup_interval

    st, _ = _state([(2.0, 1.0)] * 20, again=2.0, extend_s=600.0)
    m = st.results["k"]["optimized"]
    st.compute_rows()
    ratios = [2.0 + 0.02 * i for i in range(20)]  # 20 pairs: the 95% and 99% sign intervals differ
    m.paired[20:] = [(r, 1.0) for r in ratios]
    row = st._row("k", "optimized")
    point, _, high = speedup_interval(ratios, [1.0] * 20, 0.95, paired=True)
    assert (row.confirm_speedup, row.confirm_high) == (pytest.approx(point), pytest.approx(high))


def test_no_second_stretch_shorter_than_min_pairs() -> None:
    """Where --perf-extend holds fewer than MIN_PAIRS pairs, no second stretch is timed."""
    from perfgate.state import MIN_PAIRS

    st, calls = _state([(2.0, 1.0)] * 8, again=4.0, extend_s=6.0 * (MIN_PAIRS - 1) + 1.0)  # a pair: 6 s
    (row,) = st.compute_rows()
    assert calls == [] and row.confirmed == 0 and row.outcome == "FAIL"


def test_a_straddled_row_is_extended_only_within_its_budget() -> None:
    """A straddled row gets only the pairs --perf-extend holds, and ``extended`` counts them."""
    straddling = [(2.0 + 0.25 * i, 1.0) for i in range(8)]  # 2.0 to 3.75 under a floor of 3
    st, calls = _state(straddling, again=3.0, extend_s=1.0)  # a pair: about 8 s
    (row,) = st.compute_rows()
    assert calls == [] and row.extended == 0 and row.outcome == "unresolved"
    st, calls = _state(straddling, again=3.5, extend_s=60.0)
    (row,) = st.compute_rows()
    assert calls and row.extended == sum(calls) == row.rounds[0] - 8


def test_a_confirmed_failure_is_not_extended_for_a_baseline_it_straddles() -> None:
    """A row failing its floor after its second stretch is not measured further for the baseline it straddles."""
    st, calls = _state([(2.0, 1.0)] * 8, again=2.0)
    st.stored.speedups = {"k::optimized::smoke": (2.6, 2.0)}  # under 0.8 x 2.6, its high reaching 2.0
    (row,) = st.compute_rows()
    assert calls == [8] and row.extended == 0 and row.outcome == "FAIL"
