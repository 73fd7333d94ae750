"""TEST ONLY: ``pytest -p perfgate.slowdown --perf-slowdown F`` makes every "optimized" impl F times
slower, to measure what the gate catches (``python -m perfgate.fidelity`` and perfgate's own tests
load it). The harness stretches each call after it returns, so no kernel carries a switch that
could slow it in production, and perfgate itself knows nothing of it
(``hooks.pytest_perfgate_wrap_timed``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from .floors import OPTIMIZED


@dataclass(frozen=True)
class Slowed:
    """wrap(impl, run): ``run`` stretched by (factor - 1) x its own duration where ``impl`` is
    "optimized", unchanged otherwise (picklable: --perf-against's workers receive it). On a CPU the
    host spins; on CUDA the host spins for the call's host time and the GPU sleeps for its GPU time,
    so a launch-bound call and a GPU-bound one are both stretched by the factor."""

    factor: float
    device: str = "cpu"

    def __call__(self, impl: str, run: Callable[..., Any]) -> Callable[..., Any]:
        if impl != OPTIMIZED:
            return run
        return _on_cuda(run, self.factor) if self.device.startswith("cuda") else _on_host(run, self.factor)


def _spin(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:  # spin: sleep overshoots by ~0.1 ms
        pass


def _on_host(run: Callable[..., Any], factor: float) -> Callable[..., Any]:
    def slowed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = run(*args, **kwargs)
        _spin((factor - 1.0) * (time.perf_counter() - t0))
        return out

    return slowed


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on the current GPU, read once a process after
    ~50 ms of sleep has raised the clock to where a timed loop keeps it."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(100_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _on_cuda(run: Callable[..., Any], factor: float, first: int = 3) -> Callable[..., Any]:
    """After each call: a GPU sleep of (factor - 1) x the call's GPU span, and a host spin of
    (factor - 1) x its host time, so per call max(host, GPU) grows by the factor. The span is the
    shortest of the first ``first`` calls, each synchronized (warm-ups: a cold first call is long);
    read later without a synchronize it would lag behind a GPU-bound loop and feed on its own sleep."""
    import torch

    per_ms = _sleep_cycles_per_ms()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spans: list[float] = []

    def slowed(*args: Any, **kwargs: Any) -> Any:
        measuring = len(spans) < first
        t0 = time.perf_counter()
        if measuring:
            start.record()
        out = run(*args, **kwargs)
        if measuring:
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end))
        host = time.perf_counter() - t0
        torch.cuda._sleep(int((factor - 1.0) * min(spans) * per_ms))
        _spin((factor - 1.0) * host)
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
    return Slowed(factor, device) if factor != 1.0 else None
