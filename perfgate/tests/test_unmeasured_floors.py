"""A declared floor whose row was not measured is named, with why, and fails the session under
``--perf-require-floors``: ``-k optimized`` (the reference deselected), a reference that skips or
fails, a peer that is not installed, an impl name the test lacks, a run that deselects everything.
Floors that do not apply here (another device class, another variant, CPU floors at another thread
count, other shards' tests) are not listed. The timed callables sleep (test_plugin.py's convention).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.paced  # perf sessions whose timed calls sleep: one a core (make correctness)

# --perf-contended=inf: these suites test the rules on speedups set by design; a busy CI host must
# not turn their designed failures unresolved (test_contention.py tests that rule)
FAST = ["--perf-device", "cpu", "--benchmark-max-time=0.1", "--benchmark-min-rounds=8", "-p", "no:cacheprovider",
        "--perf-contended=inf"]

# Three impls: the reference, ours (4x), a peer (2x); floors on ours over each, and a CUDA-only
# floor, which a CPU session never lists. ``{body}`` runs before the timing (``impl`` in scope).
SUITE = """
import time
import pytest

SLEEP = {{"reference": 0.008, "optimized": 0.002, "peer": 0.004}}

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.speedup(cpu=1.2, over="peer")
@pytest.mark.speedup(cuda=9.0, impl="peer")
@pytest.mark.parametrize("impl", ["reference", "optimized", "peer"])
def test_sleepy(perf, impl):
    {body}
    perf(lambda: time.sleep(SLEEP[impl]), label="8ms")
"""
OURS = "sleepy [[]optimized]: speedup floor 2.00x not measured: "
OVER_PEER = "sleepy [[]optimized vs peer]: speedup floor 1.20x not measured: "

CASES = {  # body, -k, the reasons for (ours, ours over the peer) (None: measured), tests' own exit
    "reference deselected": ("pass", "optimized", ("reference deselected", "'peer' deselected"), 0),
    "reference skipped": ('if impl == "reference": pytest.skip("no reference here")', "",
                          ("reference skipped (no reference here)",) * 2, 0),
    "reference failed": ('assert impl != "reference"', "", ("reference failed",) * 2, 1),
    "peer skipped": ('if impl == "peer": pytest.skip("peer: not installed")', "",
                     (None, "'peer' skipped (peer: not installed)"), 0),
    "ours skipped": ('if impl == "optimized": pytest.skip("ours is off")', "", ("skipped (ours is off)",) * 2, 0),
}


def _lines(reasons: tuple[str | None, str | None], prefix: str) -> list[str]:
    return [f"{prefix}{row}{why}*" for row, why in zip((OURS, OVER_PEER), reasons, strict=True) if why is not None]


@pytest.mark.parametrize("case", list(CASES))
def test_a_floor_whose_row_was_not_measured_is_named_and_required(pytester: pytest.Pytester, case: str) -> None:
    body, select, reasons, tests_ret = CASES[case]
    pytester.makepyfile(test_floors=SUITE.format(body=body))
    args = [*FAST, "-k", select] if select else FAST
    result = pytester.runpytest(*args, "--perf-require-floors", "--benchmark-json=out.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines_random(_lines(reasons, "GATE FAILED: "))
    out = result.stdout.str()
    assert "gate passed" not in out and "speedup floor 9.00x" not in out  # the CUDA floor is not listed
    section = json.loads((pytester.path / "out.json").read_text())["perfgate"]
    listed = {(f["impl"], f["kind"], f["floor"], f["required"]) for f in section["unmeasured_floors"]}
    want = [("optimized", "speedup", 2.0, True), ("optimized vs peer", "speedup", 1.2, True)]
    assert listed == {w for w, why in zip(want, reasons, strict=True) if why is not None}
    # without the flag: listed, and the session's exit is the tests' own
    result = pytester.runpytest(*args)
    assert result.ret == tests_ret, result.stdout.str()
    result.stdout.fnmatch_lines_random([*_lines(reasons, "NOT MEASURED: "), "*declared floor(s) not checked*"
                                        "--perf-require-floors fails a session on them*"])


def test_speedup_floors_not_applied_this_session_are_not_listed(pytester: pytest.Pytester) -> None:
    """At another --perf-threads the CPU speedup floors are not applied, measured or not."""
    import torch

    from perfgate import session

    default = session._DEFAULT_THREADS[0] if session._DEFAULT_THREADS else torch.get_num_threads()
    pytester.makepyfile(test_floors=SUITE.format(body="pass"))
    result = pytester.runpytest(*FAST, "-k", "optimized", "--perf-require-floors",
                                f"--perf-threads={1 if default != 1 else 2}")
    assert result.ret == 0, result.stdout.str()
    assert "not measured" not in result.stdout.str()


KEYED = """
import time
import pytest

@pytest.mark.speedup(cpu=2.0, variant="bf16*")
@pytest.mark.speedup(cpu=1.5, impl="amp", variant="bf16*")
@pytest.mark.parametrize("impl", ["reference", "optimized", "amp"])
def test_keyed(perf, impl):
    if impl == "amp":
        pytest.skip("amp: no bf16 instructions here")
    perf(lambda: time.sleep(0.004 if impl == "reference" else 0.002), label="keyed", variant="fp32")
