"""perfgate pytest plugin (entry point ``pytest11``): speedup pairs on top of pytest-benchmark.

A perf test is parametrized over ``impl`` ("reference", "optimized", or ablation steps) and
times its callable through the ``perf`` fixture; all impls of one test land in one
pytest-benchmark group, so every ``--benchmark-*`` option works unchanged. At the end of the
session perfgate prints speedup = median(reference) / median(impl) with a bootstrap interval,
writes it into the benchmark JSON (key ``kernelgate``), and fails the session when a floor
declared with ``@pytest.mark.speedup(cpu=..., cuda=...)`` is not met, or the fraction of peak
memory saved is under ``@pytest.mark.memory(cpu=..., cuda=...)``, or, under
``--benchmark-compare``, when a speedup fell more than ``--speedup-tolerance`` under the
stored baseline's. Baselines are stored per machine fingerprint; comparing against another
fingerprint's baseline is refused.
"""

from __future__ import annotations

from typing import Any

import pytest

from .case import PerfCase
from .fingerprint import fingerprint, slug
from .state import STATE, GateState, baseline_key
from .stats import format_table
from .timing import configure_malloc, resolve_device

SIZES = ("smoke", "full")
# CPU speedup floors are measured at torch's default thread count; at another --perf-threads
# they are not applied (a 2-thread floor says nothing of 1 thread) and only the baseline rule
# gates: on a shared 2-vCPU host one thread is what makes speedups repeatable (README).
_DEFAULT_THREADS: int | None = None
_PREV_THREADS = pytest.StashKey[int]()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Give torch back the thread count it had, so a session inside a process (pytester) does
    not leave the outer one running at its --perf-threads."""
    prev = config.stash.get(_PREV_THREADS, None)
    if prev is not None:
        import torch

        torch.set_num_threads(prev)



def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("perfgate", "kernelgate speedup gate")
    group.addoption("--device", default="auto", help="auto|cpu|cuda[:N] (auto: cuda when available)")
    group.addoption("--perf-size", default=None, choices=SIZES,
                    help="problem sizes: smoke (CI on CPU) or full (default: smoke on CPU, full on CUDA)")
    group.addoption("--speedup-tolerance", type=float, default=0.2,
                    help="with --benchmark-compare: fail when a speedup fell more than this "
                         "fraction under the stored baseline's (default 0.2)")
    group.addoption("--perf-malloc", default="cache", choices=("cache", "default"),
                    help="CPU: 'cache' makes glibc keep freed memory for reuse, as CUDA's caching "
                         "allocator does, so timings do not depend on page faults and test order "
                         "(default); 'default' leaves malloc alone")
    group.addoption("--perf-threads", type=int, default=None,
                    help="torch CPU threads, fixed for the session (default: torch's default)")
    group.addoption("--perf-visits", type=int, default=3,
                    help="time each impl's interleaved rounds with its reference in this many visits: "
                         "one during its test, the rest at the session's end (default 3)")
    group.addoption("--perf-extend", type=float, default=60.0,
                    help="seconds of extra interleaved pairs a row may take when its interval straddles "
                         "its floor, before it is reported unresolved (default 60; 0: never extend)")
    group.addoption("--perf-slowdown", type=float, default=1.0,
                    help="TEST ONLY, for python -m kernels.perfgate.fidelity: make every 'optimized' "
                         "impl this many times slower in the harness, to measure what the gate catches")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "speedup(cpu=None, cuda=None, impl='optimized', variant=None): speedup floor of impl over the "
        "reference per device class; a float, or a dict keyed by perf size; with variant (an fnmatch "
        "pattern), only for a perf call whose variant= matches it",
    )
    config.addinivalue_line(
        "markers",
        "memory(cpu=None, cuda=None, impl='optimized'): least fraction of the reference's peak "
        "memory that impl saves, measured in the same run; a float, or a dict keyed by perf size",
    )
    import torch

    try:
        device = resolve_device(config.getoption("device"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    tolerance = config.getoption("speedup_tolerance")
    if not 0.0 <= tolerance < 1.0:
        raise pytest.UsageError(f"--speedup-tolerance must be in [0, 1), got {tolerance}")
    global _DEFAULT_THREADS
    if _DEFAULT_THREADS is None:  # torch's own default, before any session (pytester) sets it
        _DEFAULT_THREADS = torch.get_num_threads()
    threads = config.getoption("perf_threads") or _DEFAULT_THREADS
    config.stash[_PREV_THREADS] = torch.get_num_threads()  # put back at unconfigure (pytester runs)
    if threads < 1:
        raise pytest.UsageError(f"--perf-threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    size = config.getoption("perf_size") or ("full" if device.startswith("cuda") else "smoke")
    malloc = configure_malloc(config.getoption("perf_malloc")) if device == "cpu" else "n/a"
    fp = fingerprint(device, threads, malloc)
    slowdown = config.getoption("perf_slowdown")
    if slowdown < 1.0:
        raise pytest.UsageError(f"--perf-slowdown must be >= 1, got {slowdown}")
    saving = config.getoption("benchmark_save", None) or config.getoption("benchmark_autosave", None)
    if slowdown != 1.0 and saving:
        raise pytest.UsageError("--perf-slowdown is for measuring the gate; a slowed run cannot be a baseline")
    visits = config.getoption("perf_visits")
    if visits < 1:
        raise pytest.UsageError(f"--perf-visits must be >= 1, got {visits}")
    extend_s = config.getoption("perf_extend")
    if not extend_s >= 0.0:
        raise pytest.UsageError(f"--perf-extend must be seconds >= 0, got {extend_s}")
    state = GateState(device=device, size=size, threads=threads, tolerance=tolerance,
                      fingerprint=fp, slug=slug(fp), slowdown=slowdown, visits=visits, extend_s=extend_s,
                      cpu_floors_apply=device != "cpu" or threads == _DEFAULT_THREADS)
    config.stash[STATE] = state
    # Baselines live in one folder per fingerprint and size (pytest-benchmark configures after
    # us), so a plain --benchmark-compare takes the newest baseline of this machine and size.
    storage = getattr(config.option, "benchmark_storage", None)
    if isinstance(storage, str) and (storage.startswith("file://") or "://" not in storage):
        path = storage.removeprefix("file://")
        if path == "./.benchmarks":
            path = str(config.rootpath / ".benchmarks")
        config.option.benchmark_storage = f"file://{path}/{state.slug}/{state.size}"


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
    state.baseline = {baseline_key(r["kernel"], r["impl"], r["size"]): r["speedup"] for r in rows}
    state.memory_baseline = {baseline_key(r["kernel"], r["impl"], r["size"]): r["memory_ratio"] for r in rows
                             if r.get("memory_ratio") is not None}
    state.baseline_path = str(benchmarksession.storage)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks: Any, output_json: dict) -> None:
    state = config.stash[STATE]
    output_json["kernelgate"] = {
        "fingerprint": state.fingerprint,
        "slug": state.slug,
        "size": state.size,
        "tolerance": state.tolerance,
        "floors_applied": state.cpu_floors_apply,  # False: CPU floors not applied at this thread count
        "speedups": [r.as_dict() for r in state.compute_rows()],
    }


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


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> Any:
    """Outermost, before pytest-benchmark writes the JSON (which computes the rows): an
    interrupted session reports what it measured and starts no later visit or extension. After
    every other hook: a failed gate fails the session."""
    state = session.config.stash.get(STATE, None)
    if state is not None and session.exitstatus == pytest.ExitCode.INTERRUPTED:
        state.interrupted = True
    yield
    if state is None or not state.results:
        return
    if any(r.failures for r in state.compute_rows()) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if state.interrupted and session.exitstatus == pytest.ExitCode.OK:  # Ctrl-C in the extra timing
        session.exitstatus = pytest.ExitCode.INTERRUPTED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None and state.unmeasured:
        terminalreporter.write_line(
            f"perfgate: {state.unmeasured} perf call(s) ran once with benchmarks disabled "
            "(--benchmark-disable, or xdist): no speedup measured, the gate did not run", yellow=True)
    if state is None or not state.results:
        return
    tr = terminalreporter
    if not state.cpu_floors_apply:
        tr.write_line(f"perfgate: CPU speedup floors are set at torch's default {_DEFAULT_THREADS} thread(s); "
                      f"at --perf-threads {state.threads} they are not applied: only a stored baseline "
                      "(--benchmark-compare) gates the speedups",
                      yellow=True)
    rows = state.compute_rows()
    tr.section(f"perfgate speedups ({state.device}, {state.size}, {state.slug})")
    for line in format_table([r.as_dict() for r in rows]):
        tr.write_line(line)
    for kernel in state.unpaired():
        tr.write_line(f"{kernel}: no reference/optimized pair measured, no speedup", yellow=True)
    for row in state.memory_unmeasured():
        tr.write_line(f"{row}: a memory floor is declared but this platform gives no peak memory "
                      "(CUDA, or Linux /proc/self/clear_refs): memory not gated", yellow=True)
    if config.getoption("benchmark_save", None) or config.getoption("benchmark_autosave", None):
        tr.write_line(f"saved these speedups as a baseline for {state.slug}")
    elif state.baseline is None:
        tr.write_line(f"no stored baseline compared for {state.slug}: run `make baseline` to save "
                      "one, then `make bench` (or --benchmark-compare) gates against it")
    else:
        matched = sum(r.baseline is not None for r in rows)
        tr.write_line(f"compared against baseline in {state.baseline_path}: {matched} of {len(rows)} "
                      f"row(s) have a stored speedup at size {state.size}")
    for r in rows:
        if r.extended:
            tr.write_line(f"extended: {r.kernel} [{r.impl}] +{r.extended} interleaved pairs at the session's end, "
                          f"its interval straddled the floor {r.floor:.2f}x: now {r.speedup:.2f}x "
                          f"(95% CI {r.low:.2f}-{r.high:.2f}x), {r.outcome}")
    for r in rows:
        for u in r.unresolved:
            how = (f"after +{r.extended} pairs" if r.extended else "not extended") + \
                f" (--perf-extend {state.extend_s:g} s{', interrupted' if state.interrupted else ''})"
            tr.write_line(f"UNRESOLVED: {u}; {how}: neither failed nor passed; rerun, or run on a quieter host",
                          yellow=True, bold=True)
    failures = [f for r in rows for f in r.failures]
    for f in failures:
        tr.write_line(f"GATE FAILED: {f}", red=True, bold=True)
    if not failures and rows:
        what = ("at or above their floors" if state.cpu_floors_apply
                else "without speedup floors (not applied at this thread count)")
        unresolved = sum(r.outcome == "unresolved" for r in rows)
        if unresolved:
            tr.write_line(f"gate not failed: {len(rows) - unresolved} speedup(s) {what}, {unresolved} unresolved "
                          "(their intervals straddle their floors)", yellow=True, bold=True)
        else:
            tr.write_line(f"gate passed: {len(rows)} speedup(s) {what}", green=True)
