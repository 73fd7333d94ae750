"""The speedup statistic and the gate's rules.

speedup = median(reference rounds) / median(optimized rounds), both measured in the same run,
with a percentile-bootstrap interval. When the reference ran first in the session (the
convention: it is the first ``impl``), each impl is also timed interleaved with it, block by
block in ABBA order (a block: a warming call, then back-to-back calls, their median), and the
speedup comes from those pairs (resampled as pairs): both sides of a pair see the same host
state. Otherwise the two sides' own rounds are resampled
independently.
A floor is a claim, so the gate fails a row on evidence that the speedup is under it: the
whole interval under the floor. An interval above it passes; one that straddles it is not yet
evidence either way: the session times more interleaved pairs of that row (``GateState``, within
``--perf-extend`` seconds a row) and judges again, and a row still straddling at its budget is
reported ``unresolved``: neither failed nor silently passed (docs/gate.md has the rule's measured
fidelity). Against a stored baseline the gate fails a row when the speedup fell more than
``tolerance`` under the baseline's (the size of the drop: a practical threshold) and the whole
interval is under the baseline's interval (the drop is real, not a noisy round of either run):
asv's rule of a factor plus a significance test, on the speedup. A row whose speedup reads that
far under but whose interval still reaches the baseline's is measured further like a straddled
floor, and reported ``unresolved`` if it still does at its budget. Rows about a peer library (a
``speedup(over=)`` target, and ours timed against it) are reported beside the baseline but not
gated by it: a peer that got faster is not our regression, and ours stays gated by its rows over
the reference.

A failure is timed again before it stands: a row that misses its floor or its baseline gets a
second stretch of interleaved pairs at the session's end (``GateState.confirm``), and fails
unless those pairs alone reach the line and read above the interval of all the pairs. A kernel
that got slower misses in both stretches; a host state that slowed only one (a neighbour's phase
no probe reads) leaves the row unresolved, or passed where all its pairs together clear the floor.

A failure measured while the host withheld CPU time from the session (``SpeedupRow.contention``
at or above ``--perf-contended``: CPU time other processes took from our threads, plus the
hypervisor's steal, read by ``timing.HostLoad``) is reported ``unresolved`` instead: a 2-thread kernel whose second
CPU is taken loses far more than a single-threaded reference, so the ratio then measures the host.
A pass measured so stands only where it would with every withheld second charged to the reference
(``SpeedupRow.bound_low``): a reference of many small parallel ops waits for the CPUs at each of
them, a kernel of a few large ones barely, and that inflates the ratio as surely as the other way
deflates it.

Memory (``@pytest.mark.memory``): saved = 1 - optimized peak / reference peak, each peak the
median of three calls (CPU peaks move by allocator reuse and stray pages). Only rows that declare
a memory floor are gated: they fail when saved is under the floor, when the reference's peak was
0 (nothing to save: a wrong test), or, against a baseline, when saved fell more than
``tolerance`` under the baseline's saved fraction. Where the platform gives no peak the row is
reported unmeasured, not failed (as an unpaired row is).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np


def speedup_interval(
    reference: Sequence[float],
    optimized: Sequence[float],
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    paired: bool = False,
) -> tuple[float, float, float]:
    """(speedup, low, high): ratio of medians and its bootstrap interval, fixed seed. ``paired``:
    round i of both sides was timed together (interleaved), so pairs are resampled together, and
    the interval is widened to hold the sign test's for the pairs' median ratio (``sign_interval``):
    a percentile bootstrap on a few pairs covers less than its level says."""
    from scipy import stats

    ref = np.asarray(reference, dtype=np.float64)
    opt = np.asarray(optimized, dtype=np.float64)
    if ref.size < 2 or opt.size < 2:
        raise ValueError("a speedup interval needs at least 2 rounds on each side")

    def ratio(r: np.ndarray, o: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(r, axis=axis) / np.median(o, axis=axis)

    point = float(ratio(ref, opt))
    if paired and ref.size != opt.size:
        raise ValueError(f"paired rounds need equal counts, got {ref.size} and {opt.size}")
    res = stats.bootstrap(
        (ref, opt), ratio, n_resamples=n_resamples, confidence_level=confidence, paired=paired,
        method="percentile", vectorized=True, rng=np.random.default_rng(seed),
    )
    low, high = res.confidence_interval
    if paired:
        sign_low, sign_high = sign_interval(ref / opt, confidence)
        low, high = min(low, sign_low), max(high, sign_high)
    return point, float(low), float(high)


def sign_interval(ratios: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The distribution-free interval of the median of ``ratios`` (one per interleaved pair): its
    k-th lowest and k-th highest, k the most the binomial tail at 1/2 allows on each side. Where
    ``confidence`` asks more than the fewest pairs can give ((1 - confidence) / 2 under 1 / 2**n:
    under 6 pairs at 95%, under 8 at 99%), nothing bounds it: (0, inf)."""
    from scipy import stats

    r = np.sort(np.asarray(ratios, dtype=np.float64))
    n, tail = r.size, (1.0 - confidence) / 2.0
    # the largest k with P(Binomial(n, 1/2) < k) <= tail: the median lies in [r_k, r_(n+1-k)]
    k = int(np.searchsorted(stats.binom.cdf(np.arange(n), n, 0.5), tail, side="right"))
    return (float(r[k - 1]), float(r[n - k])) if k >= 1 else (0.0, math.inf)


