"""Every reach into pytest-benchmark beyond its documented API, in one place.

Documented and used as such elsewhere: the ``benchmark`` fixture's ``pedantic``, ``group``,
``extra_info`` and ``disabled``; the ``--benchmark-*`` options; the hooks
``pytest_benchmark_update_machine_info``, ``pytest_benchmark_compare_machine_info`` and
``pytest_benchmark_update_json``. What follows has no documented form; ``tests/test_compat.py``
checks each of them, so a pytest-benchmark upgrade that breaks one fails there, loudly, not as
a wrong verdict.

1. ``benchmark.stats.stats.data`` / ``.median``: the rounds one ``pedantic`` call timed.
2. ``config._benchmarksession``: the session object pytest-benchmark builds in its own
   ``pytest_configure``; its ``storage`` (built by ``pytest_benchmark.utils.load_storage``),
   ``machine_id``, ``logger``, ``compare`` and ``handle_loading()``: perfgate decides whether it
   is used only after collection (a session with no perf test is left alone), after
   pytest-benchmark has opened its storage and loaded the baseline it compares against, so a
   perf session points the storage at its fingerprint's folder and loads the baseline again.
"""

from __future__ import annotations

from typing import Any

import pytest


def rounds(benchmark: Any) -> list[float] | None:
    """Seconds of each round the last ``pedantic`` call timed (None: benchmarks disabled)."""
    if benchmark.stats is None:
        return None
    return list(benchmark.stats.stats.data)


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
