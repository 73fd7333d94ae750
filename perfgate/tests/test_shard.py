"""Sharding the perf suite (``--perf-shard K/N``) and merging the shards
(``python -m perfgate.report --merge``): the merged table and verdict are those of one unsharded
run, and shards that do not belong together are refused. The timed callables sleep, so every
row's speedup is set by the test (test_plugin.py's convention)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfgate.report import main as report_main
from perfgate.shard import parse, plan, stored_weights

pytestmark = pytest.mark.paced  # perf sessions whose timed calls sleep: one a core (make correctness)

# Four test functions, one parametrized over a second argument: its rows must stay in one shard.
SUITE = """
import time
import pytest

def pair(perf, impl, ref, opt):
    perf(lambda: time.sleep(ref if impl == "reference" else opt), label=f"{{ref * 1e3:g}}ms")

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_alpha(perf, impl):
    pair(perf, impl, 0.008, 0.002)

@pytest.mark.speedup(cpu=1.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("n", [1, 2])
def test_beta(perf, impl, n):
    pair(perf, impl, 0.006, 0.002)

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_gamma(perf, impl):
    pair(perf, impl, 0.008, {gamma})

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_delta(perf, impl):
    pair(perf, impl, 0.004, 0.002)
"""
# --perf-contended=inf: these suites test the rules on speedups set by design; a busy CI host must
# not turn their designed failures unresolved (test_contention.py tests that rule)
FAST = ["--perf-device", "cpu", "--benchmark-max-time=0.1", "--benchmark-min-rounds=10", "--perf-visits=1",
        "-p", "no:cacheprovider", "--perf-contended=inf"]


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*FAST, *args)


def _section(path: Path) -> dict:
    return json.loads(path.read_text())["perfgate"]


def _shards(pytester: pytest.Pytester, *args: str, count: int = 2) -> list[str]:
    names = []
    for k in range(1, count + 1):
        names.append(str(pytester.path / f"shard{k}.json"))
        _run(pytester, f"--perf-shard={k}/{count}", f"--benchmark-json={names[-1]}", *args)
    return names


def _merge(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    ret = report_main(["--merge", *args])
    out, err = capsys.readouterr()
    return ret, out, err


def _rows(section: dict) -> dict[tuple[str, str], tuple]:
    """What a merge must reproduce of each row: its floor, stored baseline and outcome (the
    speedups themselves are separate measurements)."""
    return {(r["kernel"], r["impl"]): (r["floor"], r["baseline"], r["outcome"]) for r in section["speedups"]}


def test_merged_shards_give_the_rows_and_verdict_of_one_unsharded_run(pytester: pytest.Pytester, capsys) -> None:
    pytester.makepyfile(test_suite=SUITE.format(gamma=0.002))
    assert _run(pytester, "--benchmark-save=base").ret == 0
    whole = _run(pytester, "--benchmark-compare", f"--benchmark-json={pytester.path / 'whole.json'}")
    assert whole.ret == 0
    whole.stdout.fnmatch_lines(["*gate passed: 5 speedup(s)*"])
    shards = _shards(pytester, "--benchmark-compare")
    units = [set(_section(Path(s))["shard"]["units"]) for s in shards]
    assert units[0] and units[1] and not units[0] & units[1]
    names = {u.split("::")[1] for u in units[0] | units[1]}
    assert names == {f"test_{n}" for n in ("alpha", "beta", "gamma", "delta")}
    for s in shards:  # every row of a shard comes from its own test functions, all parametrizations together
        kernels = {r["kernel"].split("[")[0] for r in _section(Path(s))["speedups"]}
        assert kernels == {u.split("::test_")[1] for u in _section(Path(s))["shard"]["units"]}
    # the saved run recorded each test function's seconds, and the shards were split by them
    (saved,) = (pytester.path / ".benchmarks").rglob("*.json")
    durations = _section(saved)["durations"]
    assert sorted(u.split("::")[1] for u in durations) == ["test_alpha", "test_beta", "test_delta", "test_gamma"]
    assert durations["test_suite.py::test_beta"] > durations["test_suite.py::test_alpha"] > 0  # 4 items vs 2
    assert stored_weights(saved.parents[1], "perfgate") == (durations, saved.name)
    assert {_section(Path(s))["shard"]["weights_from"] for s in shards} == {saved.name}
    ret, out, _ = _merge(capsys, *shards, "--output", str(pytester.path / "merged.json"))
    assert ret == 0, out
    assert "gate passed: 5 speedup(s) at or above their floors" in out
    merged = _section(pytester.path / "merged.json")
    assert _rows(merged) == _rows(_section(pytester.path / "whole.json"))
    assert all(r[1] is not None for r in _rows(merged).values())  # every row compared with the baseline
    assert len(json.loads((pytester.path / "merged.json").read_text())["benchmarks"]) == 10
    # the merged run reads back as one run
    assert report_main([str(pytester.path / "merged.json"), "--quiet"]) == 0


BROKEN = """
import time
import pytest

@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_broken(perf, impl):
    perf(lambda: time.sleep(0.002), label="2ms")
    assert impl == "reference", "the optimized impl computed something else"
"""


def test_a_failed_row_or_test_in_a_shard_fails_the_merge(pytester: pytest.Pytester, capsys) -> None:
    """gamma lost its 2x (1x against its floor 2.0), and a perf test's own assertion fails: the
    rows alone would not show the second."""
    pytester.makepyfile(test_suite=SUITE.format(gamma=0.008), test_broken=BROKEN)
    shards = _shards(pytester)
    ret, out, _ = _merge(capsys, *shards)
    assert ret == 1
    assert "GATE FAILED: gamma [optimized, 8ms]" in out and "is under the floor 2.00x" in out
    broken = next(k for k, s in enumerate(shards, 1) if _section(Path(s))["tests_failed"])
    assert f"TESTS FAILED in shard {broken}" in out and "1 test(s)" in out


def _edited(path: str, edit, name: str) -> str:
    data = json.loads(Path(path).read_text())
    edit(data)
    out = path.replace(".json", f"-{name}.json")
    Path(out).write_text(json.dumps(data))
    return out


REFUSED = {  # an edit of shard 2's JSON -> what the refusal says
    "another fingerprint": lambda d: d["perfgate"]["fingerprint"].update(threads=99),
    "another size": lambda d: d["perfgate"].update(size="full"),
    "another baseline": lambda d: d["perfgate"].update(baseline="abc 2026"),
    "another require_floors": lambda d: d["perfgate"].update(require_floors=True),
    "measured commit": lambda d: d["commit_info"].update(id="deadbeef"),
    "another plan": lambda d: d["perfgate"]["shard"].update(plan="0" * 16),
    "not written by a sharded run": lambda d: d["perfgate"].update(shard=None),
}


def test_shards_that_do_not_belong_together_are_refused(pytester: pytest.Pytester, capsys) -> None:
    pytester.makepyfile(test_suite=SUITE.format(gamma=0.002))
    first, second = _shards(pytester)
    assert _merge(capsys, first, second)[0] == 0
    for i, (message, edit) in enumerate(REFUSED.items()):
        ret, _, err = _merge(capsys, first, _edited(second, edit, str(i)))
        assert ret == 2 and message in err, (message, err)
    ret, _, err = _merge(capsys, first)
    assert ret == 2 and "missing [2]" in err
    ret, _, err = _merge(capsys, first, first)
    assert ret == 2 and "missing [2], repeated [1]" in err


def test_shard_option_is_checked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE.format(gamma=0.002))
    for bad in ("3/2", "0/2", "1-2", "a/b"):
        result = _run(pytester, f"--perf-shard={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*--perf-shard must be K/N*"])
    result = _run(pytester, "--perf-shard=1/5")  # 4 test functions cannot fill 5 shards
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*4 test function(s)*use at most 4 shards*"])


def test_plan_balances_stored_durations_and_is_deterministic() -> None:
    units = ["a", "b", "c", "d", "e"]
    weights = {"a": 10.0, "b": 6.0, "c": 5.0, "d": 4.0}  # e unknown: the median known weight, 5.5
    assignment = plan(units, weights, 2)
    # longest first onto the lighter shard: a (10) -> 1, b (6) -> 2, e (5.5) -> 2, c (5) -> 1, d (4) -> 2
    assert assignment == {"a": 1, "b": 2, "e": 2, "c": 1, "d": 2}
    assert assignment == plan(list(reversed(units)), weights, 2)  # the collection's order does not matter
    assert plan(units, {}, 5) == {u: i + 1 for i, u in enumerate(units)}
    assert parse(" 2 / 3 ") == (2, 3)


# alpha's third impl and beta's reference are deselected: beta's floor goes unmeasured, alpha's is
# measured (its step has no floor) in the shard that runs alpha
UNMEASURED = """
import time
import pytest

SLEEP = {"reference": 0.008, "optimized": 0.002, "step": 0.004}

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.parametrize("impl", ["reference", "optimized", "step"])
def test_alpha(perf, impl):
    perf(lambda: time.sleep(SLEEP[impl]), label="8ms")

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_beta(perf, impl):
    perf(lambda: time.sleep(SLEEP[impl]), label="8ms")
"""
DESELECT = ["--deselect", "test_suite.py::test_alpha[step]", "--deselect", "test_suite.py::test_beta[reference]"]
BETA_MISSED = "beta [optimized]: speedup floor 2.00x not measured: reference deselected"


def test_a_floor_no_shard_measured_fails_the_merge_under_require_floors(pytester: pytest.Pytester, capsys) -> None:
    """The merge carries the shards' unmeasured floors and --perf-require-floors: an unsharded run
    fails on beta's floor, and so does the merge, once; alpha's floor, measured in its shard, is
    listed by neither shard."""
    pytester.makepyfile(test_suite=UNMEASURED)
    whole = _run(pytester, *DESELECT, "--perf-require-floors")
    assert whole.ret == pytest.ExitCode.TESTS_FAILED
    whole.stdout.fnmatch_lines([f"GATE FAILED: {BETA_MISSED} (--perf-require-floors)"])
    shards = _shards(pytester, *DESELECT, "--perf-require-floors")
    alpha = next(s for s in shards if "test_suite.py::test_alpha" in _section(Path(s))["shard"]["units"])
    assert _section(Path(alpha))["unmeasured_floors"] == []  # beta's floor is its own shard's to list
    capsys.readouterr()  # the shards' sessions' output
    ret, out, _ = _merge(capsys, *shards, "--output", str(pytester.path / "merged.json"))
    assert ret == 1, out
    assert out.count("GATE FAILED") == 1 and f"GATE FAILED: {BETA_MISSED} (--perf-require-floors)" in out
    assert [f["kernel"] for f in _section(pytester.path / "merged.json")["unmeasured_floors"]] == ["beta"]
    # without the flag the merge names it and passes, as an unsharded run does
    shards = _shards(pytester, *DESELECT)
    capsys.readouterr()
    ret, out, _ = _merge(capsys, *shards)
    assert ret == 0, out
    assert f"NOT MEASURED: {BETA_MISSED}" in out and "gate passed" in out


def _limits(stream: float) -> dict:
    return {"version": 1, "slug": "s", "device": "cpu", "stream_gbps": stream, "gemm_gflops": {"float32": 80.0},
            "gemm_n": {}, "measured": {}}


def _placed(kernel: str) -> dict:
    return {"kernel": kernel, "impl": "optimized", "label": "", "ms": 1.0, "bytes": 1e6, "flops": {},
            "fraction": 0.5, "bound": "memory", "gbps": 1.0, "gflops": 0.0, "note": ""}


def test_a_merge_names_each_shards_roofline_limits_where_they_differ(pytester: pytest.Pytester, capsys) -> None:
    """Each shard places its impls under its own runner's limits: where those differ, the merged
    run's report shows every shard's, not the first one's alone."""
    pytester.makepyfile(test_suite=SUITE.format(gamma=0.002))
    first, second = _shards(pytester)
    streams = {first: 30.0, second: 50.0}
    for path, stream in streams.items():
        kernels = {r["kernel"] for r in _section(Path(path))["speedups"]}
        _edited(path, lambda d, s=stream, k=kernels: d["perfgate"].update(
            roofline={"limits": _limits(s), "impls": [_placed(n) for n in sorted(k)]}), "limits")
    edited = [p.replace(".json", "-limits.json") for p in streams]
    merged, page = pytester.path / "merged.json", pytester.path / "merged.md"
    assert _merge(capsys, *edited, "--output", str(merged))[0] == 0
    assert report_main([str(merged), "--quiet", "--markdown", str(page)]) == 0
    text = page.read_text()
    assert "stream 30.0 GB/s" in text and "stream 50.0 GB/s" in text, text
    roofline = _section(merged)["roofline"]
    assert [s["limits"]["stream_gbps"] for s in roofline["shard_limits"]] == [30.0, 50.0]
    # alike, one line says them
    same = [_edited(p, lambda d: d["perfgate"]["roofline"].update(limits=_limits(30.0)), "same") for p in edited]
    assert _merge(capsys, *same, "--output", str(merged))[0] == 0
    assert report_main([str(merged), "--quiet", "--markdown", str(page)]) == 0
    assert page.read_text().count("stream 30.0 GB/s") == 1 and "50.0" not in page.read_text()


def test_figures_counted_under_an_earlier_rule_are_marked_so() -> None:
    """A run whose roofline figures were counted under an earlier counting rule (or before rules
    were recorded) says so under its roofline heading; one counted under today's rule does not;
    a merge of shards carries the earliest rule, none where a shard recorded none."""
    from perfgate.report import _roofline_markdown
    from perfgate.roofline import COUNT_RULE
    from perfgate.shard import _roofline

    def section(rule: int | None) -> dict:
        return {"limits": _limits(30.0), "impls": [_placed("k")], **({} if rule is None else {"count_rule": rule})}

    def marked(roofline: dict) -> bool:
        return any("Counted under an earlier rule" in line for line in _roofline_markdown(roofline))

    assert not marked(section(COUNT_RULE))
    assert marked(section(COUNT_RULE - 1)) and marked(section(None))
    assert f"rule {COUNT_RULE - 1};" in "".join(_roofline_markdown(section(COUNT_RULE - 1)))
    # the model as the run's rule made its figures: the writes-alone term from rule 6 on
    assert "bytes written at the write rate" in "".join(_roofline_markdown(section(COUNT_RULE)))
    for earlier in (5, None):
        assert "write rate" not in "".join(_roofline_markdown(section(earlier)))
    later = "".join(_roofline_markdown(section(COUNT_RULE + 1)))  # a newer perfgate's run, read by this one
    assert f"Counted under rule {COUNT_RULE + 1}, a later rule" in later and "earlier" not in later
    shards = [{"roofline": r, "shard": {"index": i + 1}} for i, r in enumerate([section(COUNT_RULE), section(1)])]
    assert _roofline(shards, [0, 1])["count_rule"] == 1
    shards[1]["roofline"] = section(None)
    assert _roofline(shards, [0, 1])["count_rule"] is None
    shards[1]["roofline"] = section(COUNT_RULE)
    assert _roofline(shards, [0, 1])["count_rule"] == COUNT_RULE


def _shard_run(index: int, rows: list[tuple[str, str]], **section) -> dict:
    """A shard's run as ``stored.read_run`` gives it: rows (kernel, impl) of 2x, shard ``index`` of 2."""
    speedups = [{"kernel": k, "impl": i, "size": "smoke", "speedup": 2.0} for k, i in rows]
    return {"_path": f"shard{index}.json", "benchmarks": [], "commit_info": {"id": "c0ffee"}, "datetime": "2026",
            "perfgate": {"slug": "s", "fingerprint": {"threads": 2}, "size": "smoke", "tolerance": 0.2,
                         "contended": 0.05, "floors_applied": True, "floors_off": "", "require_floors": False,
                         "baseline": None, "speedups": speedups,
                         "shard": {"index": index, "count": 2, "plan": "p"}, **section}}


def test_a_merge_refuses_a_row_twice_a_shard_twice_or_another_contended_share() -> None:
    """Shards repeating a row or a shard, or judged at another --perf-contended, do not merge; the rest sum up."""
    from perfgate.shard import MergeError, merge

    one, two = _shard_run(1, [("a", "optimized")]), _shard_run(2, [("b", "optimized")])
    with pytest.raises(MergeError, match="measured in two shards"):
        merge([one, _shard_run(2, [("a", "optimized")])], "perfgate")
    with pytest.raises(MergeError, match=r"repeated \[2\]"):
        merge([one, two, two], "perfgate")
    with pytest.raises(MergeError, match="another contended"):
        merge([one, _shard_run(2, [("b", "optimized")], contended=0.5)], "perfgate")
    unmeasured = [{"kernel": "a", "impl": "optimized"}, {"kernel": "c", "impl": "optimized"}]
    merged = merge([_shard_run(1, [("a", "optimized")], tests_failed=1),
                    _shard_run(2, [("b", "optimized")], tests_failed=2, unmeasured_floors=unmeasured)], "perfgate")
    assert merged["perfgate"]["tests_failed"] == 3
    assert merged["perfgate"]["unmeasured_floors"] == [{"kernel": "c", "impl": "optimized"}]


def test_a_merge_gates_at_the_shards_settings_and_exits_1_on_any_failure(capsys) -> None:
    """A merge gates at the shards' --perf-contended and --perf-require-floors, and exits 1 on any failure."""
    from perfgate.report import merged_verdict

    def shards(contention: float, floor: float, **section) -> list[dict]:
        runs = [_shard_run(1, [("a", "optimized")], **section), _shard_run(2, [("b", "optimized")], **section)]
        for run in runs:
            run["perfgate"]["speedups"][0].update(label="", device="cpu", reference_ms=4.0, optimized_ms=2.0,
                                                 low=1.9, high=2.1, rounds=[9, 9], interleaved=True, floor=floor,
                                                 contention=contention)
        return runs

    unmeasured = [{"kernel": "c", "impl": "optimized", "kind": "speedup", "floor": 2.0, "variant": None,
                   "reason": "deselected", "required": True}]
    assert merged_verdict(shards(0.0, 1.5), None) == 0
    assert merged_verdict(shards(0.3, 3.0, contended=float("inf")), None) == 1  # inf: judged, contended or not
    assert merged_verdict(shards(0.0, 1.5, require_floors=True, unmeasured_floors=unmeasured), None) == 1
    assert merged_verdict(shards(0.0, 3.0, unmeasured_floors=unmeasured), None) == 1  # a warning follows it
    capsys.readouterr()
