"""perfgate pytest plugin (entry point ``pytest11``): speedup pairs on top of pytest-benchmark.

A perf test is parametrized over ``impl`` ("reference", "optimized", or ablation steps) and
times its callable through the ``perf`` fixture; all impls of one test land in one
pytest-benchmark group, so every ``--benchmark-*`` option works unchanged. At the end of the
session perfgate prints speedup = median(reference) / median(impl) with a bootstrap interval,
writes it into the benchmark JSON (key ``kernelgate``), and fails the session when a floor
declared with ``@pytest.mark.speedup(cpu=..., cuda=...)`` is not met, or, under
``--benchmark-compare``, when a speedup fell more than ``--speedup-tolerance`` under the
stored baseline's. Baselines are stored per machine fingerprint; comparing against another
fingerprint's baseline is refused.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import pytest

from .fingerprint import fingerprint, slug
from .stats import SpeedupRow, format_table, gate, speedup_interval
from .timing import peak_memory, resolve_device, synced

# Transparent huge pages for torch's CPU allocator, read once by torch at its first allocation,
# so set before anything imports torch (plugins load before tests). A user's explicit value wins.
# Measured on the 2-core CPU: page faults of fresh (B, P) per-sample-gradient tensors dominated
# (B=256: 42.8 -> 14.3 ms optimized, 89 -> 49 ms reference). Recorded in the fingerprint.
if "torch" not in sys.modules:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    THP_ALLOC = os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
else:  # torch already allocated under whatever the environment said then
    THP_ALLOC = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"

REFERENCE = "reference"
SIZES = ("smoke", "full")
MIN_ROUNDS = 5  # a bootstrap interval needs rounds to resample, whatever the options say
MAX_ROUNDS = 1000


@dataclass
class Measurement:
    times: list[float]
    size: str
    label: str
    peak_bytes: int | None


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
    baseline: dict[str, float] | None = None
    baseline_path: str | None = None
    rows: list[SpeedupRow] | None = None
    unmeasured: int = 0  # perf calls that ran with benchmarks disabled

    def compute_rows(self) -> list[SpeedupRow]:
        """Speedup rows for every impl measured beside its reference (computed once)."""
        if self.rows is not None:
            return self.rows
        rows = []
        for kernel, impls in self.results.items():
            ref = impls.get(REFERENCE)
            for impl, m in impls.items():
                if impl == REFERENCE or ref is None:
                    continue
                point, low, high = speedup_interval(ref.times, m.times)
                row = SpeedupRow(
                    kernel=kernel, impl=impl, size=m.size, label=m.label, device=self.device,
                    reference_ms=1e3 * median(ref.times), optimized_ms=1e3 * median(m.times),
                    speedup=point, low=low, high=high, rounds=(len(ref.times), len(m.times)),
                    floor=self.floors.get((kernel, impl)),
                    baseline=None if self.baseline is None else self.baseline.get(_key(kernel, impl, m.size)),
                    reference_peak_bytes=ref.peak_bytes, optimized_peak_bytes=m.peak_bytes,
                )
                gate(row, self.tolerance)
                rows.append(row)
        self.rows = rows
        return rows

    def unpaired(self) -> list[str]:
        return [k for k, impls in self.results.items() if REFERENCE not in impls or len(impls) < 2]


STATE = pytest.StashKey[GateState]()


def _key(kernel: str, impl: str, size: str) -> str:
    """Speedups compare only at the same size: smoke and full differ by design."""
    return f"{kernel}::{impl}::{size}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("perfgate", "kernelgate speedup gate")
    group.addoption("--device", default="auto", help="auto|cpu|cuda[:N] (auto: cuda when available)")
    group.addoption("--perf-size", default=None, choices=SIZES,
                    help="problem sizes: smoke (CI on CPU) or full (default: smoke on CPU, full on CUDA)")
    group.addoption("--speedup-tolerance", type=float, default=0.2,
                    help="with --benchmark-compare: fail when a speedup fell more than this "
                         "fraction under the stored baseline's (default 0.2)")
    group.addoption("--perf-threads", type=int, default=None,
                    help="torch CPU threads, fixed for the session (default: torch's default)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "speedup(cpu=None, cuda=None, impl='optimized'): speedup floor of impl over the "
        "reference per device class; a float, or a dict keyed by perf size",
    )
    import torch

    try:
        device = resolve_device(config.getoption("device"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    tolerance = config.getoption("speedup_tolerance")
    if not 0.0 <= tolerance < 1.0:
        raise pytest.UsageError(f"--speedup-tolerance must be in [0, 1), got {tolerance}")
    threads = config.getoption("perf_threads") or torch.get_num_threads()
    if threads < 1:
        raise pytest.UsageError(f"--perf-threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    size = config.getoption("perf_size") or ("full" if device.startswith("cuda") else "smoke")
    fp = fingerprint(device, threads, THP_ALLOC)
    state = GateState(device=device, size=size, threads=threads, tolerance=tolerance,
                      fingerprint=fp, slug=slug(fp))
    config.stash[STATE] = state
    # Baselines live in one folder per fingerprint (pytest-benchmark configures after us).
    storage = getattr(config.option, "benchmark_storage", None)
    if isinstance(storage, str) and (storage.startswith("file://") or "://" not in storage):
        path = storage.removeprefix("file://")
        if path == "./.benchmarks":
            path = str(config.rootpath / ".benchmarks")
        config.option.benchmark_storage = f"file://{path}/{state.slug}"


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash.get(STATE, None)
    if state is None:
        return None
    return f"perfgate: device={state.device} size={state.size} threads={state.threads} fingerprint={state.slug}"


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["kernelgate"] = config.stash[STATE].fingerprint


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(
    config: pytest.Config, benchmarksession: Any, machine_info: dict, compared_benchmark: dict
) -> None:
    state = config.stash[STATE]
    theirs = compared_benchmark.get("machine_info", {}).get("kernelgate")
    if theirs != state.fingerprint:
        raise pytest.UsageError(
            "perfgate refuses to compare against a baseline from another machine fingerprint:\n"
            f"  this machine: {state.fingerprint}\n  baseline:     {theirs}\n"
            "Speedups are only comparable on the same device, threads and torch build. Save a "
            "baseline here with `make baseline`, or compare against one saved on this fingerprint."
        )
    section = compared_benchmark.get("kernelgate", {})
    rows = section.get("speedups", [])
    state.baseline = {_key(r["kernel"], r["impl"], r["size"]): r["speedup"] for r in rows}
    state.baseline_path = str(benchmarksession.storage)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks: Any, output_json: dict) -> None:
    state = config.stash[STATE]
    output_json["kernelgate"] = {
        "fingerprint": state.fingerprint,
        "slug": state.slug,
        "size": state.size,
        "tolerance": state.tolerance,
        "speedups": [r.as_dict() for r in state.compute_rows()],
    }


def _floor(item: pytest.Item, impl: str, device: str, size: str) -> float | None:
    device_class = "cuda" if device.startswith("cuda") else "cpu"
    for mark in item.iter_markers("speedup"):
        if mark.args:
            raise pytest.UsageError(f"{item.nodeid}: speedup marker takes keywords cpu=, cuda=, impl=")
        if mark.kwargs.get("impl", "optimized") != impl:
            continue
        value = mark.kwargs.get(device_class)
        if isinstance(value, dict):
            value = value.get(size)
        return None if value is None else float(value)
    return None


class PerfCase:
    """What the ``perf`` fixture gives a test: its device, size, impl and the timing call."""

    def __init__(self, request: pytest.FixtureRequest, benchmark: Any, state: GateState) -> None:
        params = getattr(request.node, "callspec", None)
        params = dict(params.params) if params else {}
        if "impl" not in params:
            pytest.fail(f"{request.node.nodeid}: a perf test must be parametrized over 'impl' "
                        "(e.g. @pytest.mark.parametrize('impl', ['reference', 'optimized']))")
        self.impl: str = str(params.pop("impl"))
        name = request.node.originalname.removeprefix("test_")
        extra = ",".join(str(v) for v in params.values())
        self.kernel = f"{name}[{extra}]" if extra else name
        self.device: str = state.device
        self.size: str = state.size
        self._request, self._benchmark, self._state = request, benchmark, state

    def __call__(
        self,
        fn: Callable[..., Any],
        *,
        setup: Callable[[], Any] | None = None,
        label: str = "",
        rounds: int | None = None,
        warmup_rounds: int = 2,
    ) -> Any:
        """Time ``fn()`` (or ``fn(setup())`` with a fresh setup each round, untimed).

        Rounds default to what fits in ``--benchmark-max-time`` (at least
        ``--benchmark-min-rounds``, never under 5, at most 1000). The first call is reported
        apart as ``first_call_ms`` (compile and warm-up live there), never in the timed rounds.
        """
        config, state, bench = self._request.config, self._state, self._benchmark
        run = synced(fn, self.device)
        setup_synced = None if setup is None else synced(setup, self.device)
        call = run if setup_synced is None else lambda: run(setup_synced())
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        call()  # a warm call sizes the rounds: the first may compile or build caches
        first, warm = t1 - t0, time.perf_counter() - t1
        if rounds is None:
            max_time = float(config.getoption("benchmark_max_time"))
            min_rounds = int(config.getoption("benchmark_min_rounds"))
            rounds = min(MAX_ROUNDS, max(min_rounds, math.ceil(max_time / max(warm, 1e-6))))
        rounds = max(rounds, MIN_ROUNDS)
        bench.group = self.kernel
        bench.extra_info.update(kernel=self.kernel, impl=self.impl, size=self.size, label=label,
                                device=self.device, first_call_ms=1e3 * first)
        if setup_synced is None:
            result = bench.pedantic(run, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
        else:
            result = bench.pedantic(run, setup=lambda: ((setup_synced(),), {}), rounds=rounds,
                                    warmup_rounds=warmup_rounds, iterations=1)
        if bench.stats is None:  # --benchmark-disable or xdist: ran once, nothing measured
            state.unmeasured += 1
            return result
        args = () if setup is None else (setup(),)
        peak = peak_memory(lambda: fn(*args), self.device)
        bench.extra_info["peak_memory_bytes"] = peak
        if self.impl in state.results.get(self.kernel, {}):
            pytest.fail(f"two perf tests measure {self.kernel} [{self.impl}]: perf kernel names come "
                        "from the test name and its non-impl parameters; rename one")
        state.results.setdefault(self.kernel, {})[self.impl] = Measurement(
            times=list(bench.stats.stats.data), size=self.size, label=label, peak_bytes=peak)
        floor = _floor(self._request.node, self.impl, self.device, self.size)
        if floor is not None:
            state.floors[(self.kernel, self.impl)] = floor
        return result


@pytest.fixture
def perf(request: pytest.FixtureRequest, benchmark: Any) -> PerfCase:
    """Time one impl of a reference/optimized pair; see ``PerfCase.__call__``.

    Requests pytest-benchmark's ``benchmark`` fixture by name, so pytest-benchmark counts perf
    tests as benchmarks (``--benchmark-only``, ``--benchmark-skip`` select them).
    """
    return PerfCase(request, benchmark, request.config.stash[STATE])


@pytest.fixture
def perf_device(request: pytest.FixtureRequest) -> str:
    """The device the perf session runs on (``--device``)."""
    return request.config.stash[STATE].device


@pytest.fixture
def perf_size(request: pytest.FixtureRequest) -> str:
    """``smoke`` or ``full`` (``--perf-size``)."""
    return request.config.stash[STATE].size


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(STATE, None)
    if state is None or not state.results:
        return
    if any(r.failures for r in state.compute_rows()) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None and state.unmeasured:
        terminalreporter.write_line(
            f"perfgate: {state.unmeasured} perf call(s) ran once with benchmarks disabled "
            "(--benchmark-disable, or xdist): no speedup measured, the gate did not run", yellow=True)
    if state is None or not state.results:
        return
    tr = terminalreporter
    rows = state.compute_rows()
    tr.section(f"perfgate speedups ({state.device}, {state.size}, {state.slug})")
    for line in format_table([r.as_dict() for r in rows]):
        tr.write_line(line)
    for kernel in state.unpaired():
        tr.write_line(f"{kernel}: no reference/optimized pair measured, no speedup", yellow=True)
    if config.getoption("benchmark_save", None) or config.getoption("benchmark_autosave", None):
        tr.write_line(f"saved these speedups as a baseline for {state.slug}")
    elif state.baseline is None:
        tr.write_line(f"no stored baseline compared for {state.slug}: run `make baseline` to save "
                      "one, then `make bench` (or --benchmark-compare) gates against it")
    else:
        matched = sum(r.baseline is not None for r in rows)
        tr.write_line(f"compared against baseline in {state.baseline_path}: {matched} of {len(rows)} "
                      f"row(s) have a stored speedup at size {state.size}")
    failures = [f for r in rows for f in r.failures]
    for f in failures:
        tr.write_line(f"GATE FAILED: {f}", red=True, bold=True)
    if not failures and rows:
        tr.write_line(f"gate passed: {len(rows)} speedup(s) at or above their floors", green=True)
