"""``PerfSession``: the one object the plugin's hooks delegate to.

It reads and checks the ``--perf-*`` options at configure and does nothing else until the session
has collected a test that uses the ``perf`` fixture (or was given a ``--perf-*`` option): only
then does it import torch, fix torch's threads, set glibc's malloc mode, fingerprint the machine
and move pytest-benchmark's storage to that fingerprint's folder. A session without perf tests
is left as it would be without the plugin. A perf session refuses to run under pytest-xdist:
timing needs the machine to itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import compat
from .options import Options
from .stored import JSON_KEY

if TYPE_CHECKING:  # the rest of perfgate (numpy, scipy) loads when a perf session starts
    from .against import Against
    from .floors import Ledger, Unmeasured
    from .roofline import Limits
    from .state import GateState, Settings


# torch's own thread count, read before any session in this process (pytester) sets it: CPU
# floors are claims at the default threads, not applied at another --perf-threads.
_DEFAULT_THREADS: list[int | None] = []


class PerfSession:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.options = o = Options.read(config)
        if o.gated_only and self.saving:
            raise pytest.UsageError("--perf-gated-only leaves out the rows nothing judges today, and a saved run "
                                    "is the baseline of every row: drop one of the two")
        self.against: Against | None = None
        if o.against is not None:
            from .against import Against

            if o.shard is not None:
                raise pytest.UsageError("--perf-against compares the whole session with REV; run it without "
                                        "--perf-shard")
            if not _benchmarks_on(config):
                raise pytest.UsageError("--perf-against times the perf tests against REV: benchmarks are off "
                                        "(--benchmark-disable or --benchmark-skip)")
            self.against = Against(config, o.against, o.against_workers, o.against_tolerance, o.against_budget)
        self.state: GateState | None = None
        self._deselected: list[pytest.Item] = []  # perf tests -k, -m, --deselect or a shard left out
        self._shard_elsewhere: set[str] = set()  # test functions (shard.unit) --perf-shard left to other shards
        self.ledger: Ledger | None = None  # the declared floors and what became of each perf test
        self.floors_unmeasured: list[Unmeasured] = []  # set at the session's end
        why = self._xdist_refusal()
        if self.options.asked and why:  # a --perf-* option asks for the gate: refused before any worker starts
            raise pytest.UsageError(why)
        self._held_compare: Any = None
        self.withheld = False  # a failing session's baseline save taken back (finish)
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
        if not role or (not _benchmarks_on(self.config) and not self.options.require_floors):
            return None
        floors = " (nor could one worker check the whole session's floors)" if self.options.require_floors else ""
        return (f"perfgate: timing needs one process, and this is a pytest-xdist {role}: parallel workers share "
                "the machine's cores and skew each other's timings; pytest-benchmark turns itself off under "
                f"xdist, so no speedup would be measured or gated{floors}. Run the perf tests in one process: "
                "drop -n/--dist (or add -p no:xdist). To only check that they run, in parallel: "
                "--benchmark-disable, without --perf-require-floors.")

    # -- configure and collection ---------------------------------------------------------------

    def configure(self) -> None:
        """Before pytest-benchmark configures: hold its baseline loading until collection says
        whether this is a perf session (its storage moves then). In a session without one it is
        given back before the first test (``release_compare``)."""
        if self.config.getoption("benchmark_compare", None):
            self._held_compare = compat.hold_compare(self.config)

    def select_shard(self, items: list[pytest.Item]) -> None:
        """Under ``--perf-shard K/N``: keep shard K's test functions of ``items`` (after every other
        selection), deselect the rest, and record the plan for the merge (shard.py)."""
        if self.options.shard is None:
            return
        from .shard import digest, plan, stored_weights, unit

        state, (index, count) = self.activate(), self.options.shard
        path = compat.storage_url(self.config)
        folder = None if path is None else Path(path) / state.settings.slug / state.settings.size
        _check_stored(folder)
        weights, source = stored_weights(folder, JSON_KEY)
        units = sorted({unit(item.nodeid) for item in items})
        try:
            assignment = plan(units, weights, count)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        kept = [item for item in items if assignment[unit(item.nodeid)] == index]
        dropped = [item for item in items if assignment[unit(item.nodeid)] != index]
        self._shard_elsewhere = {u for u, k in assignment.items() if k != index}  # their shards check their floors
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
            self.state.tally.durations[name] = self.state.tally.durations.get(name, 0.0) + seconds

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
        if self.options.asked or any("perf" in getattr(item, "fixturenames", ()) for item in items):
            if _xdist(self.config) == "worker" and self._xdist_refusal():
                # refused by the perf fixture, test by test (activate): xdist reports a test's error
                # to the controller, while a worker stopped at collection is a crashed worker it restarts
                return
            state = self.activate()
            self._list_floors(items, state)
            if self.against is not None:
                self.against.prepare(items)

    def release_compare(self) -> None:
        """A session without perf tests: pytest-benchmark's --benchmark-compare loaded as its own
        configure would have, from its own storage. Called where pytest captures no warnings
        (before the test loop, or at unconfigure when the session stopped before it), so its
        "Can't compare" warning and its "Comparing against" line reach stderr as they do without
        perfgate, not the warnings summary."""
        if self.state is None and self._held_compare is not None:
            compare, self._held_compare = self._held_compare, None
            compat.load_compare(self.config, compare, storage=None)

    def _list_floors(self, items: list[pytest.Item], state: GateState) -> None:
        """The floors declared on the run's and the deselected perf tests (not on those of other
        shards' test functions, deselected by the shard or before it: their shards check their
        floors) for this device class and size."""
        from .floors import Ledger, declared
        from .shard import unit

        left_out = [item for item in self._deselected if unit(item.nodeid) not in self._shard_elsewhere]
        floors, nodeids = declared([*items, *left_out], state.settings.device, state.settings.size)
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
        from .floors import FloorPolicy
        from .state import SAVING_SCAN_S, SCAN_S, Floors, GateState, Probes, Settings
        from .timing import Bandwidth, HostLoad, Pace, RoundTrip, configure_malloc, timer_for

        o = self.options
        device = self._device()
        threads = self._threads()
        size = o.size or ("full" if device.startswith("cuda") else "smoke")
        malloc = configure_malloc(o.malloc) if device == "cpu" else "n/a"
        fp = fingerprint(device, threads, malloc, l2_flush=o.l2_flush)
        settings = Settings(device=device, size=size, threads=threads, tolerance=o.tolerance, fingerprint=fp,
                            slug=slug(fp), visits=o.visits, extend_s=o.extend_s, contended=o.contended,
                            all_visits=o.all_visits, gated_only=o.gated_only, compared=self.against is not None,
                            saving=self.saving,
                            wrap=self._wrap(device))
        timer = timer_for(device, l2_flush=o.l2_flush, host_timer=compat.host_timer(self.config),
                          disable_gc=bool(self.config.getoption("benchmark_disable_gc")))
        host = HostLoad(threads or 1, probe=Bandwidth.shared() if device == "cpu" else None,
                        placement=RoundTrip.open(threads) if device == "cpu" else None,
                        pace=Pace() if device == "cpu" else None)
        default = _DEFAULT_THREADS[0] if _DEFAULT_THREADS else None  # None: no torch (threads is None too)
        floors = Floors(policy=FloorPolicy.for_session(device, threads, default, malloc))
        self.state = GateState(settings, Probes(timer, host, threads), floors=floors,
                               limits=self._limits(settings))
        self.state.scan_pace(SAVING_SCAN_S if self.saving else SCAN_S)
        self._load_compare(settings)
        if self.config.get_verbosity() >= 0:
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"perfgate: device={device} size={size} threads={threads} "
                                    f"fingerprint={settings.slug}")
        return self.state

    def _limits(self, settings: Settings) -> Limits:
        """This machine's roofline limits, read from the fingerprint's folder where stored (a file
        that is not perfgate's is a usage error naming it), measured when a row first needs them."""
        from .roofline import LIMITS_FILE, BadLimits, Limits

        path = compat.storage_url(self.config)
        where = None if path is None else Path(path) / settings.slug / LIMITS_FILE
        try:
            return Limits(settings.device, settings.slug, where, remeasure=self.options.remeasure_limits)
        except BadLimits as exc:
            raise pytest.UsageError(f"perfgate reads this fingerprint's stored roofline limits: {exc}. Measure "
                                    "them anew with --perf-remeasure-limits (it replaces the file).") from exc

    def _wrap(self, device: str) -> Any:
        """A plugin's wrapper of the timed callables (``hooks.pytest_perfgate_wrap_timed``), or None."""
        wrap = self.config.hook.pytest_perfgate_wrap_timed(config=self.config, device=device)
        if wrap is not None and self.saving:
            raise pytest.UsageError(f"a plugin wraps the timed callables ({wrap!r}): the run measures the gate, "
                                    f"not the kernels, and cannot be a baseline")
        return wrap

    def _device(self) -> str:
        """The session's device (--perf-device), made torch's current GPU when it is one."""
        from .timing import resolve_device

        try:
            device = resolve_device(self.options.device)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        if self.options.l2_flush and not device.startswith("cuda"):
            raise pytest.UsageError(f"--perf-l2-flush overwrites a GPU's L2 cache before each timed call; this "
                                    f"session runs on {device}: drop it, or run with --perf-device cuda")
        if device.startswith("cuda"):  # the session's GPU is current: streams, events and graphs default to it
            import torch

            self._prev_cuda = torch.cuda.current_device()
            index = torch.device(device).index  # plain "cuda" has none: torch's current GPU
            torch.cuda.set_device(self._prev_cuda if index is None else index)
        return device

    def _threads(self) -> int | None:
        """torch's thread count for the session (--perf-threads, else torch's default); None
        without torch."""
        from .timing import torch_or_none

        torch = torch_or_none()
        if torch is None and self.options.threads is not None:
            raise pytest.UsageError("--perf-threads sets torch's thread count: torch is not installed")
        if torch is None:
            return None
        if not _DEFAULT_THREADS:
            _DEFAULT_THREADS.append(torch.get_num_threads())
        self._prev_threads = torch.get_num_threads()  # put back at unconfigure (pytester runs)
        threads = self.options.threads or _DEFAULT_THREADS[0]
        torch.set_num_threads(threads)
        return threads

    def _load_compare(self, settings: Settings) -> None:
        """pytest-benchmark's storage moved to this fingerprint's folder, and the baseline it held
        (--benchmark-compare) loaded from there, each stored run checked first."""
        path = compat.storage_url(self.config)
        storage = None if path is None else f"file://{path}/{settings.slug}/{settings.size}"
        compare, self._held_compare = self._held_compare, None
        if compare is not None and path is not None:
            _check_stored(Path(path) / settings.slug / settings.size)
        if isinstance(compare, str) and Path(compare).is_file():  # --benchmark-compare=PATH
            _check_stored(None, [Path(compare)])
        compat.load_compare(self.config, compare, storage=storage)

    def unconfigure(self) -> None:
        """Give torch back the thread count (and current GPU) it had, so a session inside a process
        (pytester) does not leave the outer one at its --perf-threads (torch's, and the BLAS and
        OpenMP pools') or its --perf-device."""
        self.release_compare()
        if self.against is not None:
            self.against.close()
        if self.state is not None:
            self.state.probes.unpin_threads()
        if self._prev_threads is not None:
            import torch

            torch.set_num_threads(self._prev_threads)
        if self._prev_cuda is not None:
            import torch

            torch.cuda.set_device(self._prev_cuda)

    # -- pytest-benchmark's hooks -----------------------------------------------------------------

    def machine_info(self, machine_info: dict) -> None:
        if self.state is not None:
            machine_info[JSON_KEY] = self.state.settings.fingerprint

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
        if theirs != state.settings.fingerprint:
            raise pytest.UsageError(
                "perfgate refuses to compare against a baseline from another machine fingerprint:\n"
                f"  this machine: {state.settings.fingerprint}\n  baseline:     {theirs}\n"
                "Speedups are only comparable on the same device, threads and torch build. Save a "
                "baseline on this machine (--benchmark-save=NAME), or compare against one saved on "
                "this fingerprint.")
        rows = compared_benchmark.get(JSON_KEY, {}).get("speedups", [])
        # a row saved with pairs timed apart is held to its pairs timed near (docs/gate.md)
        state.stored.speedups = {baseline_key(r["kernel"], r["impl"], r["size"]):
                                 (r["near_speedup"], r["near_low"]) if r.get("near_speedup") is not None
                                 else (r["speedup"], r.get("low", r["speedup"])) for r in rows}
        state.stored.memory = {baseline_key(r["kernel"], r["impl"], r["size"]): r["memory_ratio"]
                                 for r in rows if r.get("memory_ratio") is not None}
        state.stored.path = str(benchmarksession.storage)
        info = compared_benchmark.get("commit_info") or {}
        state.stored.run_id = f"{info.get('id')} {compared_benchmark.get('datetime')}"

    def update_json(self, output_json: dict) -> None:
        """The rows computed in ``finish`` (no timing happens here)."""
        from .roofline import COUNT_RULE

        state = self.state
        if state is None or state.rows is None:
            return
        output_json[JSON_KEY] = {
            "fingerprint": state.settings.fingerprint,
            "slug": state.settings.slug,
            "size": state.settings.size,
            "tolerance": state.settings.tolerance,
            "contended": state.settings.contended,  # the withheld CPU share at which a failing row is unresolved
            "require_floors": self.options.require_floors,  # a declared floor no row checked fails the run
            "floors_applied": state.floors.policy.applied,  # False: CPU floors not applied (threads, malloc)
            "floors_off": state.floors.policy.off,  # why not, e.g. "at --perf-threads 1"; "" when applied
            "baseline": state.stored.run_id,  # the stored run the rows were compared with (commit, time), or None
            "shard": state.shard,  # under --perf-shard: index, count, plan digest, its test functions
            "tests_failed": state.tally.tests_failed,  # a merge of shards fails when any shard's tests failed
            "interrupted": state.interrupted,  # Ctrl-C: partial rows; never saved, refused as a baseline
            "durations": state.tally.durations,  # seconds per test function, setup to teardown: shards' weights
            "speedups": [r.as_dict() for r in state.rows],
            # this machine's measured limits and each impl's place under them (roofline.py)
            "roofline": {"limits": state.limits.values if state.limits else None, "impls": state.tally.figures,
                         "now": state.limits.now if state.limits else None, "count_rule": COUNT_RULE},
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
            state.tally.tests_failed = session.testsfailed
            state.compute_rows()
            state.tally.figures = state.placed()  # every limit a figure needs is measured here, then stored
            state.limits.save()
            if self.against is not None and not state.interrupted:
                self.against.run(state)  # after the rows: compute_rows freed the session's callables
                state.interrupted = self.against.interrupted  # Ctrl-C there: a partial run, never saved
                state.judge_with(self.against.outcomes())
            if self.saving and (state.interrupted or self._failed(session)):
                # a partial run, or one whose tests or gate failed, must not become the newest
                # baseline: the next --benchmark-compare would judge against its regressed numbers
                compat.withhold_save(self.config)
                self.withheld = True
        if self.ledger is not None:
            measured = {(kernel, impl): m.variant for kernel, impls in state.results.items()
                        for impl, m in impls.items()}
            rows = {(r.kernel, r.impl) for r in state.rows or []}
            self.floors_unmeasured = self.ledger.unmeasured(rows, measured,
                                                            policy=state.floors.policy,
                                                            benchmarks_off=not _benchmarks_on(self.config))

    def _failed(self, session: pytest.Session) -> bool:
        """Whether this session fails: a test failed (``-x`` stopped it too), a row missed its floor or
        baseline, or --perf-against found a row slower or could not finish."""
        against = self.against
        return bool(session.testsfailed or any(r.failures for r in self.state.rows or [])
                    or (against is not None and (against.failed() or against.problem)))

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
        return [u for u in self.floors_unmeasured if u.required] if self.options.require_floors else []

    def summary(self, tr: Any) -> None:
        """The table, the declared floors no row checked, the verdict."""
        state = self.state
        if state is None:
            return
        if state.tally.unmeasured:
            tr.write_line(f"perfgate: {state.tally.unmeasured} perf call(s) ran once with benchmarks disabled "
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
        if missed and not self.options.require_floors:
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
            elif not self.options.require_floors:
                tr.write_line(f"NOT MEASURED: {u.line()}", yellow=True, bold=True)

    def _table(self, tr: Any) -> list:
        """The speedup table and the notes under it; the rows."""
        from .stats import APART, PACE_SLOWED, format_table, slowed
        from .stats import apart as apart_reading

        state = self.state
        if not state.floors.policy.applied:
            tr.write_line(f"perfgate: CPU speedup floors are set at torch's default {_DEFAULT_THREADS[0]} "
                          f"thread(s) under --perf-malloc cache; {state.floors.policy.off} they are not applied: "
                          "only a stored baseline (--benchmark-compare) gates the speedups", yellow=True)
        rows = state.compute_rows()
        if state.shard:
            sh = state.shard
            weights = sh["weights_from"] or "equal, no stored run"
            tr.write_line(f"perfgate: shard {sh['index']}/{sh['count']} ran {len(sh['units'])} test function(s), "
                          f"plan {sh['plan']} (weights: {weights}); merge all shards' JSON with "
                          "python -m perfgate.report --merge")
        tr.section(f"perfgate speedups ({state.settings.device}, {state.settings.size}, {state.settings.slug})")
        for line in format_table([r.as_dict() for r in rows]):
            tr.write_line(line)
        for kernel in state.unpaired():
            tr.write_line(f"{kernel}: no reference/optimized pair measured, no speedup", yellow=True)
        if state.tally.not_timed:
            left = ", ".join(state.tally.not_timed)
            tr.write_line(f"perfgate: --perf-gated-only: {len(state.tally.not_timed)} impl(s) not timed, no floor "
                          f"or stored baseline judges them here (a session without it times them): {left}")
        apart = [r for r in rows if r.apart]
        if apart:
            judged = ("a miss there is judged on the pairs timed near" if math.isfinite(state.settings.contended)
                      else "--perf-contended inf: every row judged on all its pairs")
            tr.write_line(f"perfgate: the host ran torch's threads apart (a cache-line round trip over "
                          f"{APART:.0f}x this machine's usual placement, {state.near_round_trip_ns:.0f} ns) "
                          f"beside {len(apart)} row(s)' pairs; {judged} "
                          "(docs/gate.md, \"The threads' placement\")")
            if all(apart_reading(ns, state.near_round_trip_ns) for ns in state.round_trips()):
                tr.write_line(f"perfgate: every pair of this session ran with torch's threads apart, against "
                              f"the {state.near_round_trip_ns:.0f} ns this machine's limits.json holds as its "
                              "usual placement (the median of its last sessions', or the nearest a file from "
                              "before them holds): each session joins them, so a host that moved for good reads "
                              "its new placement as usual in time; "
                              "--perf-remeasure-limits starts the file anew", yellow=True)
        paced = [r for r in rows if r.slowed]
        if paced:
            judged = ("a miss there is judged on the pairs timed at the usual pace"
                      if math.isfinite(state.settings.contended) else "--perf-contended inf: every row judged on "
                      "all its pairs")
            tr.write_line(f"perfgate: the host ran the timing thread's core slowed (a pace probe over "
                          f"{PACE_SLOWED:.2f}x this machine's usual {state.usual_pace_ns / 1e3:.0f} us) beside "
                          f"{len(paced)} row(s)' pairs; {judged} (docs/gate.md, \"The core's pace\")")
            if all(slowed(ns, state.usual_pace_ns) for ns in state.paces()):
                tr.write_line(f"perfgate: every pair of this session ran on a core slower than the "
                              f"{state.usual_pace_ns / 1e3:.0f} us this machine has shown as its usual pace (its "
                              "limits.json's sessions, or this session's scan of its CPUs): each session joins "
                              "them, so a host that slowed for good reads its new pace as usual in time; "
                              "--perf-remeasure-limits starts the file anew", yellow=True)
        if state.tally.placement_wait >= 0.1:
            tr.write_line(f"perfgate: waited {state.tally.placement_wait:.1f} s, in all, for the host to run the "
                          "pairs as it usually does (torch's threads near, the core at its usual pace) before "
                          "timing rows further")
        for row in state.memory_unmeasured():
            tr.write_line(f"{row}: a memory floor is declared but this platform gives no peak memory "
                          "(CUDA, or Linux /proc/self/clear_refs): memory not gated", yellow=True)
        self._roofline(tr)
        self._baseline_note(tr, rows)
        return rows

    def _roofline(self, tr: Any) -> None:
        """Each impl's place under this machine's roofline, with the limits it is measured against."""
        from .roofline import format_placed, now_line

        state = self.state
        if state.limits is None or not any(e["fraction"] is not None or e["note"] for e in state.tally.figures):
            return
        threads = state.settings.threads or "default"
        tr.write_line(f"perfgate roofline at {threads} thread(s): {state.limits.line()} "
                      f"({state.limits.path or 'not stored'}); roofline = max(bytes moved / the faster "
                      "of stream and write rate, bytes written / write rate, GFLOP / GEMM peak) over the impl's "
                      "median, 100% the machine's limit (docs/perfgate.md)")
        if state.tally.limits_rose:
            tr.write_line("perfgate roofline: an impl passed a stored limit, measured again and kept as the "
                          f"best this machine has shown: {', '.join(state.tally.limits_rose)}")
        if state.tally.limits_read:
            tr.write_line("perfgate roofline: the session's reading after its rows passed a stored limit, kept as "
                          f"the best this machine has shown: {', '.join(state.tally.limits_read)}")
        now = now_line(state.limits.values, state.limits.now)
        if now:
            tr.write_line(f"perfgate roofline: {now} (a figure reads against the best this machine has shown; "
                          "the host gave this share of it when read)")
        for line in format_placed(state.tally.figures):
            tr.write_line(line)

    def _baseline_note(self, tr: Any, rows: list) -> None:
        """What became of the stored baseline: saved, not saved (interrupted), compared, or none."""
        from .stats import imprecise, loose_baseline

        state = self.state
        slug = state.settings.slug
        if self.saving and state.interrupted:
            tr.write_line(f"interrupted: nothing saved as a baseline for {slug} (its rows are partial; "
                          "--benchmark-json, if given, marks them interrupted)", yellow=True)
        elif self.saving and self.withheld:
            tr.write_line(f"the session failed: nothing saved as a baseline for {slug} (a failing run must not "
                          "become what the next --benchmark-compare judges against); fix it and save again",
                          yellow=True)
        elif self.saving:
            tr.write_line(f"saved these speedups as a baseline for {slug}")
            unjudged = [f"{r.kernel} [{r.impl}]" for r in rows if (r.apart or r.slowed) and r.near_speedup is None]
            if unjudged:
                tr.write_line(f"{len(unjudged)} saved row(s) had too few pairs timed with torch's threads near "
                              f"and the core at its usual pace to stand for this machine: {', '.join(unjudged)}; "
                              "save again when the host runs them as usual (docs/gate.md, \"The threads' "
                              "placement\" and \"The core's pace\")", yellow=True)
            wide = [f"{r.kernel} [{r.impl}] {r.speedup:.2f}x ({r.low:.2f}-{r.high:.2f}x)" for r in rows
                    if imprecise(r, state.settings.tolerance)]
            if wide:
                half = state.settings.tolerance / 2
                tr.write_line(f"{len(wide)} saved row(s) are wider than a baseline should be (their 95% interval "
                              f"reaches past {half:.0%} of the speedup) after the --perf-extend budget: "
                              f"{', '.join(wide)}; a later --benchmark-compare catches less against them. Save "
                              "again on a quieter host, or with a longer --perf-extend", yellow=True)
        elif state.stored.speedups is None:
            tr.write_line(f"no stored baseline compared for {slug}: save one on this machine with "
                          "--benchmark-save=NAME, then --benchmark-compare gates against it")
        else:
            matched = sum(r.baseline is not None for r in rows)
            tr.write_line(f"compared against baseline in {state.stored.path}: {matched} of {len(rows)} "
                          f"row(s) have a stored speedup at size {state.settings.size}")
            half = state.settings.tolerance / 2
            loose = [f"{r.kernel} [{r.impl}] {r.baseline:.2f}x (from {r.baseline_low:.2f}x)" for r in rows
                     if loose_baseline(r, state.settings.tolerance)]
            if loose:
                tr.write_line(f"{len(loose)} gated row(s) of that baseline have an interval reaching more than "
                              f"{half:.0%} under their speedup: {', '.join(loose)}; a drop must clear that low to "
                              "fail, so they catch less. Save a new baseline (--benchmark-save): a save measures "
                              "each row until it is precise", yellow=True)

    def _verdict(self, tr: Any, rows: list) -> None:
        from .stats import verdict

        state = self.state
        what = state.floors.policy.held_to()
        budget = f"--perf-extend {state.settings.extend_s:g} s{', interrupted' if state.interrupted else ''}"
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
