"""Per-session state of the gate: what was measured, the floors, the stored baseline."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

import pytest

from .stats import SpeedupRow, gate, speedup_interval
from .timing import Timed, interleaved

REFERENCE = "reference"


@dataclass
class Measurement:
    times: list[float]
    size: str
    label: str
    peak_bytes: int | None
    work_bytes: float | None = None  # bytes one call moves, when the test declares it
    paired: list[tuple[float, float]] | None = None  # (reference, this impl) rounds timed alternately
    visits: int = 1  # how many visits timed ``paired``


@dataclass
class Visits:
    """The interleaved rounds of one impl still to time, one entry of ``shares`` per later visit."""

    kernel: str
    impl: str
    reference: Timed
    timed: Timed
    calls: tuple[int, int]
    shares: list[int]


@dataclass
class GateState:
    device: str
    size: str
    threads: int
    tolerance: float
    fingerprint: dict
    slug: str
    results: dict[str, dict[str, Measurement]] = field(default_factory=dict)
    floors: dict[tuple[str, str], float] = field(default_factory=dict)
    memory_floors: dict[tuple[str, str], float] = field(default_factory=dict)  # least fraction saved
    baseline: dict[str, float] | None = None
    memory_baseline: dict[str, float] = field(default_factory=dict)  # optimized/reference peak ratios
    baseline_path: str | None = None
    rows: list[SpeedupRow] | None = None
    unmeasured: int = 0  # perf calls that ran with benchmarks disabled
    slowdown: float = 1.0  # TEST ONLY: --perf-slowdown, the optimized impls made this much slower
    references: dict = field(default_factory=dict)  # kernel -> (timed reference callable, its median s)
    cpu_floors_apply: bool = True  # False on CPU at a thread count other than torch's default
    visits: int = 3  # --perf-visits: each impl's interleaved rounds are timed in this many visits
    pending: list[Visits] = field(default_factory=list)  # the later visits, timed by revisit()

    def revisit(self) -> None:
        """Time every impl's later visits, in passes over all impls (visit 2 of each, then visit 3
        of each, ...), so each row's interleaved rounds sample host states apart in time, not only
        the one it happened to meet during its test. Then free the kept callables."""
        for v in range(max((len(p.shares) for p in self.pending), default=0)):
            for p in self.pending:
                if v < len(p.shares):
                    m = self.results[p.kernel][p.impl]
                    m.paired += interleaved(p.reference, p.timed, p.shares[v], p.calls, first_round=len(m.paired))
        self.pending.clear()
        self.references.clear()

    def compute_rows(self) -> list[SpeedupRow]:
        """Speedup rows for every impl measured beside its reference (computed once)."""
        if self.rows is not None:
            return self.rows
        self.revisit()
        rows = []
        for kernel, impls in self.results.items():
            ref = impls.get(REFERENCE)
            for impl, m in impls.items():
                if impl == REFERENCE or ref is None:
                    continue
                # With declared work on both sides the ratio is of throughput (bytes/s), e.g. a
                # kernel against the streaming bandwidth; with equal work it is the time ratio.
                scale = m.work_bytes / ref.work_bytes if ref.work_bytes and m.work_bytes else 1.0
                # interleaved pairs when the reference ran first in this session, else the two runs
                ref_t, opt_t = (list(t) for t in zip(*m.paired, strict=True)) if m.paired else (ref.times, m.times)
                point, low, high = (scale * v for v in speedup_interval(ref_t, opt_t, paired=bool(m.paired)))
                row = SpeedupRow(
                    kernel=kernel, impl=impl, size=m.size, label=m.label, device=self.device,
                    reference_ms=1e3 * median(ref_t), optimized_ms=1e3 * median(opt_t),
                    speedup=point, low=low, high=high, rounds=(len(ref_t), len(opt_t)), interleaved=bool(m.paired),
                    visits=m.visits,
                    floor=self.floors.get((kernel, impl)),
                    baseline=(self.baseline or {}).get(baseline_key(kernel, impl, m.size)),
                    reference_peak_bytes=ref.peak_bytes, optimized_peak_bytes=m.peak_bytes,
                    reference_gbps=_gbps(ref.work_bytes, ref_t), optimized_gbps=_gbps(m.work_bytes, opt_t),
                    memory_floor=self.memory_floors.get((kernel, impl)),
                    memory_baseline=self.memory_baseline.get(baseline_key(kernel, impl, m.size)),
                )
                gate(row, self.tolerance)
                rows.append(row)
        self.rows = rows
        return rows

    def memory_unmeasured(self) -> list[str]:
        """Rows with a memory floor but no peak from this platform: reported, not gated."""
        return [f"{r.kernel} [{r.impl}]" for r in self.compute_rows() if r.memory_floor is not None
                and (r.reference_peak_bytes is None or r.optimized_peak_bytes is None)]

    def unpaired(self) -> list[str]:
        return [k for k, impls in self.results.items() if REFERENCE not in impls or len(impls) < 2]


STATE = pytest.StashKey[GateState]()


def _gbps(work_bytes: float | None, times: list[float]) -> float | None:
    """GB/s from the same rounds the row's times and speedup come from."""
    return None if not work_bytes else work_bytes / median(times) / 1e9


def baseline_key(kernel: str, impl: str, size: str) -> str:
    """Speedups compare only at the same size: smoke and full differ by design."""
    return f"{kernel}::{impl}::{size}"
