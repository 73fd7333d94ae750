"""``PerfSession``: the one object the plugin's hooks delegate to.

It reads and checks the ``--perf-*`` options at configure and does nothing else until the session
has collected a test that uses the ``perf`` fixture (or was given a ``--perf-*`` option): only
then does it import torch, fix torch's threads, set glibc's malloc mode, fingerprint the machine
and move pytest-benchmark's storage to that fingerprint's folder. A session without perf tests
is left as it would be without the plugin. A perf session refuses to run under pytest-xdist:
timing needs the machine to itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import compat
from .stored import JSON_KEY

if TYPE_CHECKING:  # the rest of perfgate (numpy, scipy) loads when a perf session starts
    from .against import Against
    from .floors import Ledger, Unmeasured
    from .state import GateState


SIZES = ("smoke", "full")
# (flag, default, help). Every option perfgate adds is here, and any of them given on the
# command line makes the session a perf session.
OPTIONS: list[tuple[str, Any, str]] = [
    ("--perf-device", "auto", "auto|cpu|cuda[:N] (auto: cuda when available)"),
    ("--perf-size", None, "problem sizes: smoke or full (default: smoke on CPU, full on CUDA)"),
    ("--perf-tolerance", 0.2, "with --benchmark-compare: fail when a speedup fell more than this fraction "
                              "under the stored baseline's (default 0.2)"),
    ("--perf-malloc", "cache", "CPU: 'cache' makes glibc keep freed memory for reuse, as CUDA's caching "
                               "allocator does, so timings do not depend on page faults and test order "
                               "(default); 'default' leaves malloc alone"),
    ("--perf-threads", None, "torch CPU threads, fixed for the session (default: torch's default)"),
    ("--perf-l2-flush", False, "CUDA: overwrite the GPU's L2 cache (zero a 256 MiB buffer) before each timed "
                               "call, outside its timing, as triton.testing.do_bench does: every call starts "
                               "cold (default: off, back-to-back calls keep their data in L2, as in a training "
                               "loop)"),
    ("--perf-visits", 3, "time each impl's interleaved rounds with its reference in this many visits: one "
                         "during its test, the rest at the session's end (default 3)"),
    ("--perf-all-visits", False, "time every visit of every row, even of a row already decided (its 99%% interval "
                                 "clear of its floor and baseline, or nothing to gate): the sequential stopping "
                                 "rule off, e.g. to measure what it saves and costs"),
    ("--perf-gated-only", False, "time only what a rule judges in this session: an impl no speedup or memory "
                                 "floor (for this device class and size) or stored baseline involves, and "
                                 "--perf-against does not compare, is skipped, a row only memory judges gets no "
                                 "interleaved pairs, and an impl's own rounds (pytest-benchmark's stats; no rule "
                                 "reads them) are 5, not sized to --benchmark-max-time; for a CI gate (make test) "
                                 "or a comparison with REV (make bench), not for a report or a saved baseline"),
    ("--perf-extend", 60.0, "seconds of extra interleaved pairs a row may take when its interval straddles its "
                            "floor or its stored baseline's line, before it is reported unresolved (default "
                            "60; 0: never extend)"),
    ("--perf-contended", 0.05, "share of the CPU time the host may withhold while a row's pairs run (CPU "
                               "time other processes took from our threads, and the hypervisor's steal, read "
                               "from Linux's /proc) "
                               "before the row's floor or baseline failure is reported unresolved instead: "
                               "evidence about the host, not the kernel (default 0.05; inf: never)"),
    ("--perf-shard", None, "K/N: run shard K of N of the perf suite (each test function with all its impls in one "
                           "shard, balanced by this fingerprint's stored run); merge the shards' --benchmark-json "
                           "files with python -m perfgate.report --merge"),
    ("--perf-slowdown", 1.0, "TEST ONLY, for python -m perfgate.fidelity: make every 'optimized' impl this many "
                             "times slower in the harness, to measure what the gate catches"),
    ("--perf-against", None, "REV: also time each impl but the reference against REV's library (a git revision "
                             "of this repository: HEAD, HEAD~1, a branch, a SHA; or a folder holding another "
                             "copy), in worker processes interleaved pair by pair, and fail a row this tree runs "
                             "more than --perf-against-tolerance slower than REV"),
    ("--perf-against-workers", 2, "worker processes a side for --perf-against, each block on one chosen at random "
                                  "(default 2, at least 2)"),
    ("--perf-against-tolerance", 0.05, "with --perf-against: fail a row whose time is more than this fraction "
                                       "over REV's, the whole interval beyond it (default 0.05)"),
    ("--perf-against-budget", 240.0, "with --perf-against: seconds of extra pairs shared by the rows whose "
                                     "interval straddles the tolerance, each taking at most its share of what "
                                     "is left and --perf-extend (default 240)"),
    ("--perf-require-floors", False, "fail the session when a speedup or memory floor declared for this device "
                                     "class and size was not checked because its row was not measured (its impl, "
                                     "its reference or its peer deselected, skipped, failed, errored or not run); "
                                     "without it such floors are listed, not failed"),
]
_TYPES = {"--perf-tolerance": float, "--perf-threads": int, "--perf-visits": int, "--perf-extend": float,
          "--perf-slowdown": float, "--perf-contended": float, "--perf-against-workers": int,
          "--perf-against-tolerance": float, "--perf-against-budget": float}
_CHOICES = {"--perf-size": SIZES, "--perf-malloc": ("cache", "default")}

# torch's own thread count, read before any session in this process (pytester) sets it: CPU
# floors are claims at the default threads, not applied at another --perf-threads.
_DEFAULT_THREADS: list[int | None] = []


def add_options(parser: pytest.Parser) -> None:
    parser.addini("perfgate_against_library", type="linelist", default=[],
                  help="the top-level packages --perf-against imports from REV (default: every package under the "
                       "rootdir that holds no test file)")
    group = parser.getgroup("perfgate", "perfgate: speedup gate over a reference")
    for flag, default, text in OPTIONS:
        if isinstance(default, bool):  # a switch
            group.addoption(flag, default=default, action="store_true", help=text)
        else:
            group.addoption(flag, default=default, type=_TYPES.get(flag), choices=_CHOICES.get(flag), help=text)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


class PerfSession:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        opt = {flag: config.getoption(_dest(flag)) for flag, _, _ in OPTIONS}
        self.asked = any(opt[flag] != default for flag, default, _ in OPTIONS)
        self.requested_device, self.requested_size = opt["--perf-device"], opt["--perf-size"]
        self.tolerance, self.malloc = opt["--perf-tolerance"], opt["--perf-malloc"]
        self.threads_option, self.visits = opt["--perf-threads"], opt["--perf-visits"]
        self.extend_s, self.slowdown = opt["--perf-extend"], opt["--perf-slowdown"]
        self.l2_flush: bool = opt["--perf-l2-flush"]
        self.all_visits: bool = opt["--perf-all-visits"]
        self.gated_only: bool = opt["--perf-gated-only"]
        self.require_floors: bool = opt["--perf-require-floors"]
        self.contended: float = opt["--perf-contended"]
        if not 0.0 <= self.tolerance < 1.0:
            raise pytest.UsageError(f"--perf-tolerance must be in [0, 1), got {self.tolerance}")
        if self.threads_option is not None and self.threads_option < 1:
            raise pytest.UsageError(f"--perf-threads must be >= 1, got {self.threads_option}")
        if self.visits < 1:
            raise pytest.UsageError(f"--perf-visits must be >= 1, got {self.visits}")
        if not self.extend_s >= 0.0:
            raise pytest.UsageError(f"--perf-extend must be seconds >= 0, got {self.extend_s}")
        if not self.contended > 0.0:
            raise pytest.UsageError(f"--perf-contended must be a share > 0 (inf: never), got {self.contended}")
        if self.slowdown < 1.0:
            raise pytest.UsageError(f"--perf-slowdown must be >= 1, got {self.slowdown}")
        self.shard: tuple[int, int] | None = None
        if opt["--perf-shard"] is not None:
            from .shard import parse

            try:
                self.shard = parse(opt["--perf-shard"])
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from exc
        if self.slowdown != 1.0 and self.saving:
            raise pytest.UsageError("--perf-slowdown is for measuring the gate; a slowed run cannot be a baseline")
        if self.gated_only and self.saving:
            raise pytest.UsageError("--perf-gated-only leaves out the rows nothing judges today, and a saved run "
                                    "is the baseline of every row: drop one of the two")
        self.against: Against | None = None
        if opt["--perf-against"] is not None:
            from .against import Against

            if self.shard is not None:
                raise pytest.UsageError("--perf-against compares the whole session with REV; run it without "
                                        "--perf-shard")
            if not _benchmarks_on(config):
                raise pytest.UsageError("--perf-against times the perf tests against REV: benchmarks are off "
                                        "(--benchmark-disable or --benchmark-skip)")
            self.against = Against(config, opt["--perf-against"], opt["--perf-against-workers"],
                                   opt["--perf-against-tolerance"], opt["--perf-against-budget"])
        self.state: GateState | None = None
        self._deselected: list[pytest.Item] = []  # perf tests -k, -m, --deselect or a shard left out
        self._shard_dropped: set[str] = set()  # node ids --perf-shard left to other shards
        self.ledger: Ledger | None = None  # the declared floors and what became of each perf test
        self.floors_unmeasured: list[Unmeasured] = []  # set at the session's end
        why = self._xdist_refusal()
        if self.asked and why:  # a --perf-* option asks for the gate: refused before any worker starts
            raise pytest.UsageError(why)
        self._held_compare: Any = None
        self._prev_threads: int | None = None
        self._prev_cuda: int | None = None

    @property
    def saving(self) -> bool:
        opt = self.config.getoption
        return bool(opt("benchmark_save", None) or opt("benchmark_autosave", None))

    def _xdist_refusal(self) -> str | None:
        """Why this would-be perf session refuses to run under pytest-xdist, or None. With benchmarks
        off (--benchmark-disable, --benchmark-skip) perf tests are plain tests, run once untimed,
        which workers may share out; but not under --perf-require-floors, a check of the whole
        session that no worker sees."""
        role = _xdist(self.config)
        if not role or (not _benchmarks_on(self.config) and not self.require_floors):
            return None
        floors = " (nor could one worker check the whole session's floors)" if self.require_floors else ""
        return (f"perfgate: timing needs one process, and this is a pytest-xdist {role}: parallel workers share "
                "the machine's cores and skew each other's timings; pytest-benchmark turns itself off under "
                f"xdist, so no speedup would be measured or gated{floors}. Run the perf tests in one process: "
                "drop -n/--dist (or add -p no:xdist). To only check that they run, in parallel: "
                "--benchmark-disable, without --perf-require-floors.")

    # -- configure and collection ---------------------------------------------------------------

    def configure(self) -> None:
        """Before pytest-benchmark configures: hold its baseline loading until collection says
        whether this is a perf session (its storage moves then)."""
        if self.config.getoption("benchmark_compare", None):
            self._held_compare = compat.hold_compare(self.config)

    def select_shard(self, items: list[pytest.Item]) -> None:
        """Under ``--perf-shard K/N``: keep shard K's test functions of ``items`` (after every other
        selection), deselect the rest, and record the plan for the merge (shard.py)."""
        if self.shard is None:
            return
        from .shard import digest, plan, stored_weights, unit

        state, (index, count) = self.activate(), self.shard
        path = compat.storage_url(self.config)
        folder = None if path is None else Path(path) / state.slug / state.size
        _check_stored(folder)
        weights, source = stored_weights(folder, JSON_KEY)
        units = sorted({unit(item.nodeid) for item in items})
        try:
            assignment = plan(units, weights, count)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        kept = [item for item in items if assignment[unit(item.nodeid)] == index]
        dropped = [item for item in items if assignment[unit(item.nodeid)] != index]
        self._shard_dropped = {item.nodeid for item in dropped}  # their floors are checked in their shards
        if dropped:
            self.config.hook.pytest_deselected(items=dropped)
            items[:] = kept
        mine = sorted(u for u, k in assignment.items() if k == index)
        state.shard = {"index": index, "count": count, "plan": digest(assignment), "units": mine,
                       "weights_from": source}

    def ran(self, nodeid: str, seconds: float) -> None:
        """A test's wall time, summed per test function (shard.unit) in a perf session."""
        if self.state is not None:
            from .shard import unit

            name = unit(nodeid)
            self.state.durations[name] = self.state.durations.get(name, 0.0) + seconds

    def deselected(self, items: list[pytest.Item]) -> None:
        """Tests left out of the run: a floor declared on a perf test among them goes unmeasured."""
        self._deselected += [item for item in items if "perf" in getattr(item, "fixturenames", ())]

    def reported(self, report: pytest.TestReport) -> None:
        """A test phase's report: why a perf test measured nothing (skipped, failed, errored)."""
        if self.ledger is not None:
            self.ledger.record(report)

    def collected(self, items: list[pytest.Item]) -> None:
        """After collection: a perf test among ``items`` (or a --perf-* option) starts the gate, and
        the floors the perf tests declare, run or deselected, are listed to be checked at the end."""
        if self.asked or any("perf" in getattr(item, "fixturenames", ()) for item in items):
            if _xdist(self.config) == "worker" and self._xdist_refusal():
                # refused by the perf fixture, test by test (activate): xdist reports a test's error
                # to the controller, while a worker stopped at collection is a crashed worker it restarts
                return
            state = self.activate()
            self._list_floors(items, state)
            if self.against is not None:
                self.against.prepare(items)
        elif self._held_compare is not None:
            compare, self._held_compare = self._held_compare, None
            compat.load_compare(self.config, compare, storage=None)

    def _list_floors(self, items: list[pytest.Item], state: GateState) -> None:
        """The floors declared on the run's and the deselected perf tests (not on those of other
        shards, whose floors their shards check) for this device class and size."""
        from .floors import Ledger, declared

        left_out = [item for item in self._deselected if item.nodeid not in self._shard_dropped]
        floors, nodeids = declared([*items, *left_out], state.device, state.size)
        self.ledger = Ledger(floors, nodeids, deselected={item.nodeid for item in left_out})
        self._deselected = []

    def activate(self) -> GateState:
        """Fix threads and malloc, fingerprint the machine, and point pytest-benchmark's storage at
        this fingerprint's folder (one folder per fingerprint and size, so a plain
        --benchmark-compare takes the newest baseline of this machine and size)."""
        if self.state is not None:
            return self.state
        why = self._xdist_refusal()
        if why:
            raise pytest.UsageError(why)
        from .fingerprint import fingerprint, slug
        from .state import GateState
        from .timing import Bandwidth, HostLoad, configure_malloc, resolve_device, timer_for, torch_or_none

        try:
            device = resolve_device(self.requested_device)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        if self.slowdown != 1.0 and device.startswith("cuda"):
            raise pytest.UsageError("--perf-slowdown spins the host after each call, which slows a CPU kernel by "
                                    "the factor but not a CUDA kernel timed by events: measure the gate's "
                                    "fidelity with --perf-device cpu")
        if device.startswith("cuda"):  # the session's GPU is current: streams, events and graphs default to it
            import torch

            self._prev_cuda = torch.cuda.current_device()
            index = torch.device(device).index  # plain "cuda" has none: torch's current GPU
            torch.cuda.set_device(self._prev_cuda if index is None else index)
        if self.l2_flush and not device.startswith("cuda"):
            raise pytest.UsageError(f"--perf-l2-flush overwrites a GPU's L2 cache before each timed call; this "
                                    f"session runs on {device}: drop it, or run with --perf-device cuda")
        torch = torch_or_none()
        if torch is None and self.threads_option is not None:
            raise pytest.UsageError("--perf-threads sets torch's thread count: torch is not installed")
        if torch is not None:
            if not _DEFAULT_THREADS:
                _DEFAULT_THREADS.append(torch.get_num_threads())
            self._prev_threads = torch.get_num_threads()  # put back at unconfigure (pytester runs)
            threads = self.threads_option or _DEFAULT_THREADS[0]
            torch.set_num_threads(threads)
        else:
            threads = None
        size = self.requested_size or ("full" if device.startswith("cuda") else "smoke")
        malloc = configure_malloc(self.malloc) if device == "cpu" else "n/a"
        fp = fingerprint(device, threads, malloc, l2_flush=self.l2_flush)
        self.state = GateState(device=device, size=size, threads=threads, tolerance=self.tolerance,
                               contended=self.contended,
                               fingerprint=fp, slug=slug(fp), slowdown=self.slowdown, visits=self.visits,
                               extend_s=self.extend_s, all_visits=self.all_visits, gated_only=self.gated_only,
                               compared=self.against is not None,
                               cpu_floors_off=_cpu_floors_off(device, threads, malloc),
                               timer=timer_for(device, l2_flush=self.l2_flush,
                                               host_timer=compat.host_timer(self.config),
                                               disable_gc=bool(self.config.getoption("benchmark_disable_gc"))),
                               host=HostLoad(threads or 1, probe=Bandwidth.shared() if device == "cpu" else None))
        path = compat.storage_url(self.config)
        storage = None if path is None else f"file://{path}/{self.state.slug}/{size}"
        compare, self._held_compare = self._held_compare, None
        if compare is not None and path is not None:
            _check_stored(Path(path) / self.state.slug / size)
        if isinstance(compare, str) and Path(compare).is_file():  # --benchmark-compare=PATH
            _check_stored(None, [Path(compare)])
        compat.load_compare(self.config, compare, storage=storage)
        if self.config.get_verbosity() >= 0:
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"perfgate: device={device} size={size} threads={threads} "
                                    f"fingerprint={self.state.slug}")
        return self.state

    def unconfigure(self) -> None:
        """Give torch back the thread count (and current GPU) it had, so a session inside a process
        (pytester) does not leave the outer one at its --perf-threads (torch's, and the BLAS and
        OpenMP pools') or its --perf-device."""
        if self.against is not None:
            self.against.close()
        if self.state is not None:
            self.state.unpin_threads()
        if self._prev_threads is not None:
            import torch

            torch.set_num_threads(self._prev_threads)
        if self._prev_cuda is not None:
            import torch

            torch.cuda.set_device(self._prev_cuda)

    # -- pytest-benchmark's hooks -----------------------------------------------------------------

    def machine_info(self, machine_info: dict) -> None:
        if self.state is not None:
            machine_info[JSON_KEY] = self.state.fingerprint

    def compare_machine_info(self, benchmarksession: Any, compared_benchmark: dict) -> None:
        from .state import baseline_key
        from .stored import problem

        state = self.state
        if state is None:
            return
        why = problem(compared_benchmark)
        if why is not None:
            info = compared_benchmark.get("commit_info") if isinstance(compared_benchmark, dict) else None
            raise pytest.UsageError(f"perfgate refuses the baseline --benchmark-compare loaded (commit "
                                    f"{(info or {}).get('id')}): {why}. Compare against a run perfgate saved "
                                    "whole.")
        theirs = compared_benchmark.get("machine_info", {}).get(JSON_KEY)
        if theirs != state.fingerprint:
            raise pytest.UsageError(
                "perfgate refuses to compare against a baseline from another machine fingerprint:\n"
                f"  this machine: {state.fingerprint}\n  baseline:     {theirs}\n"
                "Speedups are only comparable on the same device, threads and torch build. Save a "
                "baseline on this machine (--benchmark-save=NAME), or compare against one saved on "
                "this fingerprint.")
        rows = compared_benchmark.get(JSON_KEY, {}).get("speedups", [])
        state.baseline = {baseline_key(r["kernel"], r["impl"], r["size"]):
                          (r["speedup"], r.get("low", r["speedup"])) for r in rows}
        state.memory_baseline = {baseline_key(r["kernel"], r["impl"], r["size"]): r["memory_ratio"]
                                 for r in rows if r.get("memory_ratio") is not None}
        state.baseline_path = str(benchmarksession.storage)
        info = compared_benchmark.get("commit_info") or {}
        state.baseline_id = f"{info.get('id')} {compared_benchmark.get('datetime')}"

    def update_json(self, output_json: dict) -> None:
        """The rows computed in ``finish`` (no timing happens here)."""
        state = self.state
        if state is None or state.rows is None:
            return
        output_json[JSON_KEY] = {
            "fingerprint": state.fingerprint,
            "slug": state.slug,
            "size": state.size,
            "tolerance": state.tolerance,
            "contended": state.contended,  # the withheld CPU share at which a failing row is unresolved
            "floors_applied": not state.cpu_floors_off,  # False: CPU floors not applied (threads, malloc)
            "floors_off": state.cpu_floors_off,  # why not, e.g. "at --perf-threads 1"; "" when applied
            "baseline": state.baseline_id,  # the stored run the rows were compared with (commit, time), or None
            "shard": state.shard,  # under --perf-shard: index, count, plan digest, its test functions
            "tests_failed": state.tests_failed,  # a merge of shards fails when any shard's tests failed
            "interrupted": state.interrupted,  # Ctrl-C: partial rows; never saved, refused as a baseline
            "durations": state.durations,  # seconds per test function, setup to teardown: --perf-shard's weights
            "speedups": [r.as_dict() for r in state.rows],
            # declared floors whose rows were not measured (deselected, skipped, failed, ...), and why
            "unmeasured_floors": [u.as_dict() for u in self.floors_unmeasured],
        }
        if self.against is not None:
            output_json[JSON_KEY]["against"] = self.against.json()

    # -- the session's end --------------------------------------------------------------------------

    def finish(self, session: pytest.Session) -> None:
        """Before pytest-benchmark writes its JSON: the later visits, the extensions of straddled
        floors, the rows, and the declared floors no row checked. An interrupted session starts no
        more timing."""
        state = self.state
        if state is None:
            return
        if state.results:
            if session.exitstatus == pytest.ExitCode.INTERRUPTED:
                state.interrupted = True
            state.tests_failed = session.testsfailed
            state.compute_rows()
            if self.against is not None and not state.interrupted:
                self.against.run(state)  # after the rows: compute_rows freed the session's callables
                state.interrupted = self.against.interrupted  # Ctrl-C there: a partial run, never saved
            if state.interrupted and self.saving:  # a partial run must not become the newest baseline
                compat.withhold_save(self.config)
        if self.ledger is not None:
            measured = {(kernel, impl): m.variant for kernel, impls in state.results.items()
                        for impl, m in impls.items()}
            rows = {(r.kernel, r.impl) for r in state.rows or []}
            self.floors_unmeasured = self.ledger.unmeasured(rows, measured,
                                                            speedup_floors_off=bool(state.cpu_floors_off),
                                                            benchmarks_off=not _benchmarks_on(self.config))

    def exit_status(self, session: pytest.Session) -> None:
        """After every other hook: a failed gate fails the session, and so, under
        --perf-require-floors, does a declared floor no row checked (even when every test was
        deselected); Ctrl-C in the extra timing ends it interrupted."""
        state = self.state
        if state is None:
            return
        if state.results and session.exitstatus == pytest.ExitCode.OK:
            against = self.against
            slower = against is not None and bool(against.failed() or against.problem)
            if any(r.failures for r in state.compute_rows()) or slower:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            elif against is not None and against.interrupted:
                session.exitstatus = pytest.ExitCode.INTERRUPTED
            elif state.interrupted:
                session.exitstatus = pytest.ExitCode.INTERRUPTED
        passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)  # all deselected: 5, not a pass
        if session.exitstatus in passing and self._floors_failed():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _floors_failed(self) -> list[Unmeasured]:
        """The unmeasured floors that fail the session: under --perf-require-floors, those that
        apply here for certain."""
        return [u for u in self.floors_unmeasured if u.required] if self.require_floors else []

    def summary(self, tr: Any) -> None:
        """The table, the declared floors no row checked, the verdict."""
        state = self.state
        if state is None:
            return
        if state.unmeasured:
            tr.write_line(f"perfgate: {state.unmeasured} perf call(s) ran once with benchmarks disabled "
                          "(--benchmark-disable): no speedup measured, the gate did not run", yellow=True)
        rows = self._table(tr) if state.results else []
        self._unmeasured_floors(tr)
        if state.results or self.floors_unmeasured:
            self._verdict(tr, rows)
        if self.against is not None and self.against.rows:
            tr.section("perfgate against REV")
            for style, text in self.against.lines():
                tr.write_line(text, **STYLES[style])
        missed = [u for u in self.floors_unmeasured if u.required]
        if missed and not self.require_floors:
            tr.write_line(f"perfgate: {len(missed)} declared floor(s) not checked (NOT MEASURED above): the "
                          "verdict covers the rows measured only; --perf-require-floors fails a session on them",
                          yellow=True, bold=True)

    def _unmeasured_floors(self, tr: Any) -> None:
        """Each declared floor no row checked: a note where it may not apply here (a variant-keyed
        floor of a skipped impl), a warning otherwise; under --perf-require-floors the verdict
        lists those as failures instead."""
        for u in self.floors_unmeasured:
            if not u.required:
                tr.write_line(f"perfgate: {u.line()}")
            elif not self.require_floors:
                tr.write_line(f"NOT MEASURED: {u.line()}", yellow=True, bold=True)

    def _table(self, tr: Any) -> list:
        """The speedup table and the notes under it; the rows."""
        from .stats import format_table

        state = self.state
        if state.cpu_floors_off:
            tr.write_line(f"perfgate: CPU speedup floors are set at torch's default {_DEFAULT_THREADS[0]} "
                          f"thread(s) under --perf-malloc cache; {state.cpu_floors_off} they are not applied: "
                          "only a stored baseline (--benchmark-compare) gates the speedups", yellow=True)
        rows = state.compute_rows()
        if state.shard:
            sh = state.shard
            weights = sh["weights_from"] or "equal, no stored run"
            tr.write_line(f"perfgate: shard {sh['index']}/{sh['count']} ran {len(sh['units'])} test function(s), "
                          f"plan {sh['plan']} (weights: {weights}); merge all shards' JSON with "
                          "python -m perfgate.report --merge")
        tr.section(f"perfgate speedups ({state.device}, {state.size}, {state.slug})")
        for line in format_table([r.as_dict() for r in rows]):
            tr.write_line(line)
        for kernel in state.unpaired():
            tr.write_line(f"{kernel}: no reference/optimized pair measured, no speedup", yellow=True)
        if state.not_timed:
            left = ", ".join(state.not_timed)
            tr.write_line(f"perfgate: --perf-gated-only: {len(state.not_timed)} impl(s) not timed, no floor or "
                          f"stored baseline judges them here (a session without it times them): {left}")
        for row in state.memory_unmeasured():
            tr.write_line(f"{row}: a memory floor is declared but this platform gives no peak memory "
                          "(CUDA, or Linux /proc/self/clear_refs): memory not gated", yellow=True)
        if self.saving and state.interrupted:
            tr.write_line(f"interrupted: nothing saved as a baseline for {state.slug} (its rows are partial; "
                          "--benchmark-json, if given, marks them interrupted)", yellow=True)
        elif self.saving:
            tr.write_line(f"saved these speedups as a baseline for {state.slug}")
        elif state.baseline is None:
            tr.write_line(f"no stored baseline compared for {state.slug}: save one on this machine with "
                          "--benchmark-save=NAME, then --benchmark-compare gates against it")
        else:
            matched = sum(r.baseline is not None for r in rows)
            tr.write_line(f"compared against baseline in {state.baseline_path}: {matched} of {len(rows)} "
                          f"row(s) have a stored speedup at size {state.size}")
        return rows

    def _verdict(self, tr: Any, rows: list) -> None:
        from .stats import held_to, verdict

        state = self.state
        what = held_to(state.cpu_floors_off)
        budget = f"--perf-extend {state.extend_s:g} s{', interrupted' if state.interrupted else ''}"
        missed = [f"{u.line()} (--perf-require-floors)" for u in self._floors_failed()]
        for style, text in verdict(rows, what, budget, missed):
            tr.write_line(text, **STYLES[style])


