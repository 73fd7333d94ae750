"""Per-session state of the gate: what was measured, the floors, the stored baseline."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from statistics import median

import numpy as np
import pytest

from .floors import REFERENCE, FloorPolicy
from .hooks import Wrap
from .roofline import Figure, Limits, Work, usual_pace, usual_round_trip
from .stats import (
    CONTENDED,
    PARTNER_IDLE_NS,
    SpeedupRow,
    apart,
    decided,
    gate,
    imprecise,
    misses,
    slowed,
    speedup_interval,
    straddles,
)
from .timing import HostLoad, PairLoad, Timed, Timer, allow, bandwidth_withheld, interleaved, pin, withheld

MAX_PAIRS = 1000  # a straddled row is extended up to this many interleaved pairs in all
# The interval a row's later visits are decided by: a row whose 99% interval already clears every
# rule that applies to it is not measured further (the verdict, at the end, is at 95%).
EARLY = 0.99
# Interleaved pairs, at least, before a row may fail: with 5 pairs a percentile bootstrap's 2.5%
# bound is set by one outlying pair (a resample repeats it 3 times in 5 with probability 6%; in 7,
# 4 times: 0.9%). A row's first visit may be shorter (case.FIRST_PAIRS): it can only pass there.
MIN_PAIRS = 7
# Seconds a session may wait, in all, for torch's threads to be placed near before timing a failing
# row again (GateState.confirm): the host moves them back within seconds to minutes.
PLACEMENT_WAIT_S = 60.0
# Seconds the fastest CPU's pace is scanned at a session's start and end (GateState.scan_pace), and
# at the start of one that saves a baseline, which stands for the machine's usual pace
SCAN_S = 0.5
SAVING_SCAN_S = 2.0


@dataclass
class Measurement:
    times: list[float]
    size: str
    label: str
    peak_bytes: int | None
    work_bytes: float | None = None  # bytes one call moves, when the test declares it
    paired: list[tuple[float, float]] | None = None  # (reference, this impl) rounds timed alternately
    visits: int = 1  # how many visits timed ``paired``
    variant: str | None = None  # what the impl chose at run time (``perf(..., variant=)``)
    against: str = REFERENCE  # the impl ``paired`` times it against: a peer for a comparison row
    peer: bool = False  # the impl is a peer library (a ``speedup(over=)`` target), not ours
    load: list[PairLoad] = field(default_factory=list)  # what the host withheld, per pair of ``paired``
    calls: int = 1  # timed calls in each of this impl's blocks of ``paired`` (the block's median)
    reference_calls: int = 1  # and in each of the blocks it is paired against
    again: slice | None = None  # the pairs of ``paired`` that timed a failure again (GateState.confirm)
    work: Work | None = None  # one call's least bytes and FLOPs, counted (roofline.count_work); None: not counted
    work_note: str = ""  # why ``work`` was not counted


@dataclass
class Visits:
    """The interleaved rounds of one impl still to time, one entry of ``shares`` per later visit."""

    kernel: str
    impl: str
    reference: Timed
    timed: Timed
    calls: tuple[int, int]
    shares: list[int]
    warm: tuple[int, int] = (1, 1)  # untimed calls before each side's block (timing.WARM_S)


@dataclass(frozen=True)
class Settings:
    """What the session measures and judges with, fixed when it starts (session.activate)."""

    device: str
    size: str
    threads: int | None
    tolerance: float
    fingerprint: dict
    slug: str
    visits: int = 3  # --perf-visits: each impl's interleaved rounds are timed in this many visits
    extend_s: float = 60.0  # --perf-extend: seconds of extra pairs a row straddling its floor or baseline may take
    contended: float = CONTENDED  # --perf-contended: the withheld CPU share that leaves a verdict unjudged
    all_visits: bool = False  # --perf-all-visits: the stopping rule off
    gated_only: bool = False  # --perf-gated-only: time only the impls and pairs a floor or baseline judges
    compared: bool = False  # --perf-against: the impls it compares count as judged under --perf-gated-only
    saving: bool = False  # --benchmark-save or --benchmark-autosave: the rows become a stored baseline
    wrap: Wrap | None = None  # a test plugin's wrapper of the timed callables (hooks.pytest_perfgate_wrap_timed)


@dataclass
class Stored:
    """The stored run compared against (--benchmark-compare), by ``baseline_key``."""

    speedups: dict[str, tuple[float, float]] | None = None  # (speedup, its interval's low); None: no compare
    memory: dict[str, float] = field(default_factory=dict)  # optimized/reference peak ratios
    path: str | None = None
    run_id: str | None = None  # the compared run's commit and time: shards merge only when alike


@dataclass
class Floors:
    """The floors that apply to this session's rows, by (kernel, impl)."""

    speed: dict[tuple[str, str], float] = field(default_factory=dict)
    memory: dict[tuple[str, str], float] = field(default_factory=dict)  # least fraction saved
    notes: dict[tuple[str, str], str] = field(default_factory=dict)  # why a declared floor is not applied
    policy: FloorPolicy = field(default_factory=FloorPolicy)  # whether the speedup floors apply here


