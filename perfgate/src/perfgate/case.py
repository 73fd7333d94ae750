"""``PerfCase``: what the ``perf`` fixture hands a test, and the timing call itself."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from . import compat
from .floors import OPTIMIZED, checked_value, comparison, kernel_name, parametrized_impls
from .hooks import wrapped
from .roofline import Work, count_work
from .state import MIN_PAIRS, REFERENCE, GateState, Measurement, Visits, baseline_key
from .timing import PairLoad, Timed, block_calls, interleaved, peak_memory, synced, torch_or_none

MIN_ROUNDS = 5  # a bootstrap interval needs rounds to resample, whatever the options say
# --perf-gated-only: an impl's own rounds feed no rule, so a slow call gets fewer (what fits in
# GATED_ROUNDS_S by its first call, at least 2 for a spread)
GATED_ROUNDS_S = 1.0
MAX_ROUNDS = 1000
MIN_VISIT_ROUNDS = 3  # interleaved pairs a visit times, at least
# A slow row's first visit: its 7 pairs (MIN_PAIRS) are timed as 4 now and 3 at the session's end
# (GateState.revisit), so even a row of 7 pairs samples two host states apart in time
FIRST_PAIRS = 4


def _floor(item: pytest.Item, mark_name: str, impl: str, device: str, size: str,
           variant: str | None, over: str | None = None) -> tuple[float | None, str]:
    """The ``speedup`` or ``memory`` floor ``item`` declares for ``impl`` on this device class and
    size (over the reference, or with ``over``, over that impl), and, when a declared floor does
    not apply, why. A marker with ``variant=`` (an fnmatch pattern) applies only to a call made
    with a matching ``variant``: a floor that holds only where a recipe (bf16 on a CPU with bf16
    instructions, say) was chosen. Two markers that both apply to one impl are an error: which one
    would win should not depend on decorator order."""
    device_class = "cuda" if device.startswith("cuda") else "cpu"
    note, found = "", []
    for mark in item.iter_markers(mark_name):
        value = checked_value(item, mark, mark_name, device, size)
        if mark.kwargs.get("impl", "optimized") != impl or mark.kwargs.get("over") != over or value is None:
            continue
        pattern = mark.kwargs.get("variant")
        if pattern is not None and not fnmatch.fnmatchcase(variant or "", pattern):
            note = note or f"set for {pattern}, ran {variant or 'no variant'}"
            continue
        found.append(value)
    if len(found) > 1:
        raise pytest.UsageError(f"{item.nodeid}: {len(found)} {mark_name} markers apply to impl {impl!r} on "
                                f"{device_class} at size {size}; key them apart with impl= or variant=")
    return (found[0], "") if found else (None, note)


def _comparisons(item: pytest.Item, impl: str) -> list[tuple[str, str]]:
    """(impl, over) pairs of the ``speedup(over=...)`` markers that name ``impl`` on either side.
    Both names must be values of the test's ``impl`` parameter: a misspelt one would never be
    timed, and its floor would pass unseen."""
    impls, pairs = parametrized_impls(item), []
    for mark in item.iter_markers("speedup"):
        over = mark.kwargs.get("over")
        if over is None:
            continue
        side = mark.kwargs.get("impl", "optimized")
        for name in (side, over):
            if name not in impls:
                raise pytest.UsageError(f"{item.nodeid}: speedup(impl={side!r}, over={over!r}) names {name!r}, "
                                        f"which is not one of the test's impls {impls}")
        if impl in (side, over) and (side, over) not in pairs:
            pairs.append((side, over))
    return pairs


UNKNOWN = "<not run yet>"  # the variant of an impl that has not run yet (_judged)


def _judged(item: pytest.Item, state: GateState, impl: str, over: str | None, variant: str | None,
            kinds: tuple[str, ...] = ("speedup", "memory")) -> bool:
    """Whether a rule judges ``impl``'s row here (over ``over``, else over the reference): a floor
    of ``kinds`` for this device class and size (a speedup floor only while CPU floors apply; one
    keyed to a variant pattern when ``variant`` matches it, or whatever it is when ``variant`` is
    ``UNKNOWN``: the impl has not run yet), or, for a row of ours over the reference, a stored
    baseline (a peer's row is reported beside it, not gated)."""
    for kind in kinds:
        if not state.floors.policy.applies(kind):
            continue
        # _floor's note is set only when a floor keyed to another variant exists
        known = None if variant is UNKNOWN else variant
        floor, note = _floor(item, kind, impl, state.settings.device, state.settings.size, known, over)
        if floor is not None or (variant is UNKNOWN and note):
            return True
    peer = any(o == impl for _, o in _comparisons(item, impl))
    key = baseline_key(kernel_name(item)[0], impl, state.settings.size)
    stored = state.stored.speedups is not None and key in state.stored.speedups
    return over is None and "speedup" in kinds and stored and not peer


def claimed(item: pytest.Item, impl: str) -> bool:
    """Whether ``impl`` is code of ours the suite makes a claim about, what ``--perf-against``
    compares: "optimized", or an impl a speedup or memory marker names with ``impl=``; never the
    reference nor a peer (another library's code, the same on both sides)."""
    if impl == REFERENCE or any(over == impl for _, over in _comparisons(item, impl)):
        return False
    return impl == OPTIMIZED or any(m.kwargs.get("impl") == impl for kind in ("speedup", "memory")
                                    for m in item.iter_markers(kind))


def _ruled(item: pytest.Item, state: GateState, impl: str) -> bool:
    """Whether a floor or baseline may judge ``impl``'s row or a comparison row it is a side of,
    decided before it runs (so a variant-keyed floor counts)."""
    return _judged(item, state, impl, None, UNKNOWN) or any(
        _judged(item, state, side, over, UNKNOWN, ("speedup",)) for side, over in _comparisons(item, impl))


def _needed(item: pytest.Item, state: GateState, impl: str) -> bool:
    """Whether ``impl`` must be timed under ``--perf-gated-only``: a rule may judge it
    (``_ruled``), or ``--perf-against`` compares it (``claimed``); the reference, when a rule
    may judge another impl of its test (the comparison with REV does not time it)."""
    if impl == REFERENCE:
        return any(_ruled(item, state, other) for other in parametrized_impls(item) if other != REFERENCE)
    return _ruled(item, state, impl) or (state.settings.compared and claimed(item, impl))


def _check_call(fn: Any, setup: Any, rounds: Any, warmup_rounds: Any, work_bytes: Any) -> None:
    """``perf(...)``'s arguments, refused before anything is timed: ``work_bytes`` scales the row's
    speedup and interval (a NaN would pass any floor), and the counts size the timing."""
    for name, value in (("fn", fn), ("setup", setup)):
        if (value is not None or name == "fn") and not callable(value):
            raise TypeError(f"perf({name}=...) must be callable, got {type(value).__name__}")
    for name, value, least in (("rounds", rounds, 1), ("warmup_rounds", warmup_rounds, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or value < least):
            raise ValueError(f"perf({name}=...) must be an int >= {least}, got {value!r}")
    if work_bytes is not None and (isinstance(work_bytes, bool) or not isinstance(work_bytes, numbers.Real)
                                   or not math.isfinite(work_bytes) or work_bytes <= 0):
        raise ValueError(f"perf(work_bytes=...) must be a finite number of bytes > 0 (one call's least "
                         f"traffic), got {work_bytes!r}; leave it out to use the counted bytes")


class PerfCase:
    """What the ``perf`` fixture gives a test: its device, size, impl and the timing call,
    ``perf(fn, setup=, label=, rounds=, warmup_rounds=, work_bytes=, variant=)``.

    ``warmup_rounds``: untimed calls before the rounds, the first call and the sizing call
    among them (both always made, except the sizing call under ``--perf-gated-only``, whose
    rounds are not sized). Rounds default to what fits in ``--benchmark-max-time`` (at least
    ``--benchmark-min-rounds``, never under 5, at most 1000; under ``--perf-gated-only`` 5, or
    for a call over 0.2 s what fits in ``GATED_ROUNDS_S``, at least 2).
    The first call is reported apart as ``first_call_ms`` (compile and warm-up live there),
    never in the timed rounds.
    ``work_bytes``: bytes one call moves; declared on both impls, the row's speedup becomes a
    throughput ratio and GB/s are reported. ``variant``: what this impl chose at run time that
    its speedup depends on (e.g. ``Recipe.auto``'s recipe name); a ``speedup`` marker with
    ``variant=`` applies only when it matches.
    """

    def __init__(self, request: pytest.FixtureRequest, benchmark: Any, state: GateState) -> None:
        names = kernel_name(request.node)
        if names is None:
            pytest.fail(f"{request.node.nodeid}: a perf test must be parametrized over 'impl' "
                        "(e.g. @pytest.mark.parametrize('impl', ['reference', 'optimized']))")
        self.kernel, self.impl = names
        self.device: str = state.settings.device
        self.size: str = state.settings.size
        self._request, self._benchmark, self._state = request, benchmark, state

    def __call__(self, fn: Callable[..., Any], *, setup: Callable[[], Any] | None = None, label: str = "",
                 rounds: int | None = None, warmup_rounds: int = 2, work_bytes: float | None = None,
                 variant: str | None = None) -> Any:
        """Time ``fn()``, or ``fn(setup())`` with a fresh setup each round, untimed (the class's note)."""
        _check_call(fn, setup, rounds, warmup_rounds, work_bytes)
        state, bench, node = self._state, self._benchmark, self._request.node
        self._skip_unjudged()
        state.probes.pin_threads()  # a peer's BLAS pool loads at its first use: at the session's threads too
        timed, call = self._callables(fn, setup)
        if bench.disabled:  # --benchmark-disable or xdist: pytest-benchmark runs it once
            state.tally.unmeasured += 1
            return bench.pedantic(call, rounds=1, iterations=1)
        first, rounds = self._size_rounds(call, rounds)
        bench.group = self.kernel
        bench.extra_info.update(kernel=self.kernel, impl=self.impl, size=self.size, label=label,
                                device=self.device, first_call_ms=1e3 * first)
        times, result = self._time_rounds((timed, setup), rounds, warmup_rounds)
        paired, later, load = self._pair_with_reference(variant, rounds)
        peak = self._peak(fn, setup)
        work, work_note = self._work(fn, setup)
        bench.extra_info.update(peak_memory_bytes=peak, work_bytes=work_bytes,
                                counted_bytes=None if work is None else work.bytes,
                                counted_written=None if work is None else work.written,
                                counted_flops=None if work is None else work.flops)
        if self.impl in state.results.get(self.kernel, {}):
            pytest.fail(f"two perf tests measure {self.kernel} [{self.impl}]: perf kernel names come "
                        "from the test name and its non-impl parameters; rename one")
        self._record(self.impl, later, Measurement(
            times=times, size=self.size, label=label, peak_bytes=peak,
            work_bytes=work_bytes, paired=paired, visits=1 + len(later.shares) if later else 1, variant=variant,
            load=load, calls=later.calls[1] if later else 1, reference_calls=later.calls[0] if later else 1,
            work=work, work_note=work_note,
            peer=any(over == self.impl for _, over in _comparisons(node, self.impl))))
        self._set_floors(self.impl, variant)
        if self.impl == REFERENCE:
            self._pair_earlier_impls(rounds)
        self._compare_with_peers(rounds)
        return result

    def _pair_earlier_impls(self, rounds: int) -> None:
        """The impls of this kernel timed before their reference (``--ff``, a parametrize list that
        does not start with it): their interleaved pairs, timed now that it has run. Their rows
        were judged on unpaired rounds otherwise (a few under --perf-gated-only), with no second
        look at a failure."""
        state, node = self._state, self._request.node
        for impl, m in list(state.results.get(self.kernel, {}).items()):
            if impl == REFERENCE or m.paired or m.against != REFERENCE or (self.kernel, impl) not in state.runners:
                continue
            if state.settings.gated_only and not _judged(node, state, impl, None, m.variant, ("speedup",)):
                continue
            paired, later, load = self._pair(REFERENCE, impl, rounds)
            timed = dataclasses.replace(m, paired=paired, visits=1 + len(later.shares), load=load,
                                        calls=later.calls[1], reference_calls=later.calls[0])
            self._record(impl, later, timed)

    def _skip_unjudged(self) -> None:
        """Under --perf-gated-only, skip an impl no floor or stored baseline judges."""
        state, node = self._state, self._request.node
        if state.settings.gated_only and not _needed(node, state, self.impl):
            state.tally.not_timed.append(f"{self.kernel} [{self.impl}]")
            pytest.skip(f"{self.kernel} [{self.impl}]: no floor or stored baseline judges it here "
                        "(--perf-gated-only; a session without it times it)")

    def _pair_with_reference(self, variant: str | None, rounds: int) -> tuple:
        """Interleaved pairs against the reference for a speedup a rule judges (under
        --perf-gated-only; else for every row): ``_pair``'s (paired, later, load), or no pairs."""
        state, node = self._state, self._request.node
        judged = not state.settings.gated_only or _judged(node, state, self.impl, None, variant, ("speedup",))
        if self.impl != REFERENCE and (self.kernel, REFERENCE) in state.runners and judged:
            return self._pair(REFERENCE, self.impl, rounds)
        return None, None, []

    def _callables(self, fn: Callable[..., Any], setup: Callable[[], Any] | None) -> tuple[Callable, Callable]:
        """What the timer calls (``fn``, or what a plugin's ``pytest_perfgate_wrap_timed`` made of
        it), and one call of it ending with a synchronize, with a fresh ``setup`` (the first call and
        the sizing call: wall-clock; wrapped too, so the rounds are sized as timed)."""
        timed = wrapped(self._state.settings.wrap, self.impl, fn)
        run = synced(timed, self.device)
        setup_synced = None if setup is None else synced(setup, self.device)
        return timed, (run if setup_synced is None else lambda: run(setup_synced()))

    def _time_rounds(self, timed: Timed, rounds: int, warmup_rounds: int) -> tuple[list[float], Any]:
        """``rounds`` of ``timed`` as one block on the session's clock (CUDA events on a GPU),
        given to pytest-benchmark as its rounds: their seconds and the last call's result. The
        callable is kept for the impls of this kernel that follow it: the reference for all of
        them, a peer for the impls a speedup(over=) marker compares with it."""
        state = self._state
        times, result = compat.record_rounds(
            self._benchmark, lambda: state.probes.timer.rounds(timed, rounds, warm=max(0, warmup_rounds - 2)),
            timer=state.probes.timer.clock.name)
        state.runners[(self.kernel, self.impl)] = (timed, float(np.median(times)))
        return times, result

    def _size_rounds(self, call: Callable[[], Any], rounds: int | None) -> tuple[float, int]:
        """The first call's seconds, and the rounds to time (``__call__``'s docstring)."""
        config, state = self._request.config, self._state
        t0 = time.perf_counter()
        call()
        first = time.perf_counter() - t0
        if rounds is None and state.settings.gated_only:
            # rows are judged on their interleaved pairs: the impl's own rounds feed only its
            # pytest-benchmark stats and the pairs' block size, so they are not sized to max-time
            return first, max(2, min(MIN_ROUNDS, math.ceil(GATED_ROUNDS_S / max(first, 1e-6))))
        if rounds is None:
            t1 = time.perf_counter()
            call()  # a warm call sizes the rounds: the first may compile or build caches
            warm = state.probes.timer.cost(time.perf_counter() - t1)
            max_time = float(config.getoption("benchmark_max_time"))
            min_rounds = int(config.getoption("benchmark_min_rounds"))
            rounds = min(MAX_ROUNDS, max(min_rounds, math.ceil(max_time / max(warm, 1e-6))))
        return first, max(rounds, MIN_ROUNDS)

    def _peak(self, fn: Callable[..., Any], setup: Callable[[], Any] | None) -> int | None:
        """The impl's peak memory: on a row a memory floor gates the median of 3 readings (CPU
        peaks move by a few stray pages); under --perf-gated-only none on a row no memory rule
        reads; else one."""
        memory_marked = any(self._request.node.iter_markers("memory"))
        repeats = 3 if memory_marked else 0 if self._state.settings.gated_only else 1
        peaks = []
        for _ in range(repeats):
            # a fresh setup() before each reading, outside it: a call that consumes or changes its
            # setup (an in-place step) is measured as itself every time
            args = () if setup is None else (setup(),)
            peaks.append(peak_memory(lambda args=args: fn(*args), self.device))
        return None if not peaks or None in peaks else sorted(peaks)[len(peaks) // 2]

    def _work(self, fn: Callable[..., Any], setup: Callable[[], Any] | None) -> tuple[Work | None, str]:
        """One call's least bytes and FLOPs (``roofline.count_work``), for every impl but the
        reference; with the reason where they could not be counted (an op the dispatch mode
        cannot see through, say), reported in the roofline section."""
        if self.impl == REFERENCE or torch_or_none() is None:  # no torch: no tensors to count
            return None, ""
        try:
            return count_work(fn, setup), ""
        except Exception as exc:  # noqa: BLE001 - the figure is reported missing with its reason
            return None, f"{type(exc).__name__}: {exc}"[:200]

    def _record(self, name: str, later: Visits | None, measurement: Measurement) -> None:
        """``measurement`` as row ``name``'s, with its later visits and the timer kept to extend
        or confirm the row."""
        state = self._state
        state.results.setdefault(self.kernel, {})[name] = measurement
        if later is not None:
            state.later.timers[(self.kernel, name)] = later
            if later.shares:
                state.later.pending.append(later)

    def _compare_with_peers(self, rounds: int) -> None:
        """The speedup(over=) rows this impl completes: each side timed against the peer it names
        once both are measured (under --perf-gated-only, where a rule judges the row)."""
        state, node = self._state, self._request.node
        for side, over in _comparisons(node, self.impl):
            if (self.kernel, side) not in state.runners or (self.kernel, over) not in state.runners:
                continue
            side_variant = state.results[self.kernel][side].variant
            if not state.settings.gated_only or _judged(node, state, side, over, side_variant, ("speedup",)):
                self._compare(side, over, rounds)

    def _pair(self, base: str, side: str, rounds: int) -> tuple[list[tuple[float, float]], Visits, list[PairLoad]]:
        """Interleaved (base, side) pairs timed now, the later visits' share of them, and the CPU
        time the host withheld while these pairs ran (``Measurement.load``)."""
        state, config = self._state, self._request.config
        (base_timed, base_median), (side_timed, side_median) = (state.runners[(self.kernel, i)]
                                                                for i in (base, side))
        cost = state.probes.timer.cost  # the reading, with the flush
        base_s, side_s = cost(base_median), cost(side_median)
        (base_calls, base_warm), (side_calls, side_warm) = block_calls(base_s), block_calls(side_s)
        calls, warm = (base_calls, side_calls), (base_warm, side_warm)
        block_s = (calls[0] + warm[0]) * base_s + (calls[1] + warm[1]) * side_s
        max_time = float(config.getoption("benchmark_max_time"))
        n = max(MIN_PAIRS, min(rounds, math.ceil(max_time / max(block_s, 1e-6))))
        # a share now, the rest in later visits at the session's end (GateState.revisit); a
        # visit times at least MIN_VISIT_ROUNDS pairs, so a slow kernel's few (and long) pairs
        # stay in fewer visits (a visit of one or two pairs widens the bootstrap interval)
        visits = 1 if n <= MIN_PAIRS else max(1, min(state.settings.visits, n // MIN_VISIT_ROUNDS))
        shares = [len(v) for v in np.array_split(range(n), visits)]
        if visits == 1 and state.settings.visits > 1:
            shares = [FIRST_PAIRS, n - FIRST_PAIRS]
        name = side if base == REFERENCE else comparison(side, base)
        load: list[PairLoad] = []
        paired = interleaved(state.probes.timer, base_timed, side_timed, shares[0], calls, host=state.probes.host,
                             load=load, warm=warm)
        return paired, Visits(self.kernel, name, base_timed, side_timed, calls, shares[1:], warm), load

    def _compare(self, side: str, over: str, rounds: int) -> None:
        """A row of ``side`` timed interleaved against ``over`` (a peer), as its speedup over the
        reference is: the question "why not the peer?" answered by one paired measurement."""
        state = self._state
        measured = state.results[self.kernel][side]
        paired, later, load = self._pair(over, side, rounds)
        self._record(comparison(side, over), later, Measurement(
            times=measured.times, size=self.size, label=measured.label, peak_bytes=measured.peak_bytes,
            work_bytes=measured.work_bytes, work=measured.work, paired=paired, visits=1 + len(later.shares),
            variant=measured.variant, against=over, load=load, calls=later.calls[1],
            reference_calls=later.calls[0]))
        self._set_floors(side, measured.variant, over)

    def _set_floors(self, impl: str, variant: str | None, over: str | None = None) -> None:
        """Record the floors that apply to ``impl``'s row (over ``over`` when given)."""
        state = self._state
        key = (self.kernel, impl if over is None else comparison(impl, over))
        for mark_name, floors in (("speedup", state.floors.speed), ("memory", state.floors.memory)):
            if mark_name == "memory" and over is not None:
                continue
            floor, note = _floor(self._request.node, mark_name, impl, self.device, self.size, variant, over)
            if floor is not None and not state.floors.policy.applies(mark_name):
                floor, note = None, state.floors.policy.note
            if floor is not None:
                floors[key] = floor
            elif note and mark_name == "speedup":
                state.floors.notes[key] = note