def unit_components(d: np.ndarray, units: np.ndarray) -> tuple[float, float]:
    """(between, within): the one-way ANOVA variance components of ``d`` by ``units``, the units'
    own offsets' (0 when they differ no more than their members do) and their members' around
    them. Needs at least 2 units and more members than units."""
    _, index, counts = np.unique(units, return_inverse=True, return_counts=True)
    n = d.size
    means = np.bincount(index, weights=d) / counts
    between = float(np.sum(counts * (means - d.mean()) ** 2) / (counts.size - 1))
    within = float(np.sum((d - means[index]) ** 2) / max(1, n - counts.size))
    n0 = (n - np.sum(counts ** 2) / n) / (counts.size - 1)
    return max(0.0, (between - within) / n0), within


def _unit_variance(d: np.ndarray, units: np.ndarray) -> float:
    """The variance that ``units``' own offsets add to the mean of ``d``: their variance component
    (``unit_components``), times sum(n_a^2) / N^2. One unit, or a unit per pair, leaves nothing to
    separate: the pairs' own interval counts it."""
    counts = np.unique(units, return_counts=True)[1]
    if counts.size < 2 or counts.size == d.size:
        return 0.0
    return unit_components(d, units)[0] * float(np.sum(counts ** 2)) / d.size ** 2


# a statistic of interleaved pairs: (rev, this, confidence) -> (point, low, high)
Interval = Callable[[Sequence[float], Sequence[float], float], tuple[float, float, float]]


def pair_ratio_interval(rev: Sequence[float], this: Sequence[float],
                        confidence: float = 0.95) -> tuple[float, float, float]:
    """(ratio, low, high): the median of the pairs' ratios rev[i] / this[i] (pair i's two blocks
    timed back to back, so they share the host's state) and the sign test's interval of it
    (``sign_interval``): distribution-free, its coverage at least ``confidence`` on any number of
    pairs. Under 6 pairs at 95% it is unbounded, (0, inf)."""
    r, t = np.asarray(rev, dtype=np.float64), np.asarray(this, dtype=np.float64)
    if r.size != t.size or r.size < 1:
        raise ValueError(f"pairs need equal, nonzero counts, got {r.size} and {t.size}")
    ratios = r / t
    low, high = sign_interval(ratios, confidence)
    # the median in log space (of an even count, the two middle ratios' geometric mean), held
    # within the interval that tied ratios' rounding could otherwise put it a step outside
    return min(max(float(np.exp(np.median(np.log(ratios)))), low), high), low, high


def clustered_interval(rev: Sequence[float], this: Sequence[float], rev_units: Sequence[int],
                       this_units: Sequence[int], confidence: float = 0.95,
                       base: Interval | None = None) -> tuple[float, float, float]:
    """(ratio, low, high): ``pair_ratio_interval`` (or ``base(rev, this, confidence)``, another
    statistic of the pairs, given the same widening) over interleaved pairs, pair i's blocks timed
    on units ``rev_units[i]`` and ``this_units[i]`` (a worker process and a copy of the row's inputs
    in it). The sign test's interval counts the noise of pairs; each side's units add their own
    offsets (a process's state, an allocation's layout), which it would read as signal. Their
    variance components (log scale, one-way ANOVA on the pairs' log ratios by unit) widen the
    interval, at Student's t with their Welch-Satterthwaite degrees of freedom (each side's
    units - 1, pooled by the size of its component)."""
    from scipy import stats

    r, t = np.asarray(rev, dtype=np.float64), np.asarray(this, dtype=np.float64)
    u, v = np.asarray(rev_units), np.asarray(this_units)
    if not r.size == t.size == u.size == v.size:
        raise ValueError(f"clustered pairs need equal counts, got {r.size}, {t.size}, {u.size}, {v.size}")
    point, low, high = (base or pair_ratio_interval)(r, t, confidence)
    d = np.log(r) - np.log(t)
    parts = [(_unit_variance(d, units), np.unique(units).size - 1) for units in (u, v)]
    extra = sum(var for var, _ in parts)
    if extra > 0.0:  # a nonzero component has at least 2 units, so df >= 1
        df = extra ** 2 / sum(var ** 2 / k for var, k in parts if var > 0.0)
        extra *= float(stats.t.ppf(0.5 + confidence / 2.0, df)) ** 2
    if low > 0.0:  # 0 and inf: too few pairs for any bound (sign_interval), nothing to widen
        low = point * math.exp(-math.sqrt(math.log(point / low) ** 2 + extra))
    if math.isfinite(high):
        high = point * math.exp(math.sqrt(math.log(high / point) ** 2 + extra))
    return point, low, high