@dataclass
class Probes:
    """The session's clock, its reader of what the host withheld, and the thread pools it pinned."""

    timer: Timer | None  # the device's clock (CUDA events, or the host timer) and the L2 flush
    host: HostLoad | None  # reads the CPU time (and bandwidth) the host withheld while pairs were timed
    threads: int | None
    limiters: list = field(default_factory=list)  # threadpoolctl limits set by pin_threads, to restore

    def pin_threads(self) -> None:
        """Every BLAS and OpenMP pool loaded in the process (numpy's and scipy's OpenBLAS, a
        peer's OpenMP) at the session's thread count, as torch's own pool is. Called before each
        impl is timed: a library may load its pool at first use, and one left at its default
        competes with torch's for the same CPUs."""
        if self.threads is not None:
            from threadpoolctl import threadpool_limits

            self.limiters.append(threadpool_limits(limits=self.threads))

    def unpin_threads(self) -> None:
        """The pools' thread counts as they were before the session (pytester runs in-process)."""
        while self.limiters:
            self.limiters.pop().restore_original_limits()



@dataclass
class Later:
    """What is timed after the tests: the later visits, and the timers kept to extend or confirm a row."""

    pending: list[Visits] = field(default_factory=list)  # the later visits, timed by GateState.revisit
    timers: dict[tuple[str, str], Visits] = field(default_factory=dict)
    skipped: dict[tuple[str, str], int] = field(default_factory=dict)  # later pairs a decided row did not need


@dataclass
class Tally:
    """What the session's end reports beside the rows."""

    durations: dict[str, float] = field(default_factory=dict)  # seconds per test function, setup to teardown
    tests_failed: int = 0  # tests of the session that failed (an assertion, not the gate)
    unmeasured: int = 0  # perf calls that ran with benchmarks disabled
    not_timed: list[str] = field(default_factory=list)  # "kernel [impl]" --perf-gated-only left untimed
    figures: list[dict] = field(default_factory=list)  # the roofline figures, GateState.placed at the end
    limits_rose: list[str] = field(default_factory=list)  # limits measured again and higher, in words
    limits_read: list[str] = field(default_factory=list)  # limits the reading after the rows raised, in words
    placement_wait: float = 0.0  # seconds waited for the host's usual placement and pace (GateState.confirm)


