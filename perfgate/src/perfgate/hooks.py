"""perfgate's hook for other plugins (registered by ``plugin.pytest_addhooks``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

# wrap(impl, run) -> the callable timed in place of ``run`` for that impl
Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]


@pytest.hookspec(firstresult=True)
def pytest_perfgate_wrap_timed(config: pytest.Config, device: str) -> Wrap | None:
    """A wrapper for this tree's timed callables, or None (the default: they are timed as they are).

    Called once as the session starts on ``device``. The wrapper is applied in the session and in
    ``--perf-against``'s workers for this tree (never REV's), so it must pickle (a module-level
    class or function). A run with one cannot be saved as a baseline. For test plugins such as
    ``perfgate.slowdown``; raise ``pytest.UsageError`` for a session it cannot serve."""


def wrapped(wrap: Wrap | None, impl: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as it is timed for ``impl``: what ``wrap`` makes of it, or ``fn`` itself. The
    wrapper gets the bare callable; a synchronize for a wall-clock call goes around what it returns."""
    return fn if wrap is None else wrap(impl, fn)