@dataclass
class SpeedupRow:
    """One optimized variant against its reference, measured in one session."""

    kernel: str
    impl: str
    size: str
    label: str
    device: str
    reference_ms: float
    optimized_ms: float
    speedup: float
    low: float
    high: float
    rounds: tuple[int, int]
    interleaved: bool = False  # the speedup comes from reference/impl rounds timed alternately
    visits: int = 1  # the interleaved rounds were timed in this many visits spread over the session
    variant: str | None = None  # what the impl chose at run time that a floor may be keyed to
    floor: float | None = None
    baseline: float | None = None
    baseline_low: float | None = None  # the stored baseline's interval's lower bound
    peer: bool = False  # about a peer library: the stored baseline is reported, not gated
    reference_peak_bytes: int | None = None
    optimized_peak_bytes: int | None = None
    reference_gbps: float | None = None
    optimized_gbps: float | None = None
    optimized_gflops: float | None = None
    # the impl's least time (roofline.Limits.figure: counted bytes at the stream bandwidth, the
    # written ones at the write rate, FLOPs at the GEMM peak) over its median: 1.0 is the
    # machine's limit; and which term bounds it
    roofline: float | None = None
    roofline_bound: str | None = None  # "memory", "write" or "compute"
    memory_floor: float | None = None  # least fraction of the reference's peak memory saved
    memory_baseline: float | None = None  # the baseline's optimized/reference peak ratio
    floor_note: str = ""  # why no floor applies to this row where the test declares one
    extended: int = 0  # interleaved pairs added at the session's end to resolve a straddled floor or baseline
    # extended only because it is saved as a baseline and was too wide (imprecise) or had too few
    # pairs timed as the host usually runs (state._unusual)
    tightened: bool = False
    skipped: int = 0  # later interleaved pairs not timed: the row was decided before them (GateState.revisit)
    contention: float | None = None  # share of CPU time the host withheld during its pairs (None: unread)
    bandwidth: float | None = None  # share of the streaming probe's bandwidth withheld during its pairs
    # the interval's high had every second of CPU withheld, and the probe's shortfall, been the
    # impl's: the most speedup the host's contention can explain (None: nothing withheld was read)
    bound: float | None = None
    # the interval's low had all of it been the reference's instead: the least speedup the host's
    # contention can explain, what a pass on a contended host must still clear (None: unread)
    bound_low: float | None = None
    # the share of its pairs (by wall time) timed while the host ran torch's threads apart
    # (timing.RoundTrip: a round trip over APART x the machine's usual placement), the farthest reading,
    # the usual one; and the speedup and interval of its pairs timed near (None: fewer than a verdict needs)
    apart: float | None = None
    round_trip_ns: float | None = None
    near_round_trip_ns: float | None = None
    # the share of its pairs (by wall time) timed while the host ran the timing thread's core slowed
    # (timing.Pace: a reading over PACE_SLOWED x the machine's usual pace), the slowest reading, the
    # usual one. "near" pairs below are those timed neither apart nor slowed.
    slowed: float | None = None
    pace_ns: float | None = None
    usual_pace_ns: float | None = None
    # the speedup and the interval's high had each pair's whole pace shortfall (its reading over the
    # usual) been the impl's time: the most the slowed core can explain (None: no pair slowed)
    pace_speedup: float | None = None
    pace_bound: float | None = None
    near_pairs: int = 0
    near_speedup: float | None = None
    near_low: float | None = None
    near_high: float | None = None
    # a failure is timed again at the session's end before it stands (GateState.confirm): that
    # stretch's interleaved pairs, and its own speedup and interval's high (None: not timed again)
    confirmed: int = 0
    confirm_speedup: float | None = None
    confirm_high: float | None = None
    # --perf-against's outcome for this impl in the same session ("ok", "faster", "FAIL", ...; None:
    # not compared): a row that comparison did not show slower is not failed by a stored baseline's drop
    against: str | None = None
    failures: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # lines the interval still straddles, failures unjudged

    @property
    def outcome(self) -> str:
        """``FAIL`` (evidence against a floor or the baseline), ``unresolved`` (an interval that
        straddles a floor at the end of its budget) or ``ok``."""
        return "FAIL" if self.failures else "unresolved" if self.unresolved else "ok"

    @property
    def straddles_floor(self) -> bool:
        """The interval reaches both sides of the floor: more pairs may resolve it."""
        return self.floor is not None and self.low < self.floor <= self.high

    @property
    def memory_ratio(self) -> float | None:
        """optimized peak / reference peak, None where either is unmeasured or the reference's is 0."""
        ref, opt = self.reference_peak_bytes, self.optimized_peak_bytes
        return None if ref is None or opt is None or ref <= 0 else opt / ref

    @property
    def key(self) -> str:
        return f"{self.kernel}::{self.impl}"

    def as_dict(self) -> dict:
        return {**asdict(self), "memory_ratio": self.memory_ratio, "outcome": self.outcome}


