"""One row of ``--perf-against``: the working tree's callable and REV's, timed in interleaved
pairs of blocks (ABBA order, each block on a worker of its side chosen at random), and the rule
that judges their ratio.

ratio = the median of the pairs' ratios (REV's block / this tree's, the two timed back to back),
with the sign test's interval, widened by the units' offsets: under 1, this tree is slower. A row
FAILs when the whole interval is under 1 / (1 + tolerance) (this tree more than ``tolerance``
slower), or each of two stretches' interval is (the second on fresh workers: independent
evidence), on a quiet host, and the second stretch does not disagree; a straddling interval is
measured further within the row's budget and may end ``unresolved``; a
contended host gives no verdict. A row more than ``tolerance`` faster is
``faster`` when its second stretch, on fresh workers, reads faster by the tolerance too and not
slower at its interval's low end. A row REV cannot rebuild or run is ``not comparable``, with the
reason; one this tree's worker cannot (it crashed, hung, ran out of memory or raised on a row the
session itself ran) FAILs: the change broke it, which no timing may read as a pass."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .state import EARLY, MIN_PAIRS
from .stats import CONTENDED, clustered_interval
from .timing import block_calls
from .workers import Pool, WorkerGone

MAX_PAIRS = 400  # a row's pairs in all (the session's own rows: state.MAX_PAIRS)
COPIES = 3  # copies of a row's inputs each worker builds (units: a block times one at random) ...
COPIES_S = 3.0  # ... while building them takes under this many seconds
# The fewest units a side a straddling row is measured further on: with 2 (a row too slow to build
# for a second copy, on 2 workers a side) its units' offsets are read at 1 degree of freedom, and
# Student's t (12.7 at 95%) widens the interval past any pairs' resolving it. Such a row is built
# again with one more copy a worker, a new unit each (``Comparer.build_again``), where building the
# row took its slowest worker under EXTRA_COPY_S seconds (the extra copy's cost is not the budget's).
MIN_UNITS = 3
EXTRA_COPY_S = 30.0
BLOCK_TIMEOUT_S = 60.0  # a block's answer is awaited at least this long, and 20 x its expected time


@dataclass
class ABRow:
    """One row compared: times are block medians in seconds, ``ratio`` the median of the pairs'
    REV / this tree (``stats.clustered_interval``)."""

    kernel: str
    impl: str
    size: str
    nodeid: str
    label: str = ""
    rev_times: list[float] = field(default_factory=list)
    this_times: list[float] = field(default_factory=list)
    rev_units: list[int] = field(default_factory=list)  # the unit (worker, copy) each block ran on
    this_units: list[int] = field(default_factory=list)
    ratio: float | None = None
    low: float | None = None
    high: float | None = None
    contention: float | None = None
    confirmed: int = 0
    first_high: float | None = None  # the first stretch's interval top, when it was timed again
    confirm_ratio: float | None = None
    confirm_low: float | None = None
    confirm_high: float | None = None
    used: dict[str, list[int]] = field(default_factory=dict)  # blocks timed on each worker of a side
    reason: str = ""  # why the row is not comparable ("" when it is)
    broken: str = ""  # why this tree's worker could not build or run it ("" when it could): a failure
    outcome: str = ""  # FAIL, unresolved, not comparable, faster or ok (judge)
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Stretch:
    """Pairs timed together: each side's block medians, and the unit each ran on."""

    rev: list[float] = field(default_factory=list)
    this: list[float] = field(default_factory=list)
    rev_units: list[int] = field(default_factory=list)
    this_units: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rev)

    def interval(self, confidence: float) -> tuple[float, float, float]:
        """(REV / this, low, high): the paired interval, widened by the units' own offsets."""
        return clustered_interval(self.rev, self.this, self.rev_units, self.this_units, confidence)


def _after(both: Stretch, first: int) -> Stretch:
    """The pairs of ``both`` after its ``first``: the second stretch alone."""
    return Stretch(both.rev[first:], both.this[first:], both.rev_units[first:], both.this_units[first:])


