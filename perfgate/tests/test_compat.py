"""Every pytest-benchmark internal that compat.py reaches, checked by name and shape: an upgrade
that moves one fails here, loudly, before a perf session misreads it."""

from __future__ import annotations

import inspect
import json
import re

import pytest
from pytest_benchmark import session as benchmark_session
from pytest_benchmark.utils import load_storage

pytestmark = pytest.mark.timed  # perf sessions and clocks: run alone (make correctness)


def test_benchmark_session_has_what_compat_uses() -> None:
    init = inspect.getsource(benchmark_session.BenchmarkSession.__init__)
    for attribute in ("self.storage", "self.machine_id", "self.logger", "self.compare", "self.save",
                      "self.autosave"):
        assert attribute in init, f"BenchmarkSession no longer sets {attribute}"
    assert callable(benchmark_session.BenchmarkSession.handle_loading)
    assert list(inspect.signature(benchmark_session.BenchmarkSession.handle_loading).parameters) == ["self"]


def test_load_storage_takes_what_compat_passes(tmp_path) -> None:
    params = inspect.signature(load_storage).parameters
    assert "storage" in params
    storage = load_storage(f"file://{tmp_path}", logger=None, default_machine_id="m", netrc="")
    assert str(storage) == str(tmp_path) and storage.default_machine_id == "m"


RECORDS = """
import pytest
from pytest_benchmark.fixture import FixtureAlreadyUsed
from perfgate import compat

def test_rounds(benchmark):
    times, result = compat.record_rounds(benchmark, lambda: ([0.001 * (i + 1) for i in range(7)], "out"),
                                         timer="torch.cuda.Event")
    assert times == [0.001 * (i + 1) for i in range(7)] and result == "out"

def test_used_once(benchmark):
    compat.record_rounds(benchmark, lambda: ([0.001] * 5, None), timer="t")
    with pytest.raises(FixtureAlreadyUsed):
        benchmark.pedantic(lambda: None)

def test_timing_raised(benchmark):
    with pytest.raises(ZeroDivisionError):
        compat.record_rounds(benchmark, lambda: ([1 / 0], None), timer="t")
    assert benchmark.has_error

def test_session_attached(request):
    session = compat.benchmark_session(request.config)
    assert session is not None and hasattr(session, "storage") and hasattr(session, "handle_loading")
"""


def test_recorded_rounds_are_pytest_benchmarks_rounds(pytester: pytest.Pytester) -> None:
    """compat.record_rounds: the rounds given reach pytest-benchmark's stats and JSON as pedantic's
    would; the fixture is then used; a timing that raised records nothing."""
    pytester.makepyfile(test_records=RECORDS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-json=out.json")
    result.assert_outcomes(passed=4)
    benchmarks = {b["name"]: b for b in json.loads((pytester.path / "out.json").read_text())["benchmarks"]}
    assert list(benchmarks) == ["test_rounds"]
    stats = benchmarks["test_rounds"]["stats"]
    assert stats["rounds"] == 7 and stats["iterations"] == 1
    assert stats["min"] == pytest.approx(0.001) and stats["median"] == pytest.approx(0.004)
    assert stats["max"] == pytest.approx(0.007)
    assert benchmarks["test_rounds"]["options"]["timer"] == "torch.cuda.Event"  # the clock that read them


def test_host_timer_is_benchmark_timer(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_timer="""
import time
from perfgate import compat

def test_timer(request):
    assert compat.host_timer(request.config) is time.process_time
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-timer=time.process_time")
    result.assert_outcomes(passed=1)


def test_compare_held_and_given_back_in_a_session_without_perf_tests(pytester: pytest.Pytester) -> None:
    """compat.hold_compare / load_compare: pytest-benchmark's compare still works unchanged."""
    pytester.makepyfile(test_bench="def test_sum(benchmark):\n    benchmark(sum, range(10))\n")
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-save=one").ret == 0
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-compare=0001",
                                           "--benchmark-compare-fail=mean:1000%")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*test_sum (0001_one)*"])


# pytest-benchmark's own compare-warning cases (its tests/test_benchmark.py, 5.x: SIMPLE_TEST and
# the test_compare_* runs): a session without perf tests prints what pytest-benchmark alone does.
SIMPLE_TEST = '''
"""
    >>> print('Yay, doctests!')
    Yay, doctests!
"""
import time

def test_fast(benchmark):
    benchmark(time.sleep, 0.000001)
'''
COMPARE_CASES = {
    "no files": ["--benchmark-compare", "-rw"],
    "no files, verbose": ["--benchmark-compare", "--benchmark-verbose"],
    "no files match": ["--benchmark-compare=1", "-rw"],
    "non-existing": ["--benchmark-compare=0002", "-rw"],
    "existing": ["--benchmark-compare=0001", "--benchmark-compare-fail=min:1000%"],
    "last": ["--benchmark-compare", "--benchmark-compare-fail=min:1000%"],
}


def _printed(pytester: pytest.Pytester, args: list[str], perfgate: bool) -> tuple[list[str], list[str]]:
    """The lines about the compare or a warning, in order, on stderr and on stdout (the warnings
    summary), of one run (--benchmark-verbose's calibration lines vary run to run)."""
    plugins = [] if perfgate else ["-p", "no:perfgate"]
    result = pytester.runpytest_subprocess(*plugins, "-p", "no:cacheprovider", "--benchmark-max-time=0.0000001",
                                           "--doctest-modules", *args, "test_simple.py")
    assert result.ret == 0, result.outlines + result.errlines
    def about_compare(lines: list[str]) -> list[str]:
        return [line for line in lines if re.search(r"compar|warn", line, re.IGNORECASE)]

    return about_compare(result.errlines), about_compare(result.outlines)


@pytest.mark.parametrize("case", COMPARE_CASES)
def test_compare_prints_as_pytest_benchmark_alone(pytester: pytest.Pytester, case: str) -> None:
    """Where and what pytest-benchmark prints about --benchmark-compare (its "Can't compare" warning
    and "Comparing against" line on stderr, nothing in the warnings summary) is the same with
    perfgate installed as with it disabled, in a session without perf tests."""
    pytester.makepyfile(test_simple=SIMPLE_TEST)
    if case in ("non-existing", "existing", "last"):
        pytester.runpytest_subprocess("-p", "no:perfgate", "-p", "no:cacheprovider", "--benchmark-autosave",
                                      "--benchmark-max-time=0.0000001", "test_simple.py")
    alone = _printed(pytester, COMPARE_CASES[case], perfgate=False)
    with_perfgate = _printed(pytester, COMPARE_CASES[case], perfgate=True)
    assert with_perfgate == alone
    assert any("Can't compare" in line or "Comparing against" in line for line in alone[0])  # the case prints
