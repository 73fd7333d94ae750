"""The worker processes of ``--perf-against``: several a side, spawned alike (``multiprocessing``'s
spawn start method: a fresh interpreter each, no state inherited from the pytest process), and
each request answered within a deadline or the worker is stopped."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field
from typing import Any

from .abworker import Hello, serve

SIDES = ("rev", "this")


class WorkerGone(Exception):
    """A worker died or missed its deadline; the message says which and how."""


@dataclass
class Handle:
    """One worker: its side, process and the session's end of its pipe."""

    side: str
    index: int
    process: Any
    conn: Any
    pid: int | None = None

    @property
    def name(self) -> str:
        return f"{self.side} worker {self.index} (pid {self.pid or self.process.pid})"


@dataclass
class Pool:
    """``per_side`` workers for each side, started in the order rev, this, rev, this."""

    hellos: dict[str, Hello]
    per_side: int = 2
    start_s: float = 120.0  # a worker that is not up by then (importing torch) is stopped
    workers: list[Handle] = field(default_factory=list)

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for index in range(self.per_side):
            for side in SIDES:
                mine, theirs = context.Pipe()
                process = context.Process(target=serve, args=(theirs, self.hellos[side]), daemon=True,
                                          name=f"perfgate-{side}-{index}")
                process.start()
                theirs.close()
                self.workers.append(Handle(side, index, process, mine))
        for worker in list(self.workers):
            reply = self._answer(worker, self.start_s)
            if not reply.get("ok"):
                self.close()
                raise WorkerGone(f"{worker.name} could not start: {reply.get('reason')}")
            worker.pid = reply["pid"]

    def side(self, name: str) -> list[Handle]:
        return [w for w in self.workers if w.side == name]

    def ask(self, worker: Handle, op: str, timeout_s: float, **kwargs: Any) -> dict[str, Any]:
        """Send ``op`` to ``worker`` and return its answer; a worker that dies or does not answer in
        ``timeout_s`` is stopped, dropped from the pool, and raises WorkerGone."""
        try:
            worker.conn.send((op, kwargs))
        except (BrokenPipeError, OSError) as exc:
            self._drop(worker)
            raise WorkerGone(f"{worker.name} is gone (exit {worker.process.exitcode})") from exc
        return self._answer(worker, timeout_s)

    def _answer(self, worker: Handle, timeout_s: float) -> dict[str, Any]:
        try:
            ready = worker.conn.poll(timeout_s)
            if ready:
                return worker.conn.recv()
        except (EOFError, OSError):
            ready = True
        self._drop(worker)
        if not ready:
            raise WorkerGone(f"{worker.name} did not answer in {timeout_s:.0f} s")
        raise WorkerGone(f"{worker.name} died (exit {worker.process.exitcode})")

    def _drop(self, worker: Handle) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
        worker.process.kill()
        worker.process.join(5)
        worker.conn.close()

    def close(self) -> None:
        """Stop every worker (idempotent): ``exit``, then a kill for one still running after 5 s."""
        for worker in self.workers:
            try:
                worker.conn.send(("exit", {}))
            except (BrokenPipeError, OSError):
                pass
        for worker in self.workers:
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5)
            worker.conn.close()
        self.workers.clear()