# The share of CPU time withheld from the session (timing.HostLoad), and of the streaming probe's
# bandwidth (timing.Bandwidth) under the session's quiet figure, at which a row's speedup no longer
# judges the kernel: each between what quiet and contended hosts read (docs/gate.md, "A contended host").
CONTENDED = 0.05
BANDWIDTH_CONTENDED = 0.4
# A stretch of pairs whose threads' round trip (timing.RoundTrip) read over this many times the
# machine's usual placement ran with the threads apart: two modes 6x apart on the Zen 4 (docs/gate.md,
# "The threads' placement").
APART = 2.0
# A reading over this is no placement: no two cores take 2 us to pass a cache line (two dies took
# 0.34 us at most), a partner thread that is not running does (a scheduler slice is milliseconds: a
# pool of our own or a neighbour held its CPU, which the CPU-time reading judges). Such a pair is
# judged as any other, so a kernel that leaves a spinning pool behind cannot excuse its own miss.
PARTNER_IDLE_NS = 2000.0


# A pair whose core's pace (timing.Pace) read over this many times the machine's usual pace ran
# slowed: two modes 1.3x apart on the Xeon 207 (docs/gate.md, "The core's pace").
PACE_SLOWED = 1.15


def slowed(pace_ns: float | None, usual: float) -> bool:
    """A pace reading (timing.Pace) of a core the host ran slowed: over PACE_SLOWED x the usual."""
    return pace_ns is not None and pace_ns > PACE_SLOWED * usual


def apart(round_trip_ns: float | None, usual: float) -> bool:
    """A placement reading (timing.RoundTrip) of torch's threads apart: over APART x the machine's
    usual placement, and not a partner that was not running (PARTNER_IDLE_NS)."""
    return round_trip_ns is not None and APART * usual < round_trip_ns <= PARTNER_IDLE_NS


def _base_low(row: SpeedupRow) -> float:
    """The stored baseline's interval's lower bound (its point where it has no interval)."""
    return row.baseline if row.baseline_low is None else min(row.baseline_low, row.baseline)


def _base_line(row: SpeedupRow, tolerance: float) -> float:
    """The line a row's speedup is judged against its stored baseline at: ``tolerance`` under the
    baseline, or its interval's lower bound where that is lower."""
    return min((1.0 - tolerance) * row.baseline, _base_low(row))


def _host_busy(row: SpeedupRow, contended: float) -> str:
    """Why ``row``'s pairs ran on a contended host ("" when they did not)."""
    why = []
    if row.contention is not None and row.contention >= contended:
        why.append(f"the host withheld {row.contention:.0%} of the CPU time while its pairs ran (other "
                   "processes or the hypervisor's steal)")
    # scaled with --perf-contended, multiplied out: 0.4 x 0.05 / 0.05 reads 0.4000000000000001
    if row.bandwidth is not None and row.bandwidth * CONTENDED >= BANDWIDTH_CONTENDED * contended:
        why.append(f"a streaming probe beside its pairs read {row.bandwidth:.0%} under the session's quiet "
                   "bandwidth (a neighbour taking memory bandwidth)")
    return " and ".join(why)


def gate(row: SpeedupRow, tolerance: float, contended: float = CONTENDED) -> list[str]:
    """The reasons ``row`` fails the gate (empty when it passes); also stored on the row, with
    ``row.unresolved`` saying which line its interval still straddles, or which failure the
    host's contention (``row.contention`` at or above ``contended``, or ``row.bandwidth`` at or
    above ``BANDWIDTH_CONTENDED``, scaled alike) or a second stretch of pairs left unjudged."""
    pairs = f"{row.rounds[0]} interleaved pairs" if row.interleaved else f"{row.rounds[0]}/{row.rounds[1]} rounds"
    said = (f"{row.kernel} [{row.impl}, {row.label or row.size}] on {row.device}",
            f"speedup {row.speedup:.2f}x (95% CI {row.low:.2f}-{row.high:.2f}x, {pairs})")
    where, measured = said
    row.unresolved = []
    if not all(math.isfinite(v) and v > 0 for v in (row.reference_ms, row.optimized_ms, row.speedup)):
        row.failures = [f"{where}: {measured} from times {row.reference_ms} and {row.optimized_ms} ms: a speedup "
                        "must come from finite times > 0 (a timer or a declared work_bytes gave none)"]
        return row.failures
    under_floor, under_baseline, explained = _judged_misses(row, tolerance, contended, said)
    failures = []
    if under_floor:
        failures.append(f"{where}: {measured} is under the floor {row.floor:.2f}x (the whole interval is)"
                        f"{explained}")
    elif row.straddles_floor and not row.unresolved:
        row.unresolved.append(f"{where}: {measured} straddles the floor {row.floor:.2f}x: neither met nor "
                              "missed on this evidence")
    if straddles_baseline(row, tolerance):
        row.unresolved.append(f"{where}: {measured} reads more than {tolerance:.0%} under the stored "
                              f"baseline's {row.baseline:.2f}x, but its interval reaches the baseline's "
                              f"({_base_low(row):.2f}x and up): neither met nor missed on this evidence")
    if under_baseline and row.against in ("ok", "faster", "unresolved"):
        shown = ("shows it no slower than REV" if row.against != "unresolved"
                 else "could not tell it slower than REV")
        row.unresolved.append(
            f"{where}: {measured} fell more than {tolerance:.0%} under the stored baseline's {row.baseline:.2f}x, "
            f"but this session's comparison with REV {shown}: the drop is the host's between the two sessions, "
            "or came before REV (--perf-against the baseline's commit tells which)")
    elif under_baseline:
        failures.append(
            f"{where}: {measured} fell more than {tolerance:.0%} under the stored baseline's "
            f"{row.baseline:.2f}x (under {(1.0 - tolerance) * row.baseline:.2f}x, and the whole interval under "
            f"the baseline's, {_base_low(row):.2f}x and up){explained}"
        )
    _judge_passes(row, tolerance, contended, said)
    row.failures = failures + _memory_failures(row, tolerance, where)
    return row.failures


