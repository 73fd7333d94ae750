"""Every reach into pytest-benchmark beyond its documented API, in one place.

Documented and used as such elsewhere: the ``benchmark`` fixture's ``group``, ``extra_info``
and ``disabled``; the ``--benchmark-*`` options; the hooks
``pytest_benchmark_update_machine_info``, ``pytest_benchmark_compare_machine_info`` and
``pytest_benchmark_update_json``. What follows has no documented form; ``tests/test_compat.py``
checks each of them, so a pytest-benchmark upgrade that breaks one fails there, loudly, not as
a wrong verdict.

1. ``benchmark._make_stats`` and ``_mode``: perfgate times a perf test's rounds on its own clock
   (CUDA events on a GPU: pytest-benchmark's timer reads only the host clock) and gives them to
   pytest-benchmark as the stats ``pedantic`` would have built, the fixture marked used as
   ``pedantic`` marks it, and ``has_error`` set when the timing raises, as ``pedantic`` sets it.
   ``pytest_benchmark.utils.load_timer``: the host clock ``--benchmark-timer`` names.
   The session's ``save`` and ``autosave``: an interrupted perf session takes them back.
2. ``config._benchmarksession``: the session object pytest-benchmark builds in its own
   ``pytest_configure``; its ``storage`` (built by ``pytest_benchmark.utils.load_storage``),
   ``machine_id``, ``logger``, ``compare`` and ``handle_loading()``: perfgate decides whether it
   is used only after collection (a session with no perf test is left alone), after
   pytest-benchmark has opened its storage and loaded the baseline it compares against, so a
   perf session points the storage at its fingerprint's folder and loads the baseline again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def record_rounds(benchmark: Any, time_rounds: Callable[[], tuple[list[float], Any]],
                  timer: str) -> tuple[list[float], Any]:
    """Run ``time_rounds`` (seconds of each round, and a result) and record its rounds as
    pytest-benchmark's stats of the ``benchmark`` fixture, one round each, as
    ``pedantic(iterations=1)`` records its own, with ``timer`` (the clock's name) as the JSON's
    timer; the fixture can then not be used again. Returns what ``time_rounds`` returned."""
    from pytest_benchmark.fixture import FixtureAlreadyUsed

    if benchmark._mode:
        benchmark.has_error = True
        raise FixtureAlreadyUsed(f"Fixture can only be used once. Previously it was used in {benchmark._mode} "
                                 "mode.")
    benchmark._mode = "perfgate rounds"
    try:
        times, result = time_rounds()
    except BaseException:
        benchmark.has_error = True
        raise
    stats = benchmark._make_stats(1)
    stats.options["timer"] = timer
    for seconds in times:
        stats.update(seconds)
    return times, result


def withhold_save(config: pytest.Config) -> None:
    """pytest-benchmark saves nothing to its storage this session (``--benchmark-save`` and
    ``--benchmark-autosave`` taken back before its ``pytest_sessionfinish`` saves);
    ``--benchmark-json`` is still written."""
    session = benchmark_session(config)
    if session is not None:
        session.save = session.autosave = None


def host_timer(config: pytest.Config) -> Callable[[], float]:
    """The clock ``--benchmark-timer`` names (default ``time.perf_counter``), loaded as
    pytest-benchmark loads it (``pytest_benchmark.utils.load_timer``)."""
    from pytest_benchmark.utils import load_timer

    return load_timer(config.getoption("benchmark_timer")).target


def benchmark_session(config: pytest.Config) -> Any:
    return getattr(config, "_benchmarksession", None)


def hold_compare(config: pytest.Config) -> Any:
    """Before pytest-benchmark configures: take ``--benchmark-compare`` back so it loads no
    baseline from the default storage yet (perfgate may move the storage after collection).
    Returns the option's value for ``load_compare``."""
    value = config.option.benchmark_compare
    config.option.benchmark_compare = False
    return value


def load_compare(config: pytest.Config, compare: Any, storage: str | None) -> None:
    """Give pytest-benchmark back ``--benchmark-compare`` when ``hold_compare`` took it (``compare``
    not None), with its storage moved to ``storage`` when given, and load the baseline as its
    configure would have. Options the user did not give are left as they are."""
    from pytest_benchmark.utils import load_storage

    session = benchmark_session(config)
    if compare is not None:
        config.option.benchmark_compare = compare
    if session is None:
        return
    if storage is not None:
        session.storage = load_storage(storage, logger=session.logger, default_machine_id=session.machine_id,
                                       netrc=config.getoption("benchmark_netrc"))
    if compare is not None:
        session.compare = compare
        session.handle_loading()


def storage_url(config: pytest.Config) -> str | None:
    """pytest-benchmark's ``--benchmark-storage`` as a file path, or None for another backend."""
    storage = config.getoption("benchmark_storage")
    if not isinstance(storage, str) or not (storage.startswith("file://") or "://" not in storage):
        return None
    path = storage.removeprefix("file://")
    return str(config.rootpath / ".benchmarks") if path == "./.benchmarks" else path
