"""``--perf-gated-only``: a session times only what a rule judges. An impl no floor or stored
baseline involves is skipped (and named), a row only a memory floor judges is timed without
interleaved pairs, a comparison row with no floor is not made; the rows a floor judges are
measured and gated as without the option. The timed callables sleep (test_plugin.py's convention).
"""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.paced  # perf sessions whose timed calls sleep: one a core (make correctness)

FAST = ["--perf-device", "cpu", "--benchmark-max-time=0.1", "--benchmark-min-rounds=8", "-p", "no:cacheprovider",
        "--perf-contended=inf"]

# ours (4x, floored), a fast path keyed to a variant it does not run, a plain impl nothing judges,
# a peer ours is floored over, a second peer compared without a floor, and a memory-only impl
SUITE = """
import time
import pytest

SLEEP = {{"reference": 0.008, "optimized": 0.002, "keyed": 0.004, "plain": 0.004, "peer": 0.004,
          "other peer": 0.004, "lean": 0.004}}

@pytest.mark.speedup(cpu={floor})
@pytest.mark.speedup(cpu=1.2, over="peer")
@pytest.mark.speedup(over="other peer")
@pytest.mark.speedup(cpu=1.5, impl="keyed", variant="fast*")
@pytest.mark.memory(cpu=0.5, impl="lean")
@pytest.mark.parametrize("impl", ["reference", "optimized", "keyed", "plain", "peer", "other peer", "lean"])
def test_sleepy(perf, impl):
    def call():  # the reference and lean allocate (zero-filled: every page touched), 16 MiB and 2,
        end = time.perf_counter() + SLEEP[impl]  # within their sleep: the host's fill speed sets no ratio
        buf = bytearray({{"reference": 16, "lean": 2}}.get(impl, 0) * 2**20)
        time.sleep(max(0.0, end - time.perf_counter()))
        return len(buf)
    perf(call, label="8ms", variant="slow" if impl == "keyed" else None)

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_unfloored(perf, impl):
    perf(lambda: time.sleep(SLEEP[impl]), label="8ms")
"""


def _rows(pytester: pytest.Pytester) -> dict[str, dict]:
    section = json.loads((pytester.path / "out.json").read_text())["perfgate"]
    return {f"{r['kernel']} [{r['impl']}]": r for r in section["speedups"]}


def test_only_what_a_rule_judges_is_timed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # the budget an impl's own rounds fill, scaled to these 2-8 ms calls (1 s for the suite's)
    monkeypatch.setattr("perfgate.case.GATED_ROUNDS_S", 0.02)
    pytester.makepyfile(test_gated=SUITE.format(floor=2.0))
    result = pytester.runpytest(*FAST, "--perf-gated-only", "--perf-require-floors", "--benchmark-json=out.json",
                                "-rs")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=5, skipped=4)
    result.stdout.fnmatch_lines(["*perfgate: --perf-gated-only: 4 impl(s) not timed, no floor or stored "
                                 "baseline judges them here (a session without it times them): sleepy [[]plain], "
                                 "sleepy [[]other peer], unfloored [[]reference], unfloored [[]optimized]",
                                 "*gate passed*"])
    result.stdout.fnmatch_lines(["SKIPPED*sleepy [[]plain]: no floor or stored baseline judges it here "
                                 "(--perf-gated-only; a session without it times it)"])
    rows = _rows(pytester)
    assert set(rows) == {"sleepy [optimized]", "sleepy [keyed]", "sleepy [peer]", "sleepy [lean]",
                         "sleepy [optimized vs peer]"}
    # the floored rows are timed in interleaved pairs; keyed ran a variant its floor is not for, and
    # the peer's own row and lean (memory only) are judged on no speedup: their own rounds only
    assert {k for k, r in rows.items() if r["interleaved"]} == {"sleepy [optimized]", "sleepy [optimized vs peer]"}
    assert rows["sleepy [optimized]"]["floor"] == 2.0 and rows["sleepy [optimized vs peer]"]["floor"] == 1.2
    assert rows["sleepy [keyed]"]["floor"] is None and rows["sleepy [lean]"]["memory_floor"] == 0.5
    # 5 rounds cap the pairs at 7, timed as 4 and 3: 4 pairs 4x apart decide nothing (no 99% interval
    # on 4 has a bound), so none is skipped; the verdict's interval reaches the lowest and highest pair
    for row in (rows["sleepy [optimized]"], rows["sleepy [optimized vs peer]"]):
        assert row["rounds"][0] == 7 and row["skipped"] == 0 and row["visits"] == 2, row
    # no rule reads an impl's own rounds: not --benchmark-min-rounds' 8 but at most the 5 a bootstrap
    # needs, fewer where a call is long (what fits in GATED_ROUNDS_S by its first call), at least 2
    benchmarks = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    rounds = {b["name"]: (b["stats"]["rounds"], b["extra_info"]["first_call_ms"] / 1e3) for b in benchmarks}
    assert len(rounds) == 5 and all(n == max(2, min(5, math.ceil(0.02 / first))) for n, first in rounds.values())
    assert rounds["test_sleepy[reference]"][0] < 5 <= rounds["test_sleepy[optimized]"][0], rounds  # 8 ms, 2 ms


def test_a_floor_missed_still_fails(pytester: pytest.Pytester) -> None:
    # ours 4x (2 ms to the reference's 8) against 20:
    # missed, the same verdict as without
    pytester.makepyfile(test_gated=SUITE.format(floor=20.0))
    result = pytester.runpytest(*FAST, "--perf-gated-only")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    failed = "*GATE FAILED: sleepy [[]optimized, 8ms] on cpu: speedup *under the floor 20.00x*"
    result.stdout.fnmatch_lines([failed])


def test_a_stored_baseline_judges_the_rows_it_holds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gated=SUITE.format(floor=2.0))
    assert pytester.runpytest(*FAST, "--benchmark-save=base").ret == 0
    result = pytester.runpytest(*FAST, "--perf-gated-only", "--benchmark-compare", "--benchmark-json=out.json")
    assert result.ret == 0, result.stdout.str()
    rows = _rows(pytester)
    # every row of ours has a stored speedup now, so each is timed and paired; peers' rows are not
    # gated by a baseline, and a comparison without a floor is still not made
    for row in ("sleepy [plain]", "sleepy [keyed]", "sleepy [lean]", "unfloored [optimized]"):
        assert rows[row]["interleaved"] and rows[row]["baseline"] is not None, row
    assert "sleepy [optimized vs other peer]" not in rows and not rows["sleepy [peer]"]["interleaved"]
    # peak memory is read where a memory floor could judge it (a memory-marked test), nowhere else
    assert rows["sleepy [optimized]"]["optimized_peak_bytes"] is not None
    unfloored = rows["unfloored [optimized]"]
    assert (unfloored["reference_peak_bytes"], unfloored["optimized_peak_bytes"]) == (None, None)


def test_a_saved_run_refuses_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gated=SUITE.format(floor=2.0))
    result = pytester.runpytest(*FAST, "--perf-gated-only", "--benchmark-save=base")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-gated-only leaves out the rows nothing judges*drop one of the two"])