def judge(row: ABRow, tolerance: float, contended: float = CONTENDED) -> str:
    """Set and return ``row.outcome`` and ``row.message`` by the rule above."""
    where = f"{row.kernel} [{row.impl}, {row.label or row.size}]"
    line = 1.0 / (1.0 + tolerance)
    if row.broken:
        row.outcome, row.message = "FAIL", f"{where}: this tree's worker could not run it: {row.broken}"
        return row.outcome
    if row.reason:
        row.outcome, row.message = "not comparable", f"{where}: not comparable: {row.reason}"
        return row.outcome
    assert row.ratio is not None and row.low is not None and row.high is not None
    measured = (f"REV/this {row.ratio:.3f}x (95% CI {row.low:.3f}-{row.high:.3f}x, {len(row.rev_times)} "
                f"interleaved pairs)")
    if row.contention is not None and row.contention >= contended:  # either way: see _busy
        row.outcome, row.message = "unresolved", _busy(row, where, measured)
        return row.outcome
    apart = (row.first_high is not None and row.first_high < line
             and row.confirm_high is not None and row.confirm_high < line)
    if row.high < line or apart:  # all the pairs, or each stretch on its own workers
        row.outcome, row.message = _slower(row, f"{where}: this tree", measured, tolerance)
    elif row.low < line:
        row.outcome = "unresolved"
        row.message = (f"{where}: {measured} straddles {line:.3f}x ({tolerance:.0%} slower): neither shown "
                       "within it nor beyond it; rerun, or give it more --perf-against-budget")
    elif row.low > 1.0 + tolerance and (row.confirm_ratio is None or (
            row.confirm_ratio > 1.0 + tolerance and (row.confirm_low is None or row.confirm_low > 1.0))):
        row.outcome, row.message = "faster", f"{where}: this tree is {row.ratio:.2f}x faster ({measured})"
    elif row.low > 1.0 + tolerance:
        row.outcome = "ok"
        low = "" if row.confirm_low is None else f" (from {row.confirm_low:.3f}x)"
        row.message = (f"{where}: {measured}, but {row.confirmed} pairs timed again on fresh workers read "
                       f"{row.confirm_ratio:.3f}x{low}: not shown faster")
    else:
        row.outcome, row.message = "ok", f"{where}: {measured}"
    return row.outcome


def _busy(row: ABRow, where: str, measured: str) -> str:
    """Why a row timed while the host withheld CPU time is no verdict, whichever way it read: the
    withheld time need not fall on the two sides alike. A block of 2 threads waits at each parallel
    region for the vCPU a neighbour holds, one of 1 thread barely, so a change that drops a
    kernel's threading can read faster than REV beside a busy process and slower alone."""
    assert row.ratio is not None
    reading = (f"{1.0 / row.ratio:.2f}x slower" if row.ratio < 0.995 else f"{row.ratio:.2f}x faster"
               if row.ratio > 1.005 else "as fast")
    return (f"{where}: this tree read {reading} ({measured}), but the host withheld {row.contention:.0%} of the "
            "CPU time while its pairs ran: no verdict on the code either way; rerun on a quieter host")


def _slower(row: ABRow, this: str, measured: str, tolerance: float) -> tuple[str, str]:
    """The outcome and message of a row whose whole interval is under the line, or each of whose two
    stretches' is: a failure, unless a second stretch disagreed."""
    line, slower = 1.0 / (1.0 + tolerance), 1.0 / row.ratio
    if (row.confirm_ratio is not None and row.confirm_high is not None
            and row.confirm_ratio > row.high and row.confirm_high >= line):
        return "unresolved", (f"{this} read {slower:.2f}x slower ({measured}), but {row.confirmed} pairs timed "
                              f"again read {row.confirm_ratio:.3f}x (up to {row.confirm_high:.3f}x): the host "
                              "changed between the two")
    alone = "" if row.high < line else (
        f"; each stretch alone is beyond it: the first up to {row.first_high:.3f}x, {row.confirmed} pairs on "
        f"fresh workers {row.confirm_ratio:.3f}x (up to {row.confirm_high:.3f}x)")
    return "FAIL", (f"{this} is {slower:.2f}x slower than REV ({measured}; the line is {tolerance:.0%} slower, "
                    f"{line:.3f}x{alone})")


