"""Every pytest-benchmark internal that compat.py reaches, checked by name and shape: an upgrade
that moves one fails here, loudly, before a perf session misreads it."""

from __future__ import annotations

import inspect

import pytest
from pytest_benchmark import session as benchmark_session
from pytest_benchmark.utils import load_storage


def test_benchmark_session_has_what_compat_uses() -> None:
    init = inspect.getsource(benchmark_session.BenchmarkSession.__init__)
    for attribute in ("self.storage", "self.machine_id", "self.logger", "self.compare"):
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
from perfgate import compat

def test_rounds(benchmark):
    benchmark.pedantic(lambda: None, rounds=7, iterations=1)
    times = compat.rounds(benchmark)
    assert times is not None and len(times) == 7 and all(t >= 0 for t in times)

def test_session_attached(request):
    session = compat.benchmark_session(request.config)
    assert session is not None and hasattr(session, "storage") and hasattr(session, "handle_loading")
"""


def test_rounds_and_session_from_a_live_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_records=RECORDS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_rounds_is_none_with_benchmarks_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_records=RECORDS.replace("assert times is not None and len(times) == 7 and "
                                                     "all(t >= 0 for t in times)", "assert times is None"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-disable")
    result.assert_outcomes(passed=2)


def test_compare_held_and_given_back_in_a_session_without_perf_tests(pytester: pytest.Pytester) -> None:
    """compat.hold_compare / load_compare: pytest-benchmark's compare still works unchanged."""
    pytester.makepyfile(test_bench="def test_sum(benchmark):\n    benchmark(sum, range(10))\n")
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-save=one").ret == 0
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-compare=0001",
                                           "--benchmark-compare-fail=mean:1000%")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*test_sum (0001_one)*"])
