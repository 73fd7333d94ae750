"""Under pytest-xdist a perf session is refused with a usage error: parallel workers share the
cores and skew each other's timings (and pytest-benchmark turns itself off there, so the gate would
silently not run). A session that asks nothing of perfgate keeps working under xdist, and so do
perf tests with benchmarks off, run once untimed.

perfgate does not depend on pytest-xdist (kernelgate's test extras install it, for ``make
correctness``), so these tests simulate what perfgate reads of it: on the controller its
``-n``/``--numprocesses`` and ``--dist`` options (registered here as xdist registers them), on a
worker the ``workerinput`` attribute xdist sets on the worker's config before configuring it
(where it also resets ``-n`` and ``--dist``). ``-p no:xdist`` keeps a real xdist, where
installed, out of the simulation; the last test runs the real one where it is installed and is
skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.paced  # perf sessions whose timed calls sleep: one a core (make correctness)

FAST = ["--benchmark-max-time=0.1", "--benchmark-min-rounds=8", "-p", "no:cacheprovider", "-p", "no:xdist"]

SUITE = """
import time
import pytest

@pytest.mark.speedup(cpu=1.5)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_sleepy(perf, impl):
    perf(lambda: time.sleep(0.004 if impl == "reference" else 0.002))

def test_plain():
    pass
"""
OPTIONS = """
def pytest_addoption(parser):  # pytest-xdist's options, as it registers them
    group = parser.getgroup("xdist")
    group._addoption("-n", "--numprocesses", dest="numprocesses", type=int, default=None)
    group.addoption("--dist", dest="dist", default="no")
"""
WORKER = OPTIONS + """

def pytest_cmdline_main(config):  # what pytest-xdist gives a worker's config before it configures
    config.workerinput = {"workerid": "gw0", "workercount": 2, "testrunuid": "x"}
"""
REFUSED = "*perfgate: timing needs one process, and this is a pytest-xdist {role}: parallel workers share the " \
    "machine's cores and skew each other's timings*drop -n/--dist (or add -p no:xdist)*"


# --dist makes pytest-benchmark, in this process, warn that it turned itself off
BENCHMARK_OFF = "ignore:Benchmarks are automatically disabled:pytest_benchmark.logger.PytestBenchmarkWarning"


@pytest.mark.filterwarnings(BENCHMARK_OFF)
def test_a_perf_session_under_an_xdist_controller_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(OPTIONS)
    pytester.makepyfile(test_pair=SUITE)
    for args in (["-n", "2", "--perf-device", "cpu"],  # asked by an option: refused at configure
                 ["-n", "2"],  # perf tests collected (in this simulation the controller collects)
                 ["--dist", "load"],
                 ["-n", "2", "--benchmark-disable", "--perf-require-floors"]):  # no worker sees every floor
        result = pytester.runpytest(*FAST, *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (args, result.stdout.str())
        result.stderr.fnmatch_lines([REFUSED.format(role="controller")])
    result = pytester.runpytest(*FAST, "-n", "2", "--benchmark-disable")  # untimed perf tests: allowed
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=3)
    # -n 0: no workers, timed here (judged however busy the host, as a pass or a failure)
    result = pytester.runpytest(*FAST, "-n", "0", "--perf-device", "cpu", "--perf-contended=inf")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*gate passed*"])
    result = pytester.runpytest(*FAST, "-n", "2", "-k", "plain")  # no perf test, no --perf-* option: inert
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1, deselected=2)


def test_perf_tests_on_an_xdist_worker_are_refused_test_by_test(pytester: pytest.Pytester) -> None:
    """A worker refuses in the perf fixture, so xdist reports each perf test's error to the
    controller (a worker stopped at collection is a crash xdist restarts it from); plain tests run."""
    pytester.makeconftest(WORKER)
    pytester.makepyfile(test_pair=SUITE)
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(["*UsageError: " + REFUSED.format(role="worker").lstrip("*")])
    result = pytester.runpytest(*FAST, "--perf-device", "cpu")  # an option asks for the gate: at configure
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([REFUSED.format(role="worker")])
    result = pytester.runpytest(*FAST, "--benchmark-disable")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=3)


def test_a_real_xdist_run_is_refused(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: the tests above simulate it")
    pytester.makepyfile(test_pair=SUITE)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--perf-device", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([REFUSED.format(role="controller")])
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")  # refused by each worker
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=2)
    assert "timing needs one process" in result.stdout.str()