STYLES = {"note": {}, "warn": {"yellow": True, "bold": True}, "fail": {"red": True, "bold": True},
          "pass": {"green": True}}


SESSION = pytest.StashKey[PerfSession]()


def _check_stored(folder: Path | None, paths: list[Path] | None = None) -> None:
    """Every run stored in ``folder`` (a fingerprint's and size's), or each of ``paths``, is a whole
    perfgate run, or a usage error names it: pytest-benchmark skips a file it cannot parse, with a
    warning, and would compare against an older run (or none), or stops on one missing its fields."""
    from .stored import BadRun, read_run

    if paths is None:
        paths = sorted(folder.glob("*/*.json")) if folder is not None and folder.is_dir() else []
    for path in paths:
        try:
            read_run(path)
        except BadRun as exc:
            raise pytest.UsageError(
                f"perfgate reads this fingerprint's stored runs, and one is not a whole perfgate run:\n  {exc}\n"
                "--benchmark-compare would skip it and compare against an older run, or stop on it. Restore it "
                f"(e.g. from version control), or move it out of {folder or path.parent}.") from exc


def _xdist(config: pytest.Config) -> str:
    """How pytest-xdist runs this process: "worker", "controller" (it hands the tests to workers) or
    "" (not at all). A worker's config has ``workerinput`` (xdist resets its -n and --dist); a
    controller has -n N with N > 0 or --dist other than "no", except under --collect-only, where
    xdist runs nothing. Read from options, so without xdist installed nothing matches."""
    if hasattr(config, "workerinput"):
        return "worker"
    distributed = config.getoption("numprocesses", None) or config.getoption("dist", "no") not in (None, "no")
    return "controller" if distributed and not config.getoption("collectonly", False) else ""


def _benchmarks_on(config: pytest.Config) -> bool:
    """pytest-benchmark times benchmarks: neither --benchmark-disable (without --benchmark-enable)
    nor --benchmark-skip (without --benchmark-only) turned them off. Its own rule, less its xdist
    clause, which perfgate refuses instead."""
    opt = config.getoption
    disabled = opt("benchmark_disable", False) and not opt("benchmark_enable", False)
    return not disabled and not (opt("benchmark_skip", False) and not opt("benchmark_only", False))


def _cpu_floors_off(device: str, threads: int | None, malloc: str) -> str:
    """Why CPU speedup floors are not applied in this session ("" when they are): they are claims
    at torch's default threads under the caching malloc mode, where they were measured. Under
    glibc's default malloc a kernel returning a large fresh tensor page-faults it on every call
    (per-sample gradients: 4.5x over their reference under cache, 2.1x under default on one CPU)."""
    if device != "cpu":
        return ""
    if threads is not None and threads != _DEFAULT_THREADS[0]:
        return f"at --perf-threads {threads}"
    if malloc != "cache":
        return f"under --perf-malloc {malloc}"
    return ""
