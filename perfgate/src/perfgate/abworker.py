"""One side's worker process for ``--perf-against``: it imports the project's library from its
side's root (REV's copy, or the working tree), rebuilds a perf test's timed callable from the
working tree's test file, and times blocks of it when the session asks.

Both sides run in workers spawned alike, so neither has the pytest process's heap, imports or
thread pools (the same code timed in pytest and in a child read 0.93x). The session talks to a
worker over a ``multiprocessing`` pipe: ``build`` a row, time a ``block`` of it, ``drop`` it.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType
from typing import Any

# the fixtures a rebuilt perf test may take, besides its parameters
FIXTURES = ("perf", "perf_device", "perf_size", "tmp_path")


class RootFinder(MetaPathFinder):
    """Imports the top-level packages named in ``library`` (and everything under them) from
    ``root`` only: a module absent there raises, never falls back to another copy (the working
    tree's on sys.path, or an editable install's finder)."""

    def __init__(self, root: Path, library: Sequence[str]) -> None:
        self.root, self.library = Path(root), frozenset(library)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in self.library:
            return None
        where = [str(self.root)] if top == fullname else list(path or [])
        spec = PathFinder.find_spec(fullname, where)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r} in {self.root}", name=fullname)
        return spec


class Captured(BaseException):  # noqa: N818 - not an error: the test body stops at its perf call
    """Raised by ``CaptureCase`` to stop a test body at its ``perf(...)`` call (a BaseException, so
    an ``except Exception`` in the body does not swallow it)."""


@dataclass
class Call:
    """What a test passed to ``perf``."""

    fn: Callable[..., Any]
    setup: Callable[[], Any] | None
    label: str
    warmup_rounds: int
    work_bytes: float | None
    variant: str | None


class CaptureCase:
    """Stands in for the ``perf`` fixture: records the call and stops the test there."""

    def __init__(self, kernel: str, impl: str, device: str, size: str) -> None:
        self.kernel, self.impl, self.device, self.size = kernel, impl, device, size
        self.call: Call | None = None

    def __call__(self, fn: Callable[..., Any], *, setup: Callable[[], Any] | None = None, label: str = "",
                 rounds: int | None = None, warmup_rounds: int = 2, work_bytes: float | None = None,
                 variant: str | None = None) -> Any:
        self.call = Call(fn, setup, label, warmup_rounds, work_bytes, variant)
        raise Captured


class NotComparable(Exception):
    """This side cannot rebuild the row; the message says why."""


def load_module(name: str, path: Path) -> ModuleType:
    """The test file at ``path`` imported as ``name`` (pytest's module name for it), once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotComparable(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise NotComparable(f"importing {path.name} failed: {type(exc).__name__}: {exc}") from exc
    return module


def capture(module: ModuleType, function: str, params: dict[str, Any], case: CaptureCase, tmp: Path) -> Call:
    """Run test ``function`` of ``module`` with ``params`` up to its ``perf`` call and return it."""
    func = getattr(module, function, None)
    if func is None:
        raise NotComparable(f"{module.__name__} has no {function}")
    if getattr(func, "is_hypothesis_test", False):
        raise NotComparable(f"{function} is a hypothesis test: calling it would run its examples")
    fixtures = {"perf": case, "perf_device": case.device, "perf_size": case.size, "tmp_path": tmp}
    kwargs = {}
    for name in inspect.signature(func).parameters:
        if name in params:
            kwargs[name] = params[name]
        elif name in fixtures:
            kwargs[name] = fixtures[name]
        else:
            raise NotComparable(f"{function} takes the fixture {name!r}; --perf-against rebuilds a perf test with "
                                f"its parameters and {', '.join(FIXTURES)} only")
    import pytest

    try:
        func(**kwargs)
    except Captured:
        assert case.call is not None
        return case.call
    except pytest.skip.Exception as exc:
        raise NotComparable(f"skipped: {exc}") from exc
    except pytest.fail.Exception as exc:
        raise NotComparable(f"{function} failed before its perf call: {exc}") from exc
    except Exception as exc:
        raise NotComparable(f"{function} failed before its perf call: {type(exc).__name__}: {exc}\n"
                            f"{traceback.format_exc(limit=-3)}") from exc
    raise NotComparable(f"{function} returned without calling perf(...)")


@dataclass(frozen=True)
class Hello:
    """A worker's settings: the same for both sides, but ``side``, ``root`` and ``wrap``."""

    side: str  # "rev" or "this"
    root: str  # where the library packages are imported from
    library: tuple[str, ...]
    device: str
    size: str
    threads: int | None
    malloc: str
    scratch: str | None = None  # where the tests' tmp_path folders go (removed with it)
    wrap: Any = None  # hooks.pytest_perfgate_wrap_timed's wrapper: this tree's side only
    # the session's timer settings: --perf-l2-flush, --benchmark-timer's clock, --benchmark-disable-gc
    l2_flush: bool = False
    host_timer: Any = None  # None: time.perf_counter
    disable_gc: bool = False


MEMORY_RESERVE = 2 << 30  # bytes of the host's memory a worker's extra copies leave free, beyond the others' first


def copy_fits(size: int, others: int, first: int, available: int | None = None) -> bool:
    """One more copy of ``size`` bytes fits in the host's memory (``timing.available_memory``, read
    now unless given): beside it, ``first`` bytes for each of the ``others`` workers still to build
    (what this worker grew by for its first copy, the row's module and one-time costs included),
    and MEMORY_RESERVE left. Every copy of every worker is alive at once (docs/perfgate.md, "Units"),
    so workers making their copies with no thought for the others' outgrew a 24 GB host at 4 a side.
    True where the memory is not read."""
    from .timing import available_memory

    available = available_memory() if available is None else available
    return available is None or available >= size + others * first + MEMORY_RESERVE


def _grown(before: int | None, after: int | None) -> int:
    """Bytes a reading grew by (VmRSS before and after); 0 where either is unread."""
    return max(0, after - before) if before is not None and after is not None else 0


class Worker:
    """A worker's state: its settings, timer and the rows it has built."""

    def __init__(self, hello: Hello) -> None:
        from .timing import configure_malloc

        self.hello = hello
        self.malloc = configure_malloc(hello.malloc) if hello.device == "cpu" else "n/a"  # before any allocation
        sys.dont_write_bytecode = True  # leave no __pycache__ in REV's copy or the working tree
        sys.meta_path.insert(0, RootFinder(Path(hello.root), hello.library))
        from .timing import HostLoad, timer_for

        self.torch_set = False  # torch's settings are applied once a row's module has imported torch
        if hello.device.startswith("cuda"):
            self._torch()
        # each block at another place of the heap: where a worker's heap happened to put a row's
        # buffers would hold all its blocks off the other workers' (timing.HeapShift)
        self.timer = timer_for(hello.device, l2_flush=hello.l2_flush, disable_gc=hello.disable_gc,
                               shift_heap=self.malloc == "cache",
                               **({"host_timer": hello.host_timer} if hello.host_timer is not None else {}))
        self.host = HostLoad(hello.threads or 1)
        self.tmp = Path(tempfile.mkdtemp(prefix="perfgate-worker-", dir=hello.scratch))
        self.rows: dict[str, tuple[Any, Any]] = {}
        if hello.threads is not None:
            from threadpoolctl import threadpool_limits

            self.limits = threadpool_limits(limits=hello.threads)

    def _torch(self) -> None:
        """The session's torch threads and GPU, once: at the start on CUDA, else after the first
        row's module imported torch (a library without torch never loads it, 2 s a worker)."""
        if self.torch_set:
            return
        import torch

        if self.hello.threads is not None:
            torch.set_num_threads(self.hello.threads)
        if self.hello.device.startswith("cuda"):
            index = torch.device(self.hello.device).index  # plain "cuda": torch's current GPU
            torch.cuda.set_device(torch.cuda.current_device() if index is None else index)
        self.torch_set = True

    def build(self, row: str, module: str, path: str, function: str, params: dict[str, Any],
              kernel: str, impl: str, builds: int = 1, build_s: float = 0.0, others: int = 0) -> dict[str, Any]:
        """Rebuild ``row``'s timed callable (its inputs, model, buffers) up to ``builds`` times, each
        kept: the blocks then pick one at random, so an allocation's layout varies within the
        process as it does between processes. Another copy is made while the copies after the
        first, and one more as long as the last, fit in ``build_s`` (the first pays the row's
        one-time costs), and one more as large as the last fits in the host's memory beside a copy
        for each of the ``others`` workers that build after this one (``copy_fits``). Reports the
        first copy's first and warm call, and how many were made."""
        from .timing import proc_status_bytes

        self.rows.pop(row, None)  # a rebuild's copies replace the row's: the old ones are not counted in
        # VmRSS counts the libraries every process shares too: it errs towards fewer copies
        loaded = proc_status_bytes("VmRSS")
        load_module(module, Path(path))  # the test module's first import is no copy's cost in time
        made, took, spent, size, first = [], 0.0, 0.0, 0, 0
        while not made or (len(made) < builds and spent + took <= build_s and copy_fits(size, others, first)):
            start, before = time.perf_counter(), proc_status_bytes("VmRSS")
            made.append(self._build_one(module, path, function, params, kernel, impl))
            after = proc_status_bytes("VmRSS")
            # what the copy holds, its first calls' temporaries included (resident under the cache mode),
            # and for the first the module's import too: what a worker yet to build grows by
            size = _grown(before, after)
            if len(made) == 1:
                first = _grown(loaded, after)
            took = time.perf_counter() - start
            spent += took if len(made) > 1 else 0.0
        self.rows[row] = [timed for timed, _ in made]
        return {**made[0][1], "builds": len(made)}

    def _build_one(self, module: str, path: str, function: str, params: dict[str, Any], kernel: str,
                   impl: str) -> tuple[Any, dict[str, Any]]:
        """One copy of a row: its timed callable, and its first and warm call's seconds."""
        from .hooks import wrapped
        from .timing import synced

        hello = self.hello
        tmp = Path(tempfile.mkdtemp(dir=self.tmp))
        loaded = load_module(module, Path(path))
        if "torch" in sys.modules:
            self._torch()
        call = capture(loaded, function, params, CaptureCase(kernel, impl, hello.device, hello.size), tmp)
        fn = wrapped(hello.wrap, impl, call.fn)
        timed = (fn, call.setup)
        run = synced(fn, hello.device)
        prepared = None if call.setup is None else synced(call.setup, hello.device)
        once = run if prepared is None else (lambda: run(prepared()))
        # the first call runs past the largest spacer a block holds (timing.HeapShift), so the heap has
        # grown about as far as a block's buffers can land and its pages are resident: a call too long for a
        # warming call is then not timed faulting them; the warm call runs past one of random size, as blocks do
        t0 = time.perf_counter()
        with self.timer.shifted(largest=True):
            once()
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        with self.timer.shifted():
            once()
        warm = self.timer.cost(time.perf_counter() - t1)
        for _ in range(max(0, call.warmup_rounds - 2)):
            once()
        return timed, {"first_s": first, "warm_s": warm, "label": call.label, "variant": call.variant}

    def block(self, row: str, calls: int, warm: int, build: int = 0, cpu: int | None = None) -> dict[str, Any]:
        """Seconds of ``calls`` timed calls of copy ``build`` of ``row`` after ``warm`` untimed ones,
        and the CPU time the host withheld while the timed calls ran (``HostLoad.share``). With
        ``cpu``, the block runs on that CPU alone (the pair's: ``abrun.Comparer.pairs``), and the
        worker is allowed its CPUs again after."""
        timed = self.rows[row][build]
        start: list[Any] = []
        from .timing import allow, pin

        allowed = None if cpu is None else pin(cpu)  # refused: the block runs where the worker is
        try:
            times = self.timer.block(timed, calls, warm, warmed=lambda: start.append(self.host.read()))
        finally:
            if allowed is not None:
                allow(allowed)
        share = self.host.share(start[0] if start else None, self.host.read())
        return {"times": times, "share": share}


def serve(conn: Any, hello: Hello) -> None:
    """A worker's loop (``multiprocessing`` target): answer the session's requests until ``exit``
    or until the session's end of the pipe closes. Every answer is a dict with ``ok``; a failure
    carries ``reason``. Ctrl-C is the session's to handle (it closes the pool): ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(hello)
    except Exception as exc:  # noqa: BLE001 - reported to the session, which names the side
        conn.send({"ok": False, "reason": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"ok": True, "pid": os.getpid(), "malloc": worker.malloc})
    try:
        while True:
            try:
                op, kwargs = conn.recv()
            except (EOFError, OSError):  # the session is gone
                return
            if op == "exit":
                return
            try:
                if op == "drop":
                    worker.rows.pop(kwargs["row"], None)
                    answer: dict[str, Any] = {}
                else:
                    answer = getattr(worker, op)(**kwargs)
                conn.send({"ok": True, **answer})
            except NotComparable as exc:  # the rebuild's own limit, on either side: no verdict, no failure
                conn.send({"ok": False, "reason": str(exc), "not_comparable": True})
            except Exception as exc:  # noqa: BLE001 - the row is not comparable; the worker goes on
                reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
                conn.send({"ok": False, "reason": reason})
    finally:
        shutil.rmtree(worker.tmp, ignore_errors=True)