"""


def test_a_variant_keyed_floor_is_required_unless_its_impl_ran_another_variant_or_skipped(
        pytester: pytest.Pytester) -> None:
    """Ours ran fp32: its bf16 floor does not apply, listed or not. The amp impl skipped itself (as
    perf_tests' bf16 rows do on a CPU without bf16): a skipped test reports no variant, so its
    floor is noted, not required. Deselected, it could have run bf16: required."""
    pytester.makepyfile(test_keyed=KEYED)
    result = pytester.runpytest(*FAST, "--perf-require-floors")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["perfgate: keyed [[]amp]: speedup floor 1.50x for variant 'bf16[*]' not "
                                 "measured: skipped (amp: no bf16 instructions here); the skipped test reported "
                                 "no variant*", "*gate passed*"])
    assert "keyed [optimized]: speedup floor" not in result.stdout.str()
    result = pytester.runpytest(*FAST, "--perf-require-floors", "--deselect", "test_keyed.py::test_keyed[amp]")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["GATE FAILED: keyed [[]amp]: speedup floor 1.50x for variant 'bf16[*]' not "
                                 "measured: deselected (--perf-require-floors)"])


MISSPELT = """
import time
import pytest

@pytest.mark.speedup(cpu=1.5, impl="optimised")
@pytest.mark.memory(cpu=0.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_misspelt(perf, impl):
    perf(lambda: time.sleep(0.002))
"""


def test_a_floor_on_an_impl_the_test_lacks_and_a_run_that_deselects_everything(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_misspelt=MISSPELT)
    result = pytester.runpytest(*FAST, "--perf-require-floors", "-k", "optimized")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines_random([
        "GATE FAILED: misspelt [[]optimised]: speedup floor 1.50x not measured: not one of the test's impls "
        "[[]'reference', 'optimized'] (--perf-require-floors)",
        "GATE FAILED: misspelt [[]optimized]: memory floor 50% saved not measured: reference deselected*"])
    result = pytester.runpytest(*FAST, "--perf-require-floors", "-k", "nothing_matches")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # not 5 (no tests collected): the floors were asked for
    result.stdout.fnmatch_lines(["GATE FAILED: misspelt [[]optimized]: memory floor 50% saved not measured: "
                                 "deselected*"])


SHARDED = """
import time
import pytest

@pytest.mark.speedup(cpu=1.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_alpha(perf, impl):
    perf(lambda: time.sleep(0.004 if impl == "reference" else 0.002))

@pytest.mark.speedup(cpu=1.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_beta(perf, impl):
    perf(lambda: time.sleep(0.004 if impl == "reference" else 0.002))
"""


def test_the_floors_of_other_shards_are_not_listed(pytester: pytest.Pytester) -> None:
    """A shard deselects the other shards' tests: their floors are checked there, not missed here."""
    pytester.makepyfile(test_sharded=SHARDED)
    for shard in ("1/2", "2/2"):
        result = pytester.runpytest(*FAST, "--perf-require-floors", "--perf-shard", shard)
        assert result.ret == 0, result.stdout.str()
        result.assert_outcomes(passed=2, deselected=2)
        assert "not measured" not in result.stdout.str()


def test_the_floor_policy_applies_speedup_floors_only_where_they_were_set() -> None:
    """CPU speedup floors hold at torch's default threads under the caching malloc; memory floors,
    and every floor on a GPU, apply everywhere."""
    from perfgate.floors import FloorPolicy

    policy = FloorPolicy.for_session
    assert policy("cpu", 2, 2, "cache").applied and policy("cpu", None, None, "cache").applied
    assert policy("cuda", 1, 16, "n/a").applied
    at_one = policy("cpu", 1, 2, "cache")
    assert at_one.off == "at --perf-threads 1" and at_one.applies("memory") and not at_one.applies("speedup")
    assert policy("cpu", 2, 2, "default").off == "under --perf-malloc default"
    assert at_one.held_to() == "without speedup floors (not applied at --perf-threads 1)"
    assert FloorPolicy().held_to() == "at or above their floors"


def test_a_floor_is_read_for_the_devices_class_and_a_memory_floor_is_under_1() -> None:
    """Any CUDA device (``cuda:1``) reads cuda= floors; a memory floor of 1 (all saved) is refused."""
    import types

    from perfgate.floors import checked_value, floor_value

    mark = pytest.mark.speedup(cpu=2.0, cuda={"smoke": 3.0}).mark
    assert floor_value(mark, "cuda:1", "smoke") == 3.0 and floor_value(mark, "cpu", "smoke") == 2.0
    item = types.SimpleNamespace(nodeid="t.py::test_k")
    assert checked_value(item, pytest.mark.memory(cpu=0.0).mark, "memory", "cpu", "smoke") == 0.0
    with pytest.raises(pytest.UsageError, match="a fraction saved in \\[0, 1\\), got 1"):
        checked_value(item, pytest.mark.memory(cpu=1.0).mark, "memory", "cpu", "smoke")


def test_a_variant_keyed_floor_of_an_impl_timed_without_its_row_applies_where_the_variant_matches() -> None:
    """Impl timed, reference deselected: a variant-keyed floor is unmeasured on a matching variant only."""
    from perfgate.floors import Floor, FloorPolicy, Ledger

    floor = Floor(kernel="k", impl="optimized", over=None, kind="speedup", value=2.0, variant="bf16*",
                  impls=("reference", "optimized"))
    nodeids = {("k", impl): f"t.py::test_k[{impl}]" for impl in ("reference", "optimized")}
    ledger = Ledger([floor], nodeids, deselected={"t.py::test_k[reference]"})
    missed = ledger.unmeasured(set(), {("k", "optimized"): "bf16+channels_last"}, policy=FloorPolicy(),
                               benchmarks_off=False)
    assert [(u.reason, u.required) for u in missed] == [("reference deselected", True)]
    assert ledger.unmeasured(set(), {("k", "optimized"): "fp32"}, policy=FloorPolicy(), benchmarks_off=False) == []
