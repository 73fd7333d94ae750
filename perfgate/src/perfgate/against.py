"""``--perf-against REV``: "is this tree slower than REV?", answered in the same session.

After the session's own rows (its speedups and floors), every timed impl the suite makes a claim
about (``case.claimed``: "optimized", and those a marker names) is rebuilt in worker processes,
``--perf-against-workers`` a side: the working tree's perf test bodies, with the library
(``perfgate_against_library``: kernels/, reference/, workloads/ here) imported from the working
tree on one side and from REV's copy on the other. Their blocks are
interleaved pair by pair (``abrun``), so both sides see the same host, threads and allocator,
and the row gets REV's time over this tree's with its interval. A peer row (another library's
code, the same on both sides) and the reference (whose speed is not the question) are not timed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from . import compat
from .abrun import ABRow, Budget, Comparer, judge
from .abworker import Hello
from .checkout import CheckoutError, Revision, checked_out, resolve, scratch_folder
from .workers import Pool, WorkerGone

INI = "perfgate_against_library"
BUILD_INI = "perfgate_against_build"
# imports the library packages REV has, from REV's copy only (abworker.RootFinder), in a fresh
# process, and prints the compiled modules they loaded
COMPILED = "perfgate compiled modules: "  # the import check's line, found among what the library prints
# then each compiled module found in REV's packages, as a library may import one only when it is first
# used: the line names those that load
IMPORT_CHECK = ("import importlib, json, sys; from pathlib import Path; from perfgate.abworker import RootFinder; "
                "from perfgate.against import COMPILED, compiled_files, compiled_modules, try_import; "
                "sys.meta_path.insert(0, RootFinder(Path(sys.argv[1]), sys.argv[2:])); "
                "[importlib.import_module(name) for name in sys.argv[2:]]; "
                "[try_import(name) for name in compiled_files(Path(sys.argv[1]), sys.argv[2:])]; "
                "print(COMPILED + json.dumps(compiled_modules(sys.argv[2:])))")


def compiled_modules(packages: list[str]) -> list[str]:
    """The loaded modules of ``packages`` that are compiled extensions (a C part), by name."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.split(".")[0] in packages
                  and str(getattr(module, "__file__", None) or "").endswith(tuple(EXTENSION_SUFFIXES)))


def compiled_files(root: Path, packages: list[str]) -> list[str]:
    """The compiled extensions for this interpreter under ``root``'s ``packages``, as module names
    (``kernels/_rope.cpython-311-x86_64-linux-gnu.so``: ``kernels._rope``), loaded or not."""
    names = set()
    for package in packages:
        for path in (root / package).rglob("*"):
            suffix = next((s for s in EXTENSION_SUFFIXES if path.name.endswith(s)), None)
            if suffix is not None and path.is_file():
                names.add(".".join(path.relative_to(root).with_name(path.name.removesuffix(suffix)).parts))
    return sorted(names)


def stale_builds(root: Path, packages: list[str]) -> list[tuple[str, Path]]:
    """(module name, source) for each compiled module under ``root``'s ``packages`` whose C or C++
    source beside it (same stem: ``_rope.c`` for ``_rope.cpython-311-x86_64-linux-gnu.so``), or a
    header in its folder (which it may include), is newer."""
    stale = []
    for name in compiled_files(root, packages):
        *folder, stem = name.split(".")
        here = root.joinpath(*folder)
        built = [p for p in here.glob(f"{stem}.*") if p.name.endswith(tuple(EXTENSION_SUFFIXES))]
        headers = sorted(p for p in here.iterdir() if p.suffix in (".h", ".hpp"))
        for source in [*(here / (stem + ext) for ext in (".c", ".cc", ".cpp")), *headers]:
            if source.is_file() and built and source.stat().st_mtime > max(p.stat().st_mtime for p in built):
                stale.append((name, source))
    return stale


