"""The evidence scripts' timing: one A/B comparison (perfgate's interleaved ABBA pairs,
perfgate.timing, and its paired speedup interval, perfgate.stats; as numbers, or read as one line), and the
medians of several calls timed in interleaved rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from perfgate.stats import speedup_interval
from perfgate.timing import Timer, interleaved, timer_for


def compare(timer: Timer, slow: Callable[[], object], fast: Callable[[], object], rounds: int = 15,
            calls: tuple[int, int] = (3, 3)) -> tuple[float, float, float, float, float]:
    """slow's time over fast's from ``rounds`` interleaved pairs: (point, 95% CI low, high, slow's
    median ms, fast's median ms), the medians over the pairs."""
    pairs = interleaved(timer, (slow, None), (fast, None), rounds, calls)
    a, b = zip(*pairs, strict=True)
    point, low, high = speedup_interval(a, b, paired=True)
    return point, low, high, statistics.median(a) * 1e3, statistics.median(b) * 1e3


def versus(timer: Timer, slow: Callable[[], object], fast: Callable[[], object], rounds: int = 15,
           calls: tuple[int, int] = (3, 3)) -> str:
    """``compare`` read as one line: 'point (95% CI), slow / fast ms'."""
    point, low, high, slow_ms, fast_ms = compare(timer, slow, fast, rounds, calls)
    return f"{point:.2f}x ({low:.2f}-{high:.2f}), {slow_ms:.2f} / {fast_ms:.2f} ms"


def round_times(fns: dict[str, Callable[[], object]], rounds: int, calls: int, device: str = "cpu",
                warm: int = 0) -> dict[str, list[list[float]]]:
    """Seconds of each fn's calls, a list a round: ``rounds`` rounds of ``calls`` calls (after
    ``warm`` untimed ones), the fns in turn within a round, by perfgate's timer for ``device`` (the
    previous call's result alive while the next is made, as in a perf session's block)."""
    timer = timer_for(device)
    times: dict[str, list[list[float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer.block((fn, None), calls, warm=warm))
    return times


def medians(fns: dict[str, Callable[[], object]], rounds: int, calls: int,
            device: str = "cpu") -> dict[str, float]:
    """Median ms of each fn over all its calls in ``round_times``' rounds."""
    times = round_times(fns, rounds, calls, device)
    return {k: statistics.median(t for block in v for t in block) * 1e3 for k, v in times.items()}