@dataclass
class GateState:
    """One perf session: its settings, what it measured, the floors and stored run it judges by."""

    settings: Settings
    probes: Probes
    floors: Floors = field(default_factory=Floors)
    stored: Stored = field(default_factory=Stored)
    later: Later = field(default_factory=Later)
    tally: Tally = field(default_factory=Tally)
    results: dict[str, dict[str, Measurement]] = field(default_factory=dict)
    runners: dict = field(default_factory=dict)  # (kernel, impl) -> (timed callable, its median s)
    rows: list[SpeedupRow] | None = None
    shard: dict | None = None  # --perf-shard: index, count, plan digest, this shard's test functions
    interrupted: bool = False  # Ctrl-C: no later visits, no extensions
    limits: Limits | None = None  # this machine's bandwidth and GEMM peaks, for the roofline figures
    usual: float | None = None  # the threads' usual round trip, fixed once the visits are timed
    usual_pace: float | None = None  # the core's usual pace, fixed alike
    scans: list[float] = field(default_factory=list)  # the fastest CPU's pace, read at the start and end

    def revisit(self) -> None:
        """Time every impl's later visits, in passes over all impls (visit 2 of each, then visit 3
        of each, ...), so each row's interleaved rounds sample host states apart in time, not only
        the one it happened to meet during its test. A row already decided (``decided`` on its
        ``EARLY`` interval: every rule that applies to it cleared, or none applies) on MIN_PAIRS
        pairs or more is not visited again: its remaining pairs are counted in ``skipped``. A row
        no rule judges is still timed to MIN_PAIRS, the pairs a failing verdict needs (under 6 give
        no bounded 95% interval, ``stats.sign_interval``): what it reports then says something."""
        pending = [] if self.interrupted else self.later.pending
        for v in range(max((len(p.shares) for p in pending), default=0)):
            for p in pending:
                if v >= len(p.shares):
                    continue
                m = self.results[p.kernel][p.impl]
                early = self._row(p.kernel, p.impl, EARLY)
                if not self.settings.all_visits and len(m.paired) >= MIN_PAIRS and \
                        decided(early, self.settings.tolerance, self.settings.saving):
                    self.later.skipped[(p.kernel, p.impl)] = sum(p.shares[v:])
                    m.visits -= len(p.shares) - v
                    p.shares = p.shares[:v]
                else:
                    self._time_pairs(p, p.shares[v])
        self.later.pending.clear()

    def _time_pairs(self, later: Visits, pairs: int) -> None:
        m = self.results[later.kernel][later.impl]
        m.paired += interleaved(self.probes.timer, later.reference, later.timed, pairs, later.calls,
                                first_round=len(m.paired), host=self.probes.host, load=m.load, warm=later.warm)

    def judge_with(self, against: dict[tuple[str, str], str]) -> None:
        """Judge the rows again with --perf-against's outcomes of the same session (``against``,
        by (kernel, impl)): a stored baseline's drop on a row shown no slower than REV is not
        this change's (``stats.gate``)."""
        for row in self.rows or []:
            row.against = against.get((row.kernel, row.impl))
            gate(row, self.settings.tolerance, self.settings.contended)

    def compute_rows(self) -> list[SpeedupRow]:
        """Speedup rows for every impl measured beside its reference (computed once). A row whose
        interval straddles its floor or its stored baseline's line, or is too wide for the baseline
        this session saves, gets more interleaved pairs first (``resolve``); then every kept
        callable is freed. Ctrl-C during that extra timing stops it, and the rows are made from
        what was measured (the session then ends interrupted, plugin.py)."""
        if self.rows is not None:
            return self.rows
        try:
            self.revisit()
        except KeyboardInterrupt:
            self.interrupted = True
        # every row judged against one placement and one pace, whatever is timed next
        self.scan_pace()
        self.usual, self.usual_pace = self.near_round_trip_ns, self.usual_pace_ns
        rows = []
        for kernel, impls in self.results.items():
            if REFERENCE not in impls:
                continue
            for impl in impls:
                if impl != REFERENCE:
                    row = self._row(kernel, impl)
                    # a failure, or a miss timed with the threads apart or the core slowed, is timed again
                    # (as the host usually runs, if it allows)
                    if (row.failures or row.apart or row.slowed) and any(misses(row, self.settings.tolerance)) \
                            and not self.interrupted:
                        try:
                            row = self.confirm(row)
                        except KeyboardInterrupt:
                            self.interrupted = True
                            row = self._row(kernel, impl)
                    if self._open(row) and not row.failures and not self.interrupted:
                        try:
                            row = self.resolve(row)
                            # a failure the extension's pairs brought is timed again too, as any failure is
                            if row.failures and any(misses(row, self.settings.tolerance)) \
                                    and self.results[kernel][impl].again is None:
                                extended, tightened = row.extended, row.tightened
                                row = self.confirm(row)
                                row.extended, row.tightened = extended, tightened
                        except KeyboardInterrupt:
                            self.interrupted = True
                            row = self._row(kernel, impl)
                    rows.append(row)
        self.later.timers.clear()
        self.runners.clear()
        if self.limits is not None and self.round_trips():
            self.limits.note_round_trip(min(self.round_trips()))
            self.limits.note_usual_round_trip(self.round_trips())
        if self.limits is not None and (self.scans or self.paces()):
            self.limits.note_usual_pace(self.scans or self.paces())
        self.recheck_limits(rows)
        for row in rows:
            self._place(row)
        self.rows = rows
        return rows

    def recheck_limits(self, rows: list[SpeedupRow]) -> None:
        """Measure again each roofline limit an impl's median call passed (``Limits.recheck``),
        before any figure is made, so every figure of the session is against the same limits:
        the median of its own rounds (the roofline section's) and of each row's interleaved pairs
        (the table's). Where a call moved bytes, read the stream as it is now (``Limits.read_now``)."""
        if self.limits is not None:
            calls = [(m.work, median(m.times)) for impls in self.results.values() for m in impls.values()
                     if m.work is not None and m.times]
            calls += [(m.work, row.optimized_ms / 1e3) for row in rows
                      if (m := self.results.get(row.kernel, {}).get(row.impl)) is not None and m.work is not None]
            self.tally.limits_rose += self.limits.recheck(calls)
            if any(work.bytes > 0 for work, _ in calls):  # impls that moved bytes: the rate of the minute too
                self.tally.limits_read += self.limits.read_now()

    def _place(self, row: SpeedupRow) -> None:
        """``row``'s roofline figure (its impl's counted work over its median time), and its GB/s
        from that work where the test declared none."""
        m = self.results[row.kernel][row.impl]
        figure = self.figure(m, row.optimized_ms / 1e3)
        if figure is not None:
            row.roofline, row.roofline_bound, row.optimized_gflops = figure.fraction, figure.bound, figure.gflops
            row.optimized_gbps = row.optimized_gbps or figure.gbps

    def figure(self, m: Measurement, seconds: float) -> Figure | None:
        """Where ``m``'s impl, taking ``seconds`` a call, sits under this machine's roofline."""
        return None if m.work is None or self.limits is None else self.limits.figure(m.work, seconds)

    def placed(self) -> list[dict]:
        """The roofline section's entries: every impl but the references and the comparison rows
        (so an impl timed without its reference too), at the median of its own rounds."""
        entries = []
        for kernel, impls in self.results.items():
            for impl, m in impls.items():
                if impl == REFERENCE or m.against != REFERENCE:
                    continue
                seconds = median(m.times)
                figure = self.figure(m, seconds)
                entries.append({
                    "kernel": kernel, "impl": impl, "label": m.label, "ms": 1e3 * seconds,
                    "bytes": None if m.work is None else m.work.bytes,
                    "written": None if m.work is None else m.work.written,
                    "flops": None if m.work is None else m.work.flops,
                    **({"fraction": None, "bound": None, "gbps": None, "gflops": None} if figure is None
                       else asdict(figure)), "note": m.work_note})
        return entries

    def confirm(self, row: SpeedupRow) -> SpeedupRow:
        """Time ``row``, which misses its floor or baseline, again: as many pairs as it was given
        (those timed and those the stopping rule skipped, at least ``MIN_PAIRS``), within
        ``extend_s``. The row then fails only if these pairs alone miss too (``stats.gate``); a
        kernel that got slower misses in both stretches."""
        timer = self.later.timers.get((row.kernel, row.impl))
        m = self.results[row.kernel][row.impl]
        if timer is None or m.again is not None:
            return row
        per_pair = max(_pair_seconds(m, timer, self.probes.timer.cost), 1e-9)
        given = len(m.paired) + self.later.skipped.get((row.kernel, row.impl), 0)
        pairs = min(max(MIN_PAIRS, given), int(self.settings.extend_s / per_pair), MAX_PAIRS - len(m.paired))
        if pairs < MIN_PAIRS:  # --perf-extend too short for a stretch that could fail: the row stands
            return row
        start = len(m.paired)
        m.visits += 1
        with self._on_fastest_cpu():
            self._await_usual()
            self._time_pairs(timer, pairs)
        m.again = slice(start, len(m.paired))
        return self._row(row.kernel, row.impl)

    @contextlib.contextmanager
    def _on_fastest_cpu(self) -> Iterator[None]:
        """In a session of one torch thread, run the block on the CPU the pace probe reads fastest
        now (``timing.Pace.fastest``), then allow the thread its CPUs again: a failure's second
        stretch is timed at the usual pace where one CPU has it. Elsewhere (more threads, whose
        other threads the probe does not move; no pace read) the block runs as it is."""
        probe = None if self.probes.host is None else self.probes.host.pace
        fastest = probe.fastest() if probe is not None and self.settings.threads == 1 else None
        allowed = None if fastest is None else pin(fastest[0])
        try:
            yield
        finally:
            if allowed is not None:
                allow(allowed)

    def _await_usual(self) -> None:
        """Where the host runs torch's threads apart or the timing thread's core slowed now, wait
        (0.1 s at a time, at most ``PLACEMENT_WAIT_S`` in the session) until it runs them as usual
        again: a failure's second stretch is then timed where the kernel can be judged."""
        host = self.probes.host
        if host is None or not math.isfinite(self.settings.contended):  # inf: all judged
            return
        near, pace = self.near_round_trip_ns, self.usual_pace_ns

        def off() -> bool:
            return (host.placement is not None and near is not None and apart(host.placement.read(), near)) or \
                (host.pace is not None and pace is not None and slowed(host.pace.read(), pace))

        if not off():
            return
        start, left = time.perf_counter(), PLACEMENT_WAIT_S - self.tally.placement_wait
        while time.perf_counter() - start < left and off():
            time.sleep(0.1)
        self.tally.placement_wait += time.perf_counter() - start

    def _open(self, row: SpeedupRow) -> bool:
        """``row``'s interval straddles its floor or its stored baseline's line (``stats.straddles``),
        or is too wide for the baseline this session saves (``stats.imprecise``), or has too few
        pairs timed as the host usually runs to stand for the machine in it (``_unusual``)."""
        tolerance = self.settings.tolerance
        return straddles(row, tolerance) or (self.settings.saving and (imprecise(row, tolerance)
                                                                       or _unusual(row)))

    def resolve(self, row: SpeedupRow) -> SpeedupRow:
        """Time more interleaved pairs of ``row`` until its interval leaves its floor and its stored
        baseline's line (``stats.straddles``; above: met, under: missed) and, where this session
        saves a baseline, is narrow enough to be one (``stats.imprecise``), or ``extend_s`` is
        spent: each step doubles the pairs, so the interval narrows by about 1/sqrt(2) a step, and a
        step is taken only while the budget holds it."""
        timer = self.later.timers.get((row.kernel, row.impl))
        if timer is None:  # timed apart from its reference (e.g. under -k): nothing to extend
            return row
        m = self.results[row.kernel][row.impl]
        start, pairs = time.perf_counter(), len(m.paired)
        # extended for the saved baseline's sake alone: its interval clear of every line it may fail
        tightened = self.settings.saving and (imprecise(row, self.settings.tolerance) or _unusual(row)) and \
            not straddles(row, self.settings.tolerance)
        while self._open(row):
            spent = time.perf_counter() - start
            per_pair = (spent / (len(m.paired) - pairs)) if len(m.paired) > pairs else \
                _pair_seconds(m, timer, self.probes.timer.cost)
            fits = int((self.settings.extend_s - spent) / max(per_pair, 1e-9))
            step = min(len(m.paired), MAX_PAIRS - len(m.paired), fits)
            if step < 1:
                break
            if len(m.paired) == pairs:
                m.visits += 1  # the extension's pairs are one more visit, at the session's end
            if _unusual(row):  # timed as the host usually runs, if it allows
                self._await_usual()
            self._time_pairs(timer, step)
            row = self._row(row.kernel, row.impl)
            row.extended, row.tightened = len(m.paired) - pairs, tightened
        return row

    def _row(self, kernel: str, impl: str, confidence: float = 0.95) -> SpeedupRow:
        """``impl``'s speedup row from what is measured now, gated at ``confidence``."""
        m = self.results[kernel][impl]
        ref = self.results[kernel][m.against]
        # With declared work on both sides the ratio is of throughput (bytes/s), e.g. a
        # kernel against the streaming bandwidth; with equal work it is the time ratio.
        scale = m.work_bytes / ref.work_bytes if ref.work_bytes and m.work_bytes else 1.0
        # interleaved pairs when the reference ran first in this session, else the two runs
        ref_t, opt_t = (list(t) for t in zip(*m.paired, strict=True)) if m.paired else (ref.times, m.times)
        point, low, high = (scale * v for v in speedup_interval(ref_t, opt_t, confidence, paired=bool(m.paired)))
        whole = bool(m.paired) and len(m.load) == len(m.paired)  # every pair's host load was read
        again = None  # the pairs timed again at the session's end, alone
        if m.again is not None:
            again = [scale * v for v in speedup_interval(*zip(*m.paired[m.again], strict=True),
                                                          confidence, paired=True)]
        stored = (self.stored.speedups or {}).get(baseline_key(kernel, impl, m.size))
        placement = self._placement(m, ref_t, opt_t, scale, confidence) if whole else {}
        row = SpeedupRow(
            kernel=kernel, impl=impl, size=m.size, label=m.label, device=self.settings.device,
            reference_ms=1e3 * median(ref_t), optimized_ms=1e3 * median(opt_t),
            speedup=point, low=low, high=high, rounds=(len(ref_t), len(opt_t)), interleaved=bool(m.paired),
            visits=m.visits, variant=m.variant, skipped=self.later.skipped.get((kernel, impl), 0),
            floor=self.floors.speed.get((kernel, impl)), floor_note=self.floors.notes.get((kernel, impl), ""),
            baseline=None if stored is None else stored[0], baseline_low=None if stored is None else stored[1],
            peer=m.peer or m.against != REFERENCE, contention=withheld(m.load) if whole else None,
            bandwidth=bandwidth_withheld(m.load, self.quiet_gbps) if whole else None,
            bound=scale * _bound(m, ref_t, opt_t, self.quiet_gbps, confidence) if whole else None,
            bound_low=scale * _bound_low(m, ref_t, opt_t, self.quiet_gbps, confidence) if whole else None,
            reference_peak_bytes=ref.peak_bytes, optimized_peak_bytes=m.peak_bytes,
            reference_gbps=_gbps(ref.work_bytes, ref_t), optimized_gbps=_gbps(m.work_bytes, opt_t),
            memory_floor=self.floors.memory.get((kernel, impl)),
            memory_baseline=self.stored.memory.get(baseline_key(kernel, impl, m.size)),
            confirmed=0 if again is None else m.again.stop - m.again.start,
            confirm_speedup=None if again is None else again[0], confirm_high=None if again is None else again[2],
            **placement,
        )
        gate(row, self.settings.tolerance, self.settings.contended)
        return row

    def _placement(self, m: Measurement, ref_t: list[float], opt_t: list[float], scale: float,
                   confidence: float) -> dict:
        """``m``'s pairs by the threads' placement and the core's pace read beside them
        (``SpeedupRow.apart``, ``slowed`` and the fields beside them); empty where neither was read."""
        wall = sum(p.wall for p in m.load)

        def share(flags: list[bool]) -> float:
            return sum(p.wall for p, f in zip(m.load, flags, strict=True) if f) / wall if wall > 0 else 0.0

        fields: dict = {}
        far = off = [False] * len(m.load)
        near, read = self.near_round_trip_ns, [p.round_trip_ns for p in m.load]
        if near is not None and all(r is not None for r in read):
            far = [apart(r, near) for r in read]
            placed = [r for r in read if r <= PARTNER_IDLE_NS]  # a partner that did not run is no placement
            fields.update(apart=share(far), round_trip_ns=max(placed, default=None), near_round_trip_ns=near)
        pace, paced = self.usual_pace_ns, [p.pace_ns for p in m.load]
        if pace is not None and all(r is not None for r in paced):
            off = [slowed(r, pace) for r in paced]
            fields.update(slowed=share(off), pace_ns=max(paced), usual_pace_ns=pace)
            if any(off):  # each pair's impl time less its pace shortfall: the most a slowed core explains
                relieved = [o * min(1.0, pace / r) for o, r in zip(opt_t, paced, strict=True)]
                point, _, high = speedup_interval(ref_t, relieved, confidence, paired=True)
                fields.update(pace_speedup=scale * point, pace_bound=scale * high)
        if not fields:
            return {}
        kept = [i for i, (f, o) in enumerate(zip(far, off, strict=True)) if not (f or o)]
        fields["near_pairs"] = len(kept)
        if len(kept) < len(m.load) and len(kept) >= MIN_PAIRS:
            point, low, high = speedup_interval([ref_t[i] for i in kept], [opt_t[i] for i in kept], confidence,
                                                paired=True)
            fields.update(near_speedup=scale * point, near_low=scale * low, near_high=scale * high)
        return fields

    def scan_pace(self, seconds: float = SCAN_S) -> None:
        """Read the fastest CPU's pace for ``seconds`` (``timing.Pace.scan``), where the session
        reads paces."""
        probe = None if self.probes.host is None else self.probes.host.pace
        scanned = None if probe is None else probe.scan(seconds)
        if scanned is not None:
            self.scans.append(scanned)

    def paces(self) -> list[float]:
        """Every pace reading of the session's pairs, ns."""
        return [p.pace_ns for impls in self.results.values() for m in impls.values() for p in m.load
                if p.pace_ns is not None]

    @property
    def usual_pace_ns(self) -> float | None:
        """The core's usual pace, the one a pair is judged slowed against: the fastest of the
        median of the sessions stored for this machine, the fastest CPU read at the session's start
        and end, and this session's own pairs' (``roofline.usual_pace``); None where none was read.
        Fixed once the later visits are timed (``usual_pace``)."""
        if self.usual_pace is not None:
            return self.usual_pace
        history = self.limits.pace_history if self.limits is not None else []
        return usual_pace(history, self.scans, self.paces())

    def round_trips(self) -> list[float]:
        """Every placement reading of the session's pairs, ns."""
        return [p.round_trip_ns for impls in self.results.values() for m in impls.values() for p in m.load
                if p.round_trip_ns is not None and p.round_trip_ns > 0]

    @property
    def near_round_trip_ns(self) -> float | None:
        """The round trip of the placement this machine usually gives torch's threads, the one a
        pair is judged near or apart against: the median of the sessions stored for it, else the
        least read this session (``roofline.usual_round_trip``); None where unread. Fixed once the
        later visits are timed (``usual``)."""
        if self.usual is not None:
            return self.usual
        history = self.limits.round_trip_history if self.limits is not None else []
        return usual_round_trip(history, self.round_trips())

    @property
    def quiet_gbps(self) -> float | None:
        """The host's quiet bandwidth: the streaming probe's 90th percentile this session (docs/gate.md,
        "A contended host", has what quiet and contended hosts read against it)."""
        readings = [p.gbps for impls in self.results.values() for m in impls.values() for p in m.load
                    if p.gbps is not None]
        return float(np.percentile(readings, 90)) if readings else None

    def memory_unmeasured(self) -> list[str]:
        """Rows with a memory floor but no peak from this platform: reported, not gated."""
        return [f"{r.kernel} [{r.impl}]" for r in self.compute_rows() if r.memory_floor is not None
                and (r.reference_peak_bytes is None or r.optimized_peak_bytes is None)]

    def unpaired(self) -> list[str]:
        return [k for k, impls in self.results.items() if REFERENCE not in impls or len(impls) < 2]