def try_import(name: str) -> None:
    """Import ``name`` if it loads; one that does not is left out of ``compiled_modules``."""
    with contextlib.suppress(Exception):
        importlib.import_module(name)


def default_library(rootdir: Path, test_paths: set[Path]) -> list[str]:
    """The top-level packages under ``rootdir`` that hold no collected test file: the library."""
    names = []
    for package in sorted(p.parent for p in rootdir.glob("*/__init__.py")):
        if not any(t.is_relative_to(package) for t in test_paths):
            names.append(package.name)
    return names


def defines(path: Path, function: str) -> bool:
    """Whether the Python file at ``path`` exists and defines ``function`` at its top level."""
    try:
        tree = ast.parse(path.read_text(encoding="utf8"))
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == function for n in tree.body)


class Against:
    """One session's comparison with REV: resolved at collection, run at the session's end."""

    def __init__(self, config: pytest.Config, rev: str, per_side: int, tolerance: float, budget_s: float) -> None:
        if per_side < 2:
            raise pytest.UsageError(f"--perf-against-workers must be >= 2 (process effects are averaged over "
                                    f"several workers a side), got {per_side}")
        if not 0.0 < tolerance < 1.0:
            raise pytest.UsageError(f"--perf-against-tolerance must be in (0, 1), got {tolerance}")
        if not budget_s >= 0.0:
            raise pytest.UsageError(f"--perf-against-budget must be seconds >= 0, got {budget_s}")
        self.config, self.rev, self.per_side, self.tolerance = config, rev, per_side, tolerance
        self.budget_s = budget_s
        self.revision: Revision | None = None
        self.items: list[pytest.Item] = []
        self.library: list[str] = []
        self.rows: list[ABRow] = []
        self.seconds = 0.0
        self.interrupted = False
        self.problem = ""  # why the comparison did not run (workers could not start), or ""
        self.notes: list[str] = []  # what the reader should know of how the two sides differ
        self.root: Path | None = None  # REV's copy of the project root, from collection to unconfigure
        self._exit = contextlib.ExitStack()

    def prepare(self, items: list[pytest.Item]) -> None:
        """At collection: resolve REV (a bad one stops the session before anything is timed) and
        keep the perf tests."""
        rootdir = Path(self.config.rootpath)
        try:
            self.revision = resolve(self.rev, rootdir)
        except CheckoutError as exc:
            raise pytest.UsageError(str(exc)) from exc
        folder = self.revision.folder
        if folder is not None and rootdir.resolve() == folder:
            # pytest picks its rootdir before it knows a plugin's options, so the value of
            # "--perf-against FOLDER" written as two words counts there as a test path
            raise pytest.UsageError(
                f"--perf-against {self.rev}: that folder is this session's rootdir, so both sides would time the "
                f"same copy. Give a folder holding another copy; if you wrote the folder as a second word, pytest "
                f"took it for its rootdir: write --perf-against={self.rev}")
        self.items = [item for item in items if "perf" in getattr(item, "fixturenames", ())]
        tests = {Path(item.path) for item in self.items}
        self.library = list(self.config.getini(INI)) or default_library(rootdir, tests)
        if not self.library:
            raise pytest.UsageError(f"--perf-against: no library package found under {rootdir} (a folder with an "
                                    f"__init__.py and no tests); name them in the {INI} ini option")
        if not self.items:
            return
        try:
            self.root = self._exit.enter_context(checked_out(self.revision))
        except CheckoutError as exc:
            raise pytest.UsageError(str(exc)) from exc
        self._build()
        self._check_imports()

    def _build(self) -> None:
        """Run the ``perfgate_against_build`` command in REV's export (a folder REV is used as it
        is), or stop the session naming its error: a library that compiles part of itself would
        otherwise be timed without it on REV's side."""
        assert self.root is not None and self.revision is not None
        command = [sys.executable if arg == "{python}" else arg for arg in self.config.getini(BUILD_INI)]
        if not command or self.revision.folder is not None:
            return
        try:
            done = subprocess.run(command, cwd=self.root, capture_output=True, text=True, errors="replace",
                                  check=False, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.close()
            raise pytest.UsageError(f"--perf-against {self.revision.label}: {BUILD_INI} {command} could not "
                                    f"run in REV's copy: {exc}") from exc
        if done.returncode != 0:
            self.close()
            error = ((done.stderr or done.stdout).strip().splitlines() or ["(no output)"])[-1]
            raise pytest.UsageError(f"--perf-against {self.revision.label}: {BUILD_INI} {command} failed in REV's "
                                    f"copy (exit {done.returncode}): {error}")

    def _check_imports(self) -> None:
        """REV's library packages import (from REV's copy), or the session stops here, naming the error."""
        assert self.root is not None and self.revision is not None
        present = [name for name in self.library if (self.root / name / "__init__.py").is_file()]
        if not present:
            self.close()
            raise pytest.UsageError(f"--perf-against {self.revision.label}: REV has none of the library packages "
                                    f"{self.library} (set the {INI} ini option to name them)")
        done = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(self.root), *present], capture_output=True,
                              text=True, errors="replace", check=False, timeout=600)
        if done.returncode != 0:
            self.close()
            error = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise pytest.UsageError(f"--perf-against {self.revision.label}: REV's library does not import "
                                    f"({', '.join(present)}): {error}")
        # a C part this tree's library loaded and REV's did not: REV's rows run without it
        found = [line.removeprefix(COMPILED) for line in done.stdout.splitlines() if line.startswith(COMPILED)]
        theirs = set(json.loads(found[-1])) if found else set()
        # this tree's: those loaded here so far, and those built in its packages (loaded when first used)
        ours = set(compiled_modules(self.library)) | set(compiled_files(self.config.rootpath, self.library))
        self.notes = [f"REV's copy loaded no {name}, which this tree's library has (a compiled module not built "
                      f"there, or one REV predates): REV's rows run without it" for name in sorted(ours - theirs)]
        # REV's C parts are built afresh; this tree's are whatever its last install left
        self.notes += [f"this tree's {name} was built before {source.name} last changed: this side times the old "
                       f"build (rebuild first: make install, or {BUILD_INI}'s command)"
                       for name, source in stale_builds(self.config.rootpath, self.library)]

    def close(self) -> None:
        """Remove REV's copy (idempotent): at unconfigure, and on a refusal."""
        self._exit.close()
        self.root = None

    def _hello(self, side: str, root: Path, state: Any, scratch: str | None) -> Hello:
        s = state.settings
        malloc = "cache" if s.fingerprint.get("malloc") == "cache" else "default"
        return Hello(side=side, root=str(root), library=tuple(self.library), device=s.device, size=s.size,
                     threads=s.threads, malloc=malloc, scratch=scratch,
                     wrap=state.settings.wrap if side == "this" else None,
                     # the session's own timer settings: both sides timed as its rows were
                     l2_flush=bool(s.fingerprint.get("l2_flush")), host_timer=compat.host_timer(self.config),
                     disable_gc=bool(self.config.getoption("benchmark_disable_gc")))

    def _targets(self, state: Any) -> list[tuple[pytest.Item, str, str]]:
        """(item, kernel, impl) of the rows to compare: the impls the suite makes a claim about
        (``case.claimed``: "optimized" and those a marker names) that this tree ran; not the
        reference, peers or ablations."""
        from .case import claimed
        from .floors import kernel_name

        targets = []
        for item in self.items:
            names = kernel_name(item)
            if names is not None and claimed(item, names[1]) and names[1] in state.results.get(names[0], {}):
                targets.append((item, *names))
        return targets

    def run(self, state: Any) -> None:
        """Time every target row against REV; Ctrl-C ends the phase with what was compared."""
        rootdir = Path(self.config.rootpath)
        targets = self._targets(state)
        if not targets or self.revision is None or self.root is None:
            return
        t0 = time.perf_counter()
        max_time = float(self.config.getoption("benchmark_max_time"))
        budget = Budget(seconds=max_time, extend_s=state.settings.extend_s, total_s=self.budget_s,
                        all_pairs=state.settings.all_visits)
        # the tests' tmp_path folders go in a scratch folder the session owns (the export's, or one of
        # its own for a folder REV), so a worker killed before its cleanup leaves nothing a sweep misses
        scratch = str(self.root.parents[len(Path(self.revision.prefix).parts)] if self.revision.folder is None
                      else self._exit.enter_context(scratch_folder(self.revision.rev)))
        hellos = {"rev": self._hello("rev", self.root, state, scratch),
                  "this": self._hello("this", rootdir, state, scratch)}
        try:
            self._compare(hellos, targets, self.root, rootdir, state, budget)
        except WorkerGone as exc:
            self.problem = str(exc)
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self.seconds = time.perf_counter() - t0
        why = "interrupted" if self.interrupted else self.problem
        for item, kernel, impl in targets[len(self.rows):]:
            self.rows.append(ABRow(kernel, impl, state.settings.size, item.nodeid, reason=why))
        for row in self.rows:
            if row.ratio is None and not row.reason:  # the row being timed when the phase stopped
                row.reason = why
            judge(row, self.tolerance, state.settings.contended)

    def _compare(self, hellos: dict[str, Hello], targets: list, rev_root: Path, rootdir: Path, state: Any,
                 budget: Budget) -> None:
        """Each row's planned pairs in turn on one pool of workers; then, on the same pool, the rows
        whose interval straddles the line, built again and measured further within the extension
        budget (cheapest pair first: the budget a row decided in a few pairs leaves, the next gets);
        then the rows that failed or read faster once more, on fresh workers: a process-level effect
        (a worker's memory layout) does not follow the code into new processes, a slower or faster
        kernel does."""
        again: list[tuple[ABRow, dict]] = []  # rows that failed or read faster, to be timed again
        why: dict[int, str] = {}  # what kept such a row from being timed again, where it was tried
        stopped = "interrupted"  # what ends the phase early if it ends early: Ctrl-C, or a side's last worker lost
        try:
            comparer = self._first_stretch(hellos, targets, rev_root, rootdir, state, budget, again)
            if again:
                self._time_again(hellos, comparer, again, why)
        except WorkerGone as exc:
            stopped = str(exc)
            raise
        finally:  # stopped in either stretch, or a rebuild that failed: the first verdict stands, unconfirmed
            self.notes += [f"{row.kernel} [{row.impl}] was not timed again on fresh workers "
                           f"({why.get(id(row), stopped)}): its first stretch's verdict stands, unconfirmed"
                           for row, _ in again if row.confirm_ratio is None and not row.broken]

    def _first_stretch(self, hellos: dict[str, Hello], targets: list, rev_root: Path, rootdir: Path, state: Any,
                       budget: Budget, again: list[tuple[ABRow, dict]]) -> Comparer:
        """Every row's planned pairs, then the straddling rows' extensions, on one pool; the rows that
        failed or read faster go on ``again`` as they are found (a Ctrl-C later leaves them there)."""
        straddling: list[tuple[ABRow, dict]] = []
        with _started(Pool(hellos, self.per_side)) as pool:
            comparer = Comparer(pool, self.tolerance, budget)
            for item, kernel, impl in targets:
                label = state.results[kernel][impl].label
                row = ABRow(kernel, impl, state.settings.size, item.nodeid, label=label)
                self.rows.append(row)
                relative = Path(item.path).relative_to(rootdir)
                if getattr(item, "cls", None) is not None:  # a worker rebuilds a module's function by name
                    row.reason = (f"a test method ({item.cls.__name__}.{item.originalname}): --perf-against "
                                  "times module-level test functions only")
                    continue
                if not defines(rev_root / relative, item.originalname):
                    row.reason = f"new in this tree: {relative} has no {item.originalname} at REV"
                    continue
                request = {"row": item.nodeid, "module": item.module.__name__, "path": str(item.path),
                           "function": item.originalname, "params": dict(item.callspec.params),
                           "kernel": kernel, "impl": impl}
                try:
                    if comparer.build(row, request):
                        if comparer.time_row(row):
                            straddling.append((row, request))
                        elif judge(row, self.tolerance, state.settings.contended) in ("FAIL", "faster"):
                            again.append((row, request))
                    else:  # a worker may have died in the build: the phase stops when a side has none left
                        _check_sides(pool)
                except WorkerGone as exc:  # a worker died or hung on this row: the others go on
                    row.reason = str(exc)
                    _check_sides(pool)
                comparer.drop(row)
            straddling.sort(key=lambda pending: comparer.planned[pending[0].nodeid].pair_s)
            for k, (row, request) in enumerate(straddling):
                stopped = ""  # what stopped its extension: its pairs so far stand (this tree's worker lost: FAIL)
                try:
                    self._extend(comparer, row, request, len(straddling) - k)
                except WorkerGone as exc:
                    stopped = str(exc)
                except KeyboardInterrupt:
                    stopped = "interrupted"
                    raise
                finally:  # judged on every pair it has, and timed again if it failed, however the extension ended
                    if stopped and not row.broken:
                        self.notes.append(f"{row.kernel} [{row.impl}] stopped being measured further ({stopped}): "
                                          f"judged on the {len(row.rev_times)} pairs it has")
                    outcome = judge(row, self.tolerance, state.settings.contended)
                    if outcome in ("FAIL", "faster") and not row.broken:  # broken: no timing clears it
                        again.append((row, request))
                comparer.drop(row)
                _check_sides(pool)  # a worker lost in the extension or its build: stop when a side has none
        return comparer

    def _time_again(self, hellos: dict[str, Hello], comparer: Comparer, again: list[tuple[ABRow, dict]],
                    why: dict[int, str]) -> None:
        """The rows on ``again`` timed once more on a fresh pool, after every other row, before their
        verdict stands; ``why`` gets what kept a row from it (a rebuild that failed, a worker lost)."""
        with _started(Pool(hellos, self.per_side)) as pool:
            comparer.use(pool)
            for row, request in again:
                first = len(row.rev_times)
                try:
                    fresh = ABRow(row.kernel, row.impl, row.size, row.nodeid)
                    if comparer.build(fresh, request):
                        comparer.confirm(row)
                    else:
                        why[id(row)] = fresh.reason or fresh.broken
                        row.broken = fresh.broken  # this tree's worker broke on it: a failure
                except WorkerGone as exc:
                    why[id(row)] = str(exc)
                    _check_sides(pool)
                finally:
                    if row.confirm_ratio is None:  # not timed again to the end: its first stretch alone
                        for times in (row.rev_times, row.this_times, row.rev_units, row.this_units):
                            del times[first:]
                comparer.drop(row)

    def _extend(self, comparer: Comparer, row: ABRow, request: dict[str, Any], rows_left: int) -> None:
        """A straddling row built again and measured further, where its share of the budget fits a
        pair; a row that cannot be built again stands on its planned pairs, with a note (or FAILs:
        this tree's worker broke on it)."""
        if comparer.extension_s(rows_left) < comparer.planned[row.nodeid].pair_s:
            return
        fresh = ABRow(row.kernel, row.impl, row.size, row.nodeid)
        if comparer.build_again(row, fresh, request):
            comparer.extend(row, rows_left)
            return
        row.broken = fresh.broken  # this tree's worker broke on it: a failure
        if not row.broken:
            self.notes.append(f"{row.kernel} [{row.impl}] could not be built again to be measured further "
                              f"({fresh.reason}): judged on its planned pairs")

    # -- the report -------------------------------------------------------------------------------

    def failed(self) -> list[ABRow]:
        return [r for r in self.rows if r.outcome == "FAIL"]

    def outcomes(self) -> dict[tuple[str, str], str]:
        """Each compared row's outcome by (kernel, impl)."""
        return {(r.kernel, r.impl): r.outcome for r in self.rows}

    def json(self) -> dict[str, Any]:
        rev = self.revision
        return {"rev": self.rev, "sha": rev.sha if rev else None, "folder": str(rev.folder) if rev and rev.folder
                else None, "tolerance": self.tolerance, "workers_per_side": self.per_side, "library": self.library,
                "seconds": self.seconds, "interrupted": self.interrupted, "problem": self.problem,
                "notes": self.notes, "rows": [r.as_dict() for r in self.rows]}

    def lines(self) -> list[tuple[str, str]]:
        """(style, text) lines for the terminal: a table, then the verdict."""
        label = self.revision.label if self.revision else self.rev
        return report_lines(self.rows, label, self.per_side, self.seconds, self.tolerance, self.problem,
                            self.notes)