def _judged_misses(row: SpeedupRow, tolerance: float, contended: float,
                   said: tuple[str, str]) -> tuple[bool, bool, str]:
    """Whether ``row``'s miss of its floor and of its stored baseline stand, and what to add to
    their failures. A miss measured while the host withheld CPU time or bandwidth is evidence about
    the host, not the kernel, up to what the withheld time could explain: one that stands even at
    ``row.bound`` (every withheld second and the probe's shortfall charged to the impl) stands. A
    miss also stands unless the pairs timed again at the session's end reach the line and read
    above the interval of all the pairs (the two stretches disagree: a host state that slowed one
    and not the other); one noisy pair in a stretch that reads as the rest did is no such
    disagreement. A miss measured while the host ran torch's threads apart for some of the pairs
    (``row.apart``), or the timing thread's core slowed (``row.slowed``), is judged on the pairs
    timed with the threads near and the core at its usual pace alone, and left unjudged where too
    few were. A miss left unjudged is noted in ``row.unresolved``."""
    (where, measured), no_verdict = said, "so this is no verdict on the kernel"
    busy = _host_busy(row, contended)
    bound = float("inf") if row.bound is None else row.bound
    at_most = "any speedup" if bound == float("inf") else f"{bound:.2f}x at most"
    line = None if row.baseline is None else _base_line(row, tolerance)
    under_floor, under_baseline = misses(row, tolerance)
    placed, judged = "", row
    if (row.apart or row.slowed) and (under_floor or under_baseline) and math.isfinite(contended):  # inf: all
        host, timed, whose = _off_usual(row)
        # too few pairs timed as usual: a miss on a slowed core (threads near) that stands even with
        # each pair's pace shortfall charged to the impl is no state of the core's
        charged = None if row.apart or row.pace_bound is None else \
            replace(row, speedup=row.pace_speedup, high=row.pace_bound)
        if row.near_speedup is None:  # each line the charge does not clear stands; the others are unjudged
            floor_stands, baseline_stands = (False, False) if charged is None else misses(charged, tolerance)
            stands = {"floor": under_floor and floor_stands, "stored baseline": under_baseline and baseline_stands}
            unjudged = [w for w, m in (("floor", under_floor), ("stored baseline", under_baseline))
                        if m and not stands[w]]
            if unjudged:
                row.unresolved.append(f"{where}: {measured} is under its {' and '.join(unjudged)}: {host}, too "
                                      f"few timed {timed} to judge ({row.near_pairs}), {no_verdict}")
            if not any(stands.values()):
                return False, False, ""
            placed = f"; {host}, and with each pair's slowdown charged to it, it reads {row.pace_speedup:.2f}x " \
                     f"(up to {row.pace_bound:.2f}x)"
            under_floor, under_baseline, judged = stands["floor"], stands["stored baseline"], charged
        else:  # judged on the pairs timed as the host usually runs: a kernel that is slower misses there too
            near = replace(row, speedup=row.near_speedup, low=row.near_low, high=row.near_high)
            placed = f"; {host}, and its {row.near_pairs} pairs timed {timed} read {row.near_speedup:.2f}x " \
                     f"(95% CI {row.near_low:.2f}-{row.near_high:.2f}x)"
            near_floor, near_baseline = misses(near, tolerance)
            for what, missed, stands in (("floor", under_floor, near_floor),
                                         ("stored baseline", under_baseline, near_baseline)):
                if missed and not stands:
                    row.unresolved.append(f"{where}: {measured} is under its {what}, but {placed[2:]}: the miss "
                                          f"is {whose}, {no_verdict}")
            under_floor, under_baseline, judged = near_floor, near_baseline, near
    excused_floor = busy and under_floor and bound >= row.floor
    excused_baseline = busy and under_baseline and bound >= line
    if excused_floor or excused_baseline:
        what = "floor" if excused_floor else "stored baseline"
        row.unresolved.append(f"{where}: {measured} is under its {what}: {busy}, {no_verdict} (charged all to "
                              f"it: {at_most})")
        under_floor, under_baseline = under_floor and not excused_floor, under_baseline and not excused_baseline
    again = ""
    if row.confirm_high is not None and (under_floor or under_baseline):
        again = f"{row.confirmed} pairs timed again at the session's end read {row.confirm_speedup:.2f}x " \
                f"(up to {row.confirm_high:.2f}x)"
        changed = row.confirm_speedup > judged.high
        if under_floor and changed and row.confirm_high >= row.floor:
            row.unresolved.append(f"{where}: {measured} is under its floor {row.floor:.2f}x, but {again}: the "
                                  f"host changed between the two, {no_verdict}")
            under_floor = False
        if under_baseline and changed and (row.confirm_high >= _base_low(row)
                                           or row.confirm_speedup >= (1.0 - tolerance) * row.baseline):
            row.unresolved.append(f"{where}: {measured} is under its stored baseline, but {again}: the host "
                                  f"changed between the two, {no_verdict}")
            under_baseline = False
    explained = (f", even had all the host withheld ({busy}) been its time: {at_most}" if busy else "") \
        + (placed if under_floor or under_baseline else "") + (f"; {again}" if again else "")
    return under_floor, under_baseline, explained


