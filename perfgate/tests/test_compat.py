"""Every pytest-benchmark internal that compat.py reaches, checked by name and shape: an upgrade
that moves one fails here, loudly, before a perf session misreads it."""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path

import pytest
from pytest_benchmark import session as benchmark_session
from pytest_benchmark.utils import load_storage

pytestmark = pytest.mark.paced  # perf sessions whose timed calls sleep: one a core (make correctness)


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



def test_rounds_are_refused_once_the_fixture_was_used() -> None:
    """compat.record_rounds on a fixture pedantic (or a first record_rounds) used: refused as
    pytest-benchmark refuses a second use, the test marked as errored, nothing timed."""
    from pytest_benchmark.fixture import FixtureAlreadyUsed

    from perfgate import compat

    used = types.SimpleNamespace(_mode="benchmark.pedantic(...)", has_error=False)
    with pytest.raises(FixtureAlreadyUsed, match=r"benchmark\.pedantic"):
        compat.record_rounds(used, lambda: pytest.fail("timed on a used fixture"), timer="t")
    assert used.has_error


def test_a_perf_sessions_storage_and_compare_are_given_back_moved(tmp_path: Path) -> None:
    """compat.load_compare: pytest-benchmark's storage moved to the fingerprint's folder, its
    --benchmark-compare given back and loaded from there; withhold_save takes back both saves."""
    from perfgate import compat

    loaded = []
    session = types.SimpleNamespace(storage=None, logger=None, machine_id="m", compare=False, save="base",
                                    autosave=True, handle_loading=lambda: loaded.append(str(session.storage)))
    option = types.SimpleNamespace(benchmark_compare="0001")
    config = types.SimpleNamespace(_benchmarksession=session, option=option, getoption={"benchmark_netrc": ""}.get)
    held = compat.hold_compare(config)
    assert held == "0001" and option.benchmark_compare is False
    compat.load_compare(config, held, storage=f"file://{tmp_path}")
    assert option.benchmark_compare == "0001" and session.compare == "0001" and loaded == [str(tmp_path)]
    compat.withhold_save(config)
    assert session.save is None and session.autosave is None


@pytest.mark.parametrize(("storage", "path"), [
    ("file://./.benchmarks", "{root}/.benchmarks"),  # pytest-benchmark's default: the rootdir's
    ("file:///data/runs", "/data/runs"), ("/data/runs", "/data/runs"), ("s3://bucket/runs", None)])
def test_the_storage_path_is_a_file_storages_own(storage: str, path: str | None) -> None:
    from perfgate import compat

    config = types.SimpleNamespace(getoption={"benchmark_storage": storage}.get, rootpath=Path("/project"))
    assert compat.storage_url(config) == (path and path.format(root="/project"))