def report_lines(rows: list[ABRow], label: str, per_side: int, seconds: float, tolerance: float,
                 problem: str = "", notes: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(style, text): the comparison's table and verdict, from the session or from its JSON
    (``perfgate.against``, read back by ``perfgate.report``)."""
    out = [("note", f"perfgate against {label}: REV's time / this tree's (under 1: this tree is slower), "
                    f"{per_side} workers a side, {seconds:.0f} s")]
    header = ("kernel", "impl", "size", "REV ms", "this ms", "REV/this", "95% CI", "pairs", "gate")
    cells = [header]
    for r in rows:
        timed = r.ratio is not None
        cells.append((r.kernel, r.impl, r.size,
                      f"{1e3 * float(np.median(r.rev_times)):.3f}" if timed else "-",
                      f"{1e3 * float(np.median(r.this_times)):.3f}" if timed else "-",
                      f"{r.ratio:.3f}x" if timed else "-",
                      f"{r.low:.3f}-{r.high:.3f}" if timed else "-",
                      str(len(r.rev_times)) if timed else "-", r.outcome))
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out += [("note", "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))) for row in cells]
    out += [("warn", note) for note in notes]
    for r in rows:
        if r.outcome in ("FAIL", "unresolved", "not comparable"):
            style = {"FAIL": "fail", "unresolved": "warn"}.get(r.outcome, "note")
            prefix = {"FAIL": "AGAINST FAILED: ", "unresolved": "unresolved: "}.get(r.outcome, "")
            out.append((style, prefix + r.message))
    if problem:
        out.append(("fail", f"perfgate against {label}: {problem}"))
    failed = [r for r in rows if r.outcome == "FAIL"]
    if failed:
        out.append(("fail", f"against {label}: {len(failed)} row(s) slower than REV"))
    elif problem:  # the session fails on it: no closing line may read as a pass
        out.append(("fail", f"against {label}: the comparison is incomplete, no verdict on the rows it "
                            "could not time"))
    else:
        # an unresolved row was not shown within the tolerance either: counted apart, not as a pass
        counts = {o: sum(r.outcome == o for r in rows) for o in ("ok", "faster", "unresolved")}
        out.append(("pass" if not counts["unresolved"] else "warn",
                    f"against {label}: no row shown slower than REV by more than {tolerance:.0%} ("
                    f"{counts['ok']} within it, {counts['faster']} faster, {counts['unresolved']} unresolved: "
                    "no verdict)"))
    return out


@contextlib.contextmanager
def _started(pool: Pool) -> Iterator[Pool]:
    """``pool`` started, and closed however the block ends."""
    try:
        pool.start()
        yield pool
    finally:
        pool.close()


def _check_sides(pool: Pool) -> None:
    """Stop the phase when a side has no worker left."""
    for side in ("rev", "this"):
        if not pool.side(side):
            raise WorkerGone(f"every {side} worker is gone")