def _off_usual(row: SpeedupRow) -> tuple[str, str, str]:
    """How the host ran ``row``'s pairs off its usual state, in words: what it did, how the pairs
    kept were timed, and whose the miss would be ("the placement's", "the core's pace's")."""
    said, timed, whose = [], [], []
    if row.apart:
        said.append(f"the host ran torch's threads {row.round_trip_ns:.0f} ns apart (a cache-line round trip; "
                    f"{row.near_round_trip_ns:.0f} ns at this machine's usual placement) for {row.apart:.0%} of "
                    "its pairs")
        timed.append("near")
        whose.append("the placement's")
    if row.slowed:
        said.append(f"the host ran the timing thread's core slowed (a pace probe of {row.pace_ns / 1e3:.0f} us; "
                    f"{row.usual_pace_ns / 1e3:.0f} us at this machine's usual pace) for {row.slowed:.0%} of its "
                    "pairs")
        timed.append("at the usual pace")
        whose.append("the core's pace's")
    return " and ".join(said), " and ".join(timed), " or ".join(whose)


def _judge_passes(row: SpeedupRow, tolerance: float, contended: float, said: tuple[str, str]) -> None:
    """Note in ``row.unresolved`` a floor or stored baseline ``row`` meets on a contended host that
    it would not meet with every withheld second charged to the reference (``row.bound_low`` under
    the line): the host may have slowed the reference more than the kernel, so the pass is no
    verdict either. A met line the contention cannot explain away passes."""
    busy = _host_busy(row, contended)
    if not busy or row.bound_low is None:
        return
    where, measured = said
    lines = []
    if row.floor is not None and row.low >= row.floor:
        lines.append((f"floor {row.floor:.2f}x", row.floor))
    gated = row.baseline is not None and not row.peer
    if gated and row.speedup >= (1.0 - tolerance) * row.baseline:
        lines.append(("stored baseline's threshold", _base_line(row, tolerance)))
    for what, line in lines:
        if row.bound_low < line:
            row.unresolved.append(f"{where}: {measured} meets its {what}, but {busy}: charged all to the "
                                  f"reference, it reads {row.bound_low:.2f}x at least, so this is no verdict "
                                  "on the kernel")


def _memory_failures(row: SpeedupRow, tolerance: float, where: str) -> list[str]:
    """Why ``row`` fails its memory floor or its stored baseline's memory saving (none: passes)."""
    ratio = row.memory_ratio
    if row.memory_floor is not None and row.reference_peak_bytes == 0:
        return [f"{where}: the reference's peak memory measured 0 bytes: nothing to save, check the test"]
    if row.memory_floor is None or ratio is None:
        return []
    saved, failures = 1.0 - ratio, []
    if saved < row.memory_floor:
        failures.append(f"{where}: saved {saved:.1%} of the reference's peak memory "
                        f"({_mem(row.reference_peak_bytes)} -> {_mem(row.optimized_peak_bytes)} MiB), "
                        f"under the floor {row.memory_floor:.0%}")
    stored = None if row.memory_baseline is None or row.peer else 1.0 - row.memory_baseline
    # the tolerance is a share of the baseline's magnitude: it loosens a negative saving (more memory) too
    if stored is not None and saved < stored - tolerance * abs(stored):
        failures.append(f"{where}: saved {saved:.1%} of the reference's peak memory, more than "
                        f"{tolerance:.0%} under the stored baseline's {stored:.1%}")
    return failures


