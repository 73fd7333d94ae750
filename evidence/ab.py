"""The evidence scripts' one A/B comparison: perfgate's interleaved ABBA pairs (perfgate.timing)
and its paired speedup interval (perfgate.stats), read as one line."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from perfgate.stats import speedup_interval
from perfgate.timing import Timer, interleaved


def versus(timer: Timer, slow: Callable[[], object], fast: Callable[[], object], rounds: int = 15,
           calls: tuple[int, int] = (3, 3)) -> str:
    """slow's time over fast's from ``rounds`` interleaved pairs: 'point (95% CI), slow / fast ms',
    the two medians over the pairs."""
    pairs = interleaved(timer, (slow, None), (fast, None), rounds, calls)
    a, b = zip(*pairs, strict=True)
    point, low, high = speedup_interval(a, b, paired=True)
    return (f"{point:.2f}x ({low:.2f}-{high:.2f}), {statistics.median(a) * 1e3:.2f} / "
            f"{statistics.median(b) * 1e3:.2f} ms")
