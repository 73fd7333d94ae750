"""TEST ONLY: ``pytest -p perfgate.slowdown --perf-slowdown F`` makes every "optimized" impl F times
slower, to measure what the gate catches (``python -m perfgate.fidelity`` and perfgate's own tests
load it). The harness spins after each call, so no kernel carries a switch that could slow it in
production, and perfgate itself knows nothing of it (``hooks.pytest_perfgate_wrap_timed``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from .floors import OPTIMIZED


@dataclass(frozen=True)
class Slowed:
    """wrap(impl, run): ``run`` spun after for (factor - 1) x its own duration where ``impl`` is
    "optimized", unchanged otherwise (picklable: --perf-against's workers receive it)."""

    factor: float

    def __call__(self, impl: str, run: Callable[..., Any]) -> Callable[..., Any]:
        if impl != OPTIMIZED:
            return run
        factor = self.factor

        def slowed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            deadline = time.perf_counter() + (factor - 1.0) * (time.perf_counter() - t0)
            while time.perf_counter() < deadline:  # spin: sleep overshoots by ~0.1 ms
                pass
            return out

        return slowed


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("perfgate").addoption(
        "--perf-slowdown", dest="perf_slowdown", type=float, default=1.0,
        help="TEST ONLY: make every 'optimized' impl this many times slower in the harness (default 1.0)")


def pytest_perfgate_wrap_timed(config: pytest.Config, device: str) -> Slowed | None:
    factor = config.getoption("perf_slowdown")
    if factor < 1.0:
        raise pytest.UsageError(f"--perf-slowdown must be >= 1, got {factor}")
    if factor != 1.0 and device.startswith("cuda"):
        raise pytest.UsageError("--perf-slowdown spins the host after each call, which slows a CPU kernel by the "
                                "factor but not a CUDA kernel timed by events: measure the gate's fidelity with "
                                "--perf-device cpu")
    return Slowed(factor) if factor != 1.0 else None