def straddles_baseline(row: SpeedupRow, tolerance: float) -> bool:
    """``row``'s speedup reads more than ``tolerance`` under its gated stored baseline, but its
    interval still reaches the baseline's: a miss on its point that more pairs may confirm or clear."""
    gated = row.baseline is not None and not row.peer
    return gated and row.speedup < (1.0 - tolerance) * row.baseline and row.high >= _base_low(row)


def straddles(row: SpeedupRow, tolerance: float) -> bool:
    """``row``'s interval reaches both sides of a line it may fail: its floor or its stored baseline's."""
    return row.straddles_floor or straddles_baseline(row, tolerance)


def misses(row: SpeedupRow, tolerance: float) -> tuple[bool, bool]:
    """Whether ``row``'s speedup is under its floor (the whole interval is) and under its gated
    stored baseline (more than ``tolerance`` under it, the whole interval under the baseline's)."""
    gated = row.baseline is not None and not row.peer
    under_floor = row.floor is not None and row.high < row.floor
    under_baseline = gated and row.speedup < (1.0 - tolerance) * row.baseline and row.high < _base_low(row)
    return under_floor, under_baseline


def imprecise(row: SpeedupRow, tolerance: float) -> bool:
    """``row``, saved as a stored baseline, is too wide to judge a later run's drop of
    ``tolerance`` against: its interval reaches past ``tolerance / 2`` of its speedup on either
    side. Such a baseline's point may sit far from the machine's level (a 1.5x slower kernel then
    reads less than ``tolerance`` under it), and its low bound far under it (the rule asks a drop's
    whole interval to clear it). A peer's row is not gated by a baseline: never imprecise."""
    return not row.peer and not _within_half(row.speedup, row.low, row.high, tolerance)


def loose_baseline(row: SpeedupRow, tolerance: float) -> bool:
    """``row``'s stored baseline gates it but was saved ``imprecise`` on its low side (its interval
    reaches past ``tolerance / 2`` under its speedup): a drop must clear that low to fail."""
    return row.baseline is not None and row.baseline_low is not None and not row.peer and \
        not _within_half(row.baseline, row.baseline_low, None, tolerance)


def _within_half(point: float, low: float, high: float | None, tolerance: float) -> bool:
    """The interval [low, high] (high None: unbounded above) lies within ``tolerance / 2`` of ``point``."""
    half = tolerance / 2.0
    return (1.0 - half) * point <= low and (high is None or high <= (1.0 + half) * point)


def decided(row: SpeedupRow, tolerance: float, saving: bool = False) -> bool:
    """More pairs would not change ``row``'s verdict (``row`` gated on a wider interval than the
    final verdict's, ``state.EARLY``): no floor or gated baseline applies to it, or each that does
    is cleared, met (its interval above the floor, above the baseline's threshold) or missed (the
    whole interval under it, on a quiet host). A straddled floor, a baseline the interval still
    reaches, or a failure left unjudged on a contended host (it may quiet down) is undecided. The
    caller asks only of a row on enough pairs to fail (``state.MIN_PAIRS``). In a session that
    ``saving`` a baseline, a row the baseline will gate is undecided while ``imprecise``."""
    if row.unresolved or (saving and imprecise(row, tolerance)):
        return False
    if row.baseline is not None and not row.peer and not row.failures:
        return row.low >= _base_line(row, tolerance)
    return True