def pair_cpus(pool: Pool) -> list[int] | None:
    """The CPUs a pair's two blocks run their calling thread on, one chosen at random a pair, or
    None: on the CPU device where the process may run on two or more. Two vCPUs of one VM need not
    run at one speed (on the Xeon 207 each in turn ran 1.3-1.6x slower for seconds: docs/gate.md,
    "The core's pace"), and a worker stays on the CPU it last ran on, so REV's and this tree's
    blocks, in two processes, would each read their own CPU's speed. On one CPU a pair's two
    blocks share its speed, and the pairs sample every CPU. Only the calling thread is moved: a
    2-thread block's other thread runs where the host puts it, on both sides alike."""
    hello = (getattr(pool, "hellos", None) or {}).get("this")
    if hello is None or hello.device != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed if len(allowed) >= 2 else None


@dataclass
class Budget:
    """How many pairs a row gets: enough blocks to fill ``seconds`` (at least MIN_PAIRS), extended
    by doubling while it straddles the line, within ``extend_s`` and its share of ``total_s``."""

    seconds: float = 1.0
    extend_s: float = 10.0  # at most this much a row
    total_s: float = 240.0  # shared by the rows straddling after all planned pairs: each its share of what is left
    all_pairs: bool = False  # the stopping rule off (perfgate.fidelity's comparison)


@dataclass
class Planned:
    """What a row's planned pairs leave its extension: each side's block shape, a pair's seconds,
    and the host's (wall seconds, withheld share) readings so far."""

    blocks: dict[str, tuple[int, int, float]]
    pair_s: float
    loads: list[tuple[float, float]]
    copies: dict[tuple[str, int], int] = field(default_factory=dict)  # (side, worker index) -> copies built
    built_s: float = 0.0  # the slowest worker's seconds to build them


def _withheld(loads: list[tuple[float, float]]) -> float | None:
    """The host's withheld CPU share over (wall seconds, share) readings, wall-weighted; None without any."""
    wall = sum(w for w, _ in loads)
    return None if wall <= 0 else sum(w * s for w, s in loads) / wall