STATE = pytest.StashKey[GateState]()


def _unusual(row: SpeedupRow) -> bool:
    """``row``, not a peer's, had pairs timed with torch's threads apart or the core slowed and too
    few of the others to judge on (``SpeedupRow.near_speedup`` None): saved so, it would stand at
    the host's unusual state."""
    return not row.peer and bool(row.apart or row.slowed) and row.near_speedup is None


def _pair_seconds(m: Measurement, timer: Visits, cost: Callable[[float], float]) -> float:
    """Seconds one interleaved pair takes: each side's block is a warming call and its timed calls,
    each costing ``cost`` of its reading (the reading, and the L2 flush when on)."""
    ref_s, opt_s = (cost(median(t)) for t in zip(*m.paired, strict=True))
    return (timer.calls[0] + timer.warm[0]) * ref_s + (timer.calls[1] + timer.warm[1]) * opt_s


def _relieved(times: list[float], delays: list[float], load: list[PairLoad], calls: int,
              quiet_gbps: float | None) -> list[float]:
    """One side's block medians less what the host could have added to them: each pair's delay
    read around that side's timed calls (a block's median call moves only when at least half its
    ``calls`` do, so by at most delay / that many), times the probe's bandwidth share (a fully
    memory-bound call slows by no more than its bandwidth fell)."""
    moved = calls - calls // 2  # calls that must slow for a block's median (sorted[calls // 2]) to
    relieved = []
    for t, delay, pair in zip(times, delays, load, strict=True):
        share = 1.0 if pair.gbps is None or not quiet_gbps else min(1.0, pair.gbps / quiet_gbps)
        relieved.append((t - delay / moved) * share)
    return relieved


