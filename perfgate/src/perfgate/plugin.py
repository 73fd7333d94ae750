"""perfgate pytest plugin (entry point ``pytest11``): speedup pairs on top of pytest-benchmark.

A perf test is parametrized over ``impl`` ("reference", "optimized", or ablation steps) and
times its callable through the ``perf`` fixture; all impls of one test land in one
pytest-benchmark group, so every ``--benchmark-*`` option works unchanged. At the session's end
perfgate prints speedup = median(reference) / median(impl) with a bootstrap interval, writes it
into the benchmark JSON (key ``perfgate``), and fails the session when a floor declared with
``@pytest.mark.speedup(cpu=..., cuda=...)`` or ``@pytest.mark.memory(...)`` is not met, or,
under ``--benchmark-compare``, when a speedup fell more than ``--perf-tolerance`` under the
stored baseline's. A declared floor whose row was not measured is named with the reason (and
fails the session under ``--perf-require-floors``). The hooks below only delegate to
``PerfSession`` (session.py), which stays inert in a session that collects no perf test.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from .options import add_options
from .session import SESSION, PerfSession

if TYPE_CHECKING:
    from .case import PerfCase


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hooks

    pluginmanager.add_hookspecs(hooks)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's (trylast) configure loads a baseline
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "speedup(cpu=None, cuda=None, impl='optimized', variant=None, over=None): speedup floor of impl "
        "over the reference (with over, over that impl: a peer) per device class; a float, or a dict keyed "
        "by perf size; with variant (an fnmatch pattern), only for a perf call whose variant= matches it",
    )
    config.addinivalue_line(
        "markers",
        "memory(cpu=None, cuda=None, impl='optimized', variant=None): least fraction of the reference's "
        "peak memory that impl saves, measured in the same run; a float, or a dict keyed by perf size; "
        "variant as speedup's",
    )
    config.stash[SESSION] = PerfSession(config)
    config.stash[SESSION].configure()


@pytest.hookimpl(trylast=True)  # after -k, -m and every other selection: shards split what is left
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[SESSION].select_shard(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Each test's seconds, setup to teardown: the weights a later --perf-shard splits by."""
    start = time.perf_counter()
    yield
    item.config.stash[SESSION].ran(item.nodeid, time.perf_counter() - start)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Tests -k, -m, --deselect or --perf-shard left out: a floor declared on one is reported."""
    if items:
        items[0].config.stash[SESSION].deselected(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Each phase's report: why a perf test measured nothing (skipped, failed, errored)."""
    outcome = yield
    item.config.stash[SESSION].reported(outcome.get_result())


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[SESSION].collected(session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Before the first test, outside pytest's warning capture: a session without perf tests
    gets pytest-benchmark's baseline back (``PerfSession.release_compare``)."""
    session.config.stash[SESSION].release_compare()


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION in config.stash:
        config.stash[SESSION].unconfigure()


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    config.stash[SESSION].machine_info(machine_info)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(
    config: pytest.Config, benchmarksession: Any, machine_info: dict, compared_benchmark: dict
) -> None:
    config.stash[SESSION].compare_machine_info(benchmarksession, compared_benchmark)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks: Any, output_json: dict) -> None:
    config.stash[SESSION].update_json(output_json)


@pytest.fixture
def perf(request: pytest.FixtureRequest, benchmark: Any) -> PerfCase:
    """Time one impl of a reference/optimized pair; see ``PerfCase.__call__``.

    Requests pytest-benchmark's ``benchmark`` fixture by name, so pytest-benchmark counts perf
    tests as benchmarks (``--benchmark-only``, ``--benchmark-skip`` select them).
    """
    from .case import PerfCase

    return PerfCase(request, benchmark, request.config.stash[SESSION].activate())


@pytest.fixture
def perf_device(request: pytest.FixtureRequest) -> str:
    """The device the perf session runs on (``--perf-device``)."""
    return request.config.stash[SESSION].activate().settings.device


@pytest.fixture
def perf_size(request: pytest.FixtureRequest) -> str:
    """``smoke`` or ``full`` (``--perf-size``)."""
    return request.config.stash[SESSION].activate().settings.size


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> Any:
    """Outermost: the rows are measured before pytest-benchmark writes its JSON, and the verdict
    set after every other hook."""
    session.config.stash[SESSION].finish(session)
    yield
    session.config.stash[SESSION].exit_status(session)


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's tables: the verdict is what a log's tail shows
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    config.stash[SESSION].summary(terminalreporter)