def verdict(rows: Sequence[SpeedupRow], what: str, budget: str,
            missed: Sequence[str] = ()) -> list[tuple[str, str]]:
    """The session's closing lines as (style, text), style one of note, warn, fail, pass: each
    extension, each unresolved floor, each failure, then the verdict. ``what`` says what the
    passed rows were held to ("at or above their floors"); ``budget`` how far a straddled row
    could be extended ("--perf-extend 60 s"); ``missed``: declared floors no row checked that fail
    the session (``--perf-require-floors``), each a failure."""
    lines = []
    for r in rows:
        if r.confirmed:
            lines.append(("note", f"timed again: {r.kernel} [{r.impl}] +{r.confirmed} interleaved pairs at the "
                                  f"session's end, its first pairs missed: these read {r.confirm_speedup:.2f}x "
                                  f"(up to {r.confirm_high:.2f}x); all {r.rounds[0]}: {r.speedup:.2f}x (95% CI "
                                  f"{r.low:.2f}-{r.high:.2f}x), {r.outcome}"))
        if r.extended:
            now = f"now {r.speedup:.2f}x (95% CI {r.low:.2f}-{r.high:.2f}x), {r.outcome}"
            lines_of = ([f"the floor {r.floor:.2f}x"] if r.floor is not None else []) + \
                ([f"the stored baseline's {r.baseline:.2f}x"] if r.baseline is not None and not r.peer else [])
            why = f"its interval straddled {' or '.join(lines_of)}"
            if r.tightened:
                why = "its interval was wider than a saved baseline may be" + (
                    ", or too few of its pairs were timed as the host usually runs" if r.apart or r.slowed else "")
            lines.append(("note", f"extended: {r.kernel} [{r.impl}] +{r.extended} interleaved pairs at the "
                                  f"session's end, {why}: {now}"))
    for r in rows:
        for u in r.unresolved:
            how = (f"after +{r.extended} pairs" if r.extended else "not extended") + f" ({budget})"
            lines.append(("warn", f"UNRESOLVED: {u}; {how}: neither failed nor passed; rerun, or run on a quieter "
                                  "host"))
    failures = [f for r in rows for f in r.failures] + list(missed)
    lines += [("fail", f"GATE FAILED: {f}") for f in failures]
    if failures or not rows:
        return lines
    unresolved = sum(r.outcome == "unresolved" for r in rows)
    if unresolved:
        lines.append(("warn", f"gate not failed: {len(rows) - unresolved} speedup(s) {what}, {unresolved} "
                              "unresolved (an interval that straddles its floor, a contended host, or threads "
                              "placed apart)"))
    else:
        lines.append(("pass", f"gate passed: {len(rows)} speedup(s) {what}"))
    return lines


def row_from_dict(r: dict) -> SpeedupRow:
    """A row read back from JSON (``SpeedupRow.as_dict()``), its verdict not yet computed."""
    names = {f.name for f in fields(SpeedupRow)} - {"failures", "unresolved"}
    return SpeedupRow(**{k: (tuple(v) if k == "rounds" else v) for k, v in r.items() if k in names})


def _mem(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _saved(ratio: float | None, floor: float | None) -> str:
    cell = "-" if ratio is None else f"{1 - ratio:.0%}"
    return cell if floor is None else f"{cell} (>={floor:.0%})"


def _gb(ref: float | None, opt: float | None) -> str:
    return "-" if ref is None and opt is None else "/".join("-" if v is None else f"{v:.1f}" for v in (ref, opt))


def roofline_cell(fraction: float | None, bound: str | None) -> str:
    """"38% mem": the share of the machine's limit reached, and which limit binds ("mem": the
    bytes at the stream bandwidth, "write": the bytes written at the write rate, "flop")."""
    return "-" if fraction is None else f"{fraction:.0%} {_BOUNDS.get(bound, 'flop')}"


_BOUNDS = {"memory": "mem", "write": "write", "compute": "flop"}


def _outcome(r: dict) -> str:
    cell = "FAIL" if r["failures"] else "unresolved" if r.get("unresolved") else "ok"
    return f"{cell} (+{r['extended']} pairs)" if r.get("extended") else cell


def _baseline_cell(r: dict) -> str:
    if r["baseline"] is None:
        return "-"
    return f"{r['baseline']:.2f}x" + (" (peer, not gated)" if r.get("peer") else "")


def _floor_cell(r: dict) -> str:
    if r["floor"] is not None:
        return f"{r['floor']:.2f}x"
    return f"- ({r['floor_note']})" if r.get("floor_note") else "-"


TABLE_HEADER = ("kernel", "impl", "size", "device", "ref ms", "opt ms", "speedup", "95% CI",
              "floor", "baseline", "peak MiB ref/opt", "mem saved", "GB/s ref/opt", "GFLOP/s opt", "roofline opt",
              "gate")


def table_cells(rows: Sequence[dict]) -> list[tuple[str, ...]]:
    """Rows (``SpeedupRow.as_dict()``) as the cells of ``TABLE_HEADER``."""
    body = []
    for r in rows:
        body.append((
            r["kernel"], r["impl"], r["label"] or r["size"], r["device"],
            f"{r['reference_ms']:.3f}", f"{r['optimized_ms']:.3f}", f"{r['speedup']:.2f}x",
            f"{r['low']:.2f}-{r['high']:.2f}",
            _floor_cell(r),
            _baseline_cell(r),
            f"{_mem(r['reference_peak_bytes'])}/{_mem(r['optimized_peak_bytes'])}",
            _saved(r.get("memory_ratio"), r.get("memory_floor")),
            _gb(r.get("reference_gbps"), r.get("optimized_gbps")),
            "-" if r.get("optimized_gflops") is None else f"{r['optimized_gflops']:.1f}",
            roofline_cell(r.get("roofline"), r.get("roofline_bound")),
            _outcome(r),
        ))
    return body


def format_table(rows: Sequence[dict]) -> list[str]:
    """Rows (``SpeedupRow.as_dict()``) as fixed-width text lines."""
    return fixed_width(TABLE_HEADER, table_cells(rows))


def fixed_width(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """A header, a rule and the rows, each column as wide as its widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*b) for b in body
    ]