def _bound(m: Measurement, ref_t: list[float], opt_t: list[float], quiet_gbps: float | None,
           confidence: float) -> float:
    """The interval's high of ``m``'s speedup had everything the host withheld been the impl's
    (``_relieved``): the most a miss can owe the host. inf when the delay could explain the whole
    reading."""
    relieved = _relieved(opt_t, [p.delay for p in m.load], m.load, m.calls, quiet_gbps)
    if median(relieved) <= 0.0:
        return float("inf")
    high = speedup_interval(ref_t, [max(v, 1e-12) for v in relieved], confidence, paired=True)[2]
    return high if high < 1e6 else float("inf")  # a resample of relieved-to-nothing pairs: no bound


def _bound_low(m: Measurement, ref_t: list[float], opt_t: list[float], quiet_gbps: float | None,
               confidence: float) -> float:
    """The interval's low of ``m``'s speedup had everything the host withheld been the reference's
    (``_relieved``): the most a pass can owe the host, where the reference waited more than the
    impl (a loop of small parallel ops waits at each, a few large ones barely). 0 when the delay
    could explain the reference's whole reading."""
    relieved = _relieved(ref_t, [p.reference_delay for p in m.load], m.load, m.reference_calls, quiet_gbps)
    if median(relieved) <= 0.0:
        return 0.0
    return speedup_interval([max(v, 1e-12) for v in relieved], opt_t, confidence, paired=True)[1]


def _gbps(work_bytes: float | None, times: list[float]) -> float | None:
    """GB/s from the same rounds the row's times and speedup come from."""
    return None if not work_bytes else work_bytes / median(times) / 1e9


def baseline_key(kernel: str, impl: str, size: str) -> str:
    """Speedups compare only at the same size: smoke and full differ by design."""
    return f"{kernel}::{impl}::{size}"