class Comparer:
    """Times the rows of one session against REV on a started ``pool``."""

    def __init__(self, pool: Pool, tolerance: float, budget: Budget, seed: int = 0) -> None:
        self.pool, self.tolerance, self.budget = pool, tolerance, budget
        self.rng = random.Random(seed)
        self.cpus = pair_cpus(pool)  # the CPUs a pair's two blocks are run on, one chosen a pair
        # side -> (timed calls, warming calls, a call's seconds) for the row being timed
        self.blocks: dict[str, tuple[int, int, float]] = {}
        self.copies: dict[tuple[str, int], int] = {}  # (side, worker index) -> copies of the row it built
        self.built_s = 0.0  # the slowest worker's seconds in the last build
        self.generation = 0  # the pool's: a fresh pool's units are new ones
        self.planned: dict[str, Planned] = {}  # row -> what its planned pairs leave its extension
        self.extended_s = 0.0  # of budget.total_s: the seconds the rows' extensions have taken

    def use(self, pool: Pool) -> None:
        """Time on ``pool`` from now on (fresh workers: new units)."""
        self.pool, self.generation = pool, self.generation + 1

    def build(self, row: ABRow, request: dict[str, Any], copies: dict[tuple[str, int], int] | None = None) -> bool:
        """Rebuild ``row`` on every worker, up to COPIES copies each while they build within
        COPIES_S, or ``copies[(side, worker index)]`` (default 1) when given, in either case while
        the host's memory holds a first copy for each worker after it (``abworker.copy_fits``); False
        (and ``row.reason``) when a side cannot."""
        warm: dict[str, list[float]] = {"rev": [], "this": []}
        self.copies, self.built_s = {}, 0.0  # this row's: a worker lost on an earlier row builds none
        workers = list(self.pool.workers)
        for k, worker in enumerate(workers):
            builds, build_s = ((COPIES, COPIES_S) if copies is None
                               else (copies.get((worker.side, worker.index), 1), math.inf))
            t0 = time.perf_counter()
            try:
                reply = self.pool.ask(worker, "build", 600.0, builds=builds, build_s=build_s,
                                      others=len(workers) - k - 1, **request)
            except WorkerGone as exc:
                reply = {"ok": False, "reason": str(exc)}
            self.built_s = max(self.built_s, time.perf_counter() - t0)
            if not reply.get("ok"):
                if worker.side == "this" and not reply.get("not_comparable"):
                    row.broken = f"{worker.name}: {reply.get('reason')}"  # the session ran it: this tree broke
                else:
                    who = "REV" if worker.side == "rev" else "this tree's worker"
                    row.reason = f"{who} cannot run it: {reply.get('reason')}"
                return False
            warm[worker.side].append(reply["warm_s"])
            self.copies[(worker.side, worker.index)] = int(reply.get("builds", 1))
            row.label = row.label or reply.get("label", "")
        if not warm["this"]:
            row.broken = "no this-tree worker is left (the earlier ones died)"
            return False
        if not warm["rev"]:
            row.reason = "no REV worker is left"
            return False
        # one block shape for both sides, from both sides' warm calls: each side's own (one noisy
        # call a worker) gave unchanged code near WARM_S a warming call on one side and not the other
        shape = block_calls(float(np.median(warm["rev"] + warm["this"])))
        for side in ("rev", "this"):
            self.blocks[side] = (*shape, float(np.median(warm[side])))  # its own seconds: the timeout
        return True

    def _block(self, row: ABRow, side: str, loads: list[tuple[float, float]],
               cpu: int | None = None) -> tuple[float, int]:
        """A block of ``side`` on a worker and copy chosen at random, on ``cpu`` where given: (its
        median, its unit)."""
        workers = self.pool.side(side)
        if not workers:
            raise WorkerGone(f"no {side} worker is left")
        worker = self.rng.choice(workers)
        copy = self.rng.randrange(self.copies.get((side, worker.index), 1))
        calls, warm, seconds = self.blocks[side]
        timeout = max(BLOCK_TIMEOUT_S, 20.0 * (calls + warm) * seconds)
        try:
            reply = self.pool.ask(worker, "block", timeout, row=row.nodeid, calls=calls, warm=warm, build=copy,
                                  **({} if cpu is None else {"cpu": cpu}))
            if not reply.get("ok"):
                raise WorkerGone(f"{worker.name}: {reply.get('reason')}")
        except WorkerGone as exc:  # died, hung or raised mid-block: on this tree's side, a failure
            if side == "this":
                row.broken = str(exc)
            raise
        row.used.setdefault(side, [0] * self.pool.per_side)[worker.index] += 1
        if reply["share"] is not None:
            loads.append((reply["share"][0], reply["share"][1]))
        return float(np.median(reply["times"])), (self.generation * 100 + worker.index) * 100 + copy

    def pairs(self, row: ABRow, count: int, into: Stretch, loads: list[tuple[float, float]]) -> None:
        """Time ``count`` more pairs into ``into``: REV first in even pairs; both blocks of a pair on
        one CPU chosen at random on the CPU device (``pair_cpus``)."""
        for _ in range(count):
            cpu = self.rng.choice(self.cpus) if self.cpus else None
            if len(into) % 2 == 0:
                r, ru = self._block(row, "rev", loads, cpu)
                t, tu = self._block(row, "this", loads, cpu)
            else:
                t, tu = self._block(row, "this", loads, cpu)
                r, ru = self._block(row, "rev", loads, cpu)
            into.rev.append(r)
            into.this.append(t)
            into.rev_units.append(ru)
            into.this_units.append(tu)

    def time_row(self, row: ABRow) -> bool:
        """Pairs until the row is decided at EARLY or its planned pairs are spent; then ``row``'s
        ratio and interval. True when that interval straddles the line: the row is measured further
        (``extend``) after every row's planned pairs, so the extension budget goes only to the rows
        that need it, not in equal shares to rows the planned pairs decide."""
        line = 1.0 / (1.0 + self.tolerance)
        loads: list[tuple[float, float]] = []
        got = Stretch(row.rev_times, row.this_times, row.rev_units, row.this_units)
        t0 = time.perf_counter()
        self.pairs(row, MIN_PAIRS, got, loads)
        pair_s = (time.perf_counter() - t0) / MIN_PAIRS
        planned = max(MIN_PAIRS, min(MAX_PAIRS, math.ceil(self.budget.seconds / max(pair_s, 1e-6))))
        step = max(1, planned // 4)
        while len(got) < planned:
            if not self.budget.all_pairs:
                _, low, high = got.interval(EARLY)
                if high < line or low >= line:
                    break
            self.pairs(row, min(step, planned - len(got)), got, loads)
        self.planned[row.nodeid] = Planned(dict(self.blocks), pair_s, loads, dict(self.copies), self.built_s)
        row.ratio, row.low, row.high = got.interval(0.95)
        row.contention = _withheld(loads)
        return row.low < line <= row.high

    def build_again(self, row: ABRow, fresh: ABRow, request: dict[str, Any]) -> bool:
        """Build straddling ``row`` again on its workers to be measured further (``extend``), into
        ``fresh`` (its reason when a side cannot), as it was built for its planned pairs (the same
        units); but where a side had fewer than MIN_UNITS units and the build took under
        EXTRA_COPY_S, every worker builds the copies it had and one more: built while the others
        are alive, the new copy lands elsewhere, a unit of its own. Where that build fails (the
        extra copy's memory, a lost worker), the row is built as it was."""
        planned = self.planned[row.nodeid]
        units = [sum(n for (side, _), n in planned.copies.items() if side == s) for s in ("rev", "this")]
        if not planned.copies or min(units) >= MIN_UNITS or planned.built_s > EXTRA_COPY_S:
            return self.build(fresh, request)
        if self.build(fresh, request, {key: n + 1 for key, n in planned.copies.items()}):
            return True
        fresh.reason = fresh.broken = ""
        return self.build(fresh, request)

    def extension_s(self, rows_left: int = 1) -> float:
        """The seconds the next row extended may take: at most ``budget.extend_s``, and its share of
        what the rows extended before it left of ``budget.total_s``, with ``rows_left`` rows (it
        included) still to extend."""
        share = max(0.0, self.budget.total_s - self.extended_s) / max(1, rows_left)
        return min(self.budget.extend_s, share)

    def extend(self, row: ABRow, rows_left: int = 1) -> None:
        """More pairs for a row whose planned pairs left it straddling (``time_row``), built again
        (``build``) in the same workers, in the block shape its planned pairs had: doubling while it
        straddles, for ``extension_s``. Then ``row``'s ratio and interval over all its pairs. A copy
        built again counts as the first build's copy of its index, the same unit: in the same process
        it may land where the dropped one was, so it is not counted as independent of it."""
        planned = self.planned[row.nodeid]
        self.blocks = dict(planned.blocks)
        got = Stretch(row.rev_times, row.this_times, row.rev_units, row.this_units)
        now = time.perf_counter()
        try:
            self._extend(row, got, planned.loads, planned.pair_s, MAX_PAIRS, now + self.extension_s(rows_left))
        finally:  # Ctrl-C or a lost worker mid-extension: the row is judged on every pair it has
            self.extended_s += time.perf_counter() - now
            row.ratio, row.low, row.high = got.interval(0.95)
            row.contention = _withheld(planned.loads)

    def _extend(self, row: ABRow, got: Stretch, loads: list[tuple[float, float]], pair_s: float, cap: int,
                until: float, decided: Callable[[], bool] = lambda: False) -> None:
        """While ``got``'s interval straddles the line and ``decided()`` is false: pairs, doubling,
        up to ``cap`` in all and until the clock reads ``until``."""
        line = 1.0 / (1.0 + self.tolerance)
        while len(got) < cap and time.perf_counter() < until and not decided():
            _, low, high = got.interval(0.95)
            if high < line or low >= line:
                break
            more = min(len(got), cap - len(got))
            more = min(more, max(1, int((until - time.perf_counter()) / max(pair_s, 1e-6))))
            self.pairs(row, more, got, loads)

    def confirm(self, row: ABRow) -> None:
        """A failing or faster row's second stretch, on fresh workers (new units): as many pairs
        as the first, at least 2 x MIN_PAIRS, then more while both stretches' interval straddles
        the line, and more while the second reads above both's interval with its own straddling
        (each at most ``budget.extend_s``). The second stretch is read on its own (``confirm_*``),
        and the row's ratio and interval become those of both, every unit of both pools counted."""
        assert row.high is not None
        first, first_high = len(row.rev_times), row.high
        row.first_high = first_high
        both = Stretch(row.rev_times, row.this_times, row.rev_units, row.this_units)
        loads: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        self.pairs(row, max(2 * MIN_PAIRS, first), both, loads)
        pair_s = (time.perf_counter() - t0) / (len(both) - first)
        line = 1.0 / (1.0 + self.tolerance)

        def alone() -> bool:  # each stretch alone beyond the line fails the row (judge): no more pairs
            return first_high < line and _after(both, first).interval(0.95)[2] < line

        until = time.perf_counter() + self.budget.extend_s
        self._extend(row, both, loads, pair_s, first + MAX_PAIRS, until, alone)
        self._settle(row, both, first, loads, pair_s, time.perf_counter() + self.budget.extend_s)
        # the host's withheld share over the second stretch counts as the first's does: a row
        # measured again while the host was busy is no verdict either
        second = _withheld(loads)
        if second is not None:
            row.contention = second if row.contention is None else max(row.contention, second)
        again = _after(both, first)
        row.confirmed = len(again)
        row.confirm_ratio, row.confirm_low, row.confirm_high = again.interval(0.95)
        row.ratio, row.low, row.high = both.interval(0.95)

    def _settle(self, row: ABRow, both: Stretch, first: int, loads: list[tuple[float, float]], pair_s: float,
                until: float) -> None:
        """While both stretches' interval is under the line but the second (``both`` after
        ``first``) reads above it, which would clear the row as "the host changed", yet its own
        interval reaches under the line: more of it, doubling, until the clock reads ``until``.
        A short second stretch on fresh workers otherwise turns a real slowdown ``unresolved``."""
        line = 1.0 / (1.0 + self.tolerance)
        while len(both) < first + MAX_PAIRS and time.perf_counter() < until:
            ratio, low, high = _after(both, first).interval(0.95)
            both_high = both.interval(0.95)[2]
            if not (both_high < line and ratio > both_high and low < line <= high):
                break
            more = min(len(both) - first, first + MAX_PAIRS - len(both))
            self.pairs(row, min(more, max(1, int((until - time.perf_counter()) / max(pair_s, 1e-6)))), both, loads)

    def drop(self, row: ABRow) -> None:
        for worker in list(self.pool.workers):
            try:
                self.pool.ask(worker, "drop", 60.0, row=row.nodeid)
            except WorkerGone:
                continue
