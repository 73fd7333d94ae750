"""Declared floors and the rows that check them.

A floor (``@pytest.mark.speedup`` or ``@pytest.mark.memory``) is checked only when its row is
measured: its impl and the impl it is compared with (the reference, and with ``over=`` the peer)
both timed in the session. A row can go unmeasured without anything failing: ``-k optimized``
deselects the reference, a peer library is missing and its impl skips, a reference errors. This
module lists the floors the session's perf tests declare for its device class and size
(``declared``), records what became of each perf test (``Ledger``), and at the session's end
names every floor whose row was not measured, with why (``Ledger.unmeasured``). Whether the
session applies its CPU speedup floors at all is ``FloorPolicy``, which the session, the case,
the ledger, the merge and the report all consult.

It imports pytest only: it runs at collection, before a perf session loads numpy and scipy.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pytest

REFERENCE = "reference"  # what every other impl is compared with
OPTIMIZED = "optimized"  # the impl a marker without impl= is about
KINDS = ("speedup", "memory")


@dataclass(frozen=True)
class FloorPolicy:
    """Whether a session applies its speedup floors: CPU floors are claims at torch's default
    threads under the caching malloc, where they were measured. Under glibc's default malloc a
    kernel returning a large fresh tensor page-faults it on every call, so a floor set under cache
    says nothing there. Memory floors and CUDA floors always apply."""

    off: str = ""  # why speedup floors are not applied ("at --perf-threads 1"), "" when they are

    @classmethod
    def for_session(cls, device: str, threads: int | None, default_threads: int | None,
                    malloc: str) -> FloorPolicy:
        if device != "cpu":
            return cls()
        if threads is not None and threads != default_threads:
            return cls(f"at --perf-threads {threads}")
        return cls(f"under --perf-malloc {malloc}" if malloc != "cache" else "")

    @property
    def applied(self) -> bool:
        return not self.off

    def applies(self, kind: str) -> bool:
        """Whether floors of ``kind`` ("speedup" or "memory") are checked in this session."""
        return kind != "speedup" or not self.off

    @property
    def note(self) -> str:
        """What a row whose speedup floor is not applied says about it."""
        return f"not applied {self.off}"

    def held_to(self) -> str:
        """What the passed rows were held to: their floors, or none and why."""
        return "at or above their floors" if not self.off else f"without speedup floors ({self.note})"


def comparison(impl: str, over: str) -> str:
    """The row name of ``impl`` timed against ``over`` (a peer) instead of the reference."""
    return f"{impl} vs {over}"


def parametrized_impls(item: pytest.Item) -> list[str]:
    """The values the test parametrizes ``impl`` over."""
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if names == ["impl"]:  # values, or pytest.param(value, ...) sets
            return [str(v.values[0]) if hasattr(v, "marks") else str(v) for v in mark.args[1]]
    return []


def kernel_name(item: pytest.Item) -> tuple[str, str] | None:
    """(kernel, impl) of a perf test: the kernel is the test's name without ``test_`` plus its
    other parameters (``rope_attention_s128[True]``); None when it is not parametrized over impl."""
    callspec = getattr(item, "callspec", None)
    params = dict(callspec.params) if callspec else {}
    if "impl" not in params:
        return None
    impl = str(params.pop("impl"))
    name = getattr(item, "originalname", item.name).removeprefix("test_")
    extra = ",".join(str(v) for v in params.values())
    return (f"{name}[{extra}]" if extra else name), impl


def floor_value(mark: pytest.Mark, device: str, size: str) -> float | None:
    """The floor ``mark`` declares for ``device``'s class (cpu or cuda) at ``size``, or None."""
    value = mark.kwargs.get("cuda" if device.startswith("cuda") else "cpu")
    if isinstance(value, dict):
        value = value.get(size)
    return None if value is None else float(value)


@dataclass(frozen=True)
class Floor:
    """One floor a perf test declares for this session's device class and size."""

    kernel: str
    impl: str  # the impl the floor is on
    over: str | None  # the impl it is timed against when not the reference (a peer)
    kind: str  # "speedup" or "memory"
    value: float
    variant: str | None  # fnmatch pattern: the floor applies only to a run whose variant matches
    impls: tuple[str, ...]  # the test's impl values

    @property
    def row(self) -> str:
        return self.impl if self.over is None else comparison(self.impl, self.over)

    def describe(self) -> str:
        what = f"speedup floor {self.value:.2f}x" if self.kind == "speedup" else \
            f"memory floor {self.value:.0%} saved"
        keyed = f" for variant {self.variant!r}" if self.variant is not None else ""
        return f"{self.kernel} [{self.row}]: {what}{keyed}"


def checked_value(item: pytest.Item, mark: pytest.Mark, kind: str, device: str, size: str) -> float | None:
    """The floor a ``speedup`` or ``memory`` marker declares for ``device``'s class at ``size``
    (None: none there); a malformed marker is a usage error naming the test. The one reading of
    the markers: at collection (``declared``) and when a row's floors are set (case.py)."""
    if mark.args:
        raise pytest.UsageError(f"{item.nodeid}: {kind} marker takes keywords cpu=, cuda=, impl=, variant=, over=")
    if kind == "memory" and "over" in mark.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: a memory floor is over the reference; over= is for speedups")
    try:
        value = floor_value(mark, device, size)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{item.nodeid}: a {kind} floor is a number, or {{size: number}} per size; got "
                                f"{mark.kwargs}") from None
    if kind == "memory" and value is not None and not 0.0 <= value < 1.0:
        raise pytest.UsageError(f"{item.nodeid}: a memory floor is a fraction saved in [0, 1), got {value:g}")
    return value


def _floor(item: pytest.Item, mark: pytest.Mark, kind: str, kernel: str, impls: tuple[str, ...], device: str,
           size: str) -> Floor | None:
    """The floor ``mark`` declares here, or None."""
    value = checked_value(item, mark, kind, device, size)
    if value is None:
        return None
    return Floor(kernel=kernel, impl=str(mark.kwargs.get("impl", OPTIMIZED)), over=mark.kwargs.get("over"),
                 kind=kind, value=value, variant=mark.kwargs.get("variant"), impls=impls)


def declared(items: Iterable[pytest.Item], device: str,
             size: str) -> tuple[list[Floor], dict[tuple[str, str], str]]:
    """The floors the perf tests among ``items`` declare for ``device``'s class at ``size`` (each
    once, though every impl of a test carries its markers), and each perf test's node id by
    (kernel, impl)."""
    floors: dict[tuple, Floor] = {}
    nodeids: dict[tuple[str, str], str] = {}
    for item in items:
        names = kernel_name(item) if "perf" in getattr(item, "fixturenames", ()) else None
        if names is None:
            continue
        nodeids[names] = item.nodeid
        impls = tuple(parametrized_impls(item))
        for kind in KINDS:
            for mark in item.iter_markers(kind):
                floor = _floor(item, mark, kind, names[0], impls, device, size)
                if floor is not None:
                    floors.setdefault((floor.kernel, floor.row, kind, floor.value, floor.variant), floor)
    return list(floors.values()), nodeids


@dataclass(frozen=True)
class Unmeasured:
    """A declared floor whose row was not measured, and why."""

    floor: Floor
    reason: str  # "reference deselected", "skipped (...)", ...
    required: bool  # it applies here for certain: --perf-require-floors fails the session on it

    def line(self) -> str:
        text = f"{self.floor.describe()} not measured: {self.reason}"
        if not self.required:  # a variant-keyed floor of an impl its own test skipped (Ledger._required)
            text += "; the skipped test reported no variant, so whether the floor applies here is unknown"
        return text

    def as_dict(self) -> dict:
        f = self.floor
        return {"kernel": f.kernel, "impl": f.row, "kind": f.kind, "floor": f.value, "variant": f.variant,
                "reason": self.reason, "required": self.required}

    @classmethod
    def from_dict(cls, d: dict) -> Unmeasured:
        """One read back from a run's JSON (``as_dict``): its row name stands as the floor's impl."""
        floor = Floor(kernel=d["kernel"], impl=d["impl"], over=None, kind=d["kind"], value=d["floor"],
                      variant=d["variant"], impls=())
        return cls(floor, d["reason"], d["required"])


@dataclass
class Ledger:
    """What became of each perf test of the session: deselected, or its first report that did not
    pass (failed, errored, skipped), or passed. Filled from pytest's hooks by the session."""

    floors: list[Floor]
    nodeids: dict[tuple[str, str], str]  # (kernel, impl) -> node id, collected or deselected
    deselected: set[str] = field(default_factory=set)
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> "failed", "skipped (why)", ...
    passed: set[str] = field(default_factory=set)  # node ids whose call passed

    def record(self, report: pytest.TestReport) -> None:
        """One phase's report; the first phase that did not pass says why a test measured nothing."""
        nodeid = report.nodeid
        if report.passed:
            if report.when == "call":
                self.passed.add(nodeid)
            return
        if nodeid in self.outcomes:
            return
        if hasattr(report, "wasxfail"):
            self.outcomes[nodeid] = f"xfailed ({report.wasxfail})" if report.skipped else "xpassed (strict)"
        elif report.skipped:
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.outcomes[nodeid] = f"skipped ({str(why).removeprefix('Skipped: ')})"
        elif report.when == "call":
            self.outcomes[nodeid] = "failed"
        else:
            self.outcomes[nodeid] = f"errored at {report.when}"

    def unmeasured(self, rows: set[tuple[str, str]], measured: Mapping[tuple[str, str], str | None], *,
                   policy: FloorPolicy, benchmarks_off: bool) -> list[Unmeasured]:
        """Every floor whose row is not among ``rows`` ((kernel, row name) measured) and that
        applies here (``policy``), with why. ``measured``: (kernel, impl) timed -> the variant it
        reported. ``benchmarks_off``: --benchmark-disable, so a test that passed ran its impl
        once, untimed."""
        out = []
        for floor in self.floors:
            if (floor.kernel, floor.row) in rows or not policy.applies(floor.kind):
                continue
            own = self._status(floor, floor.impl, measured, benchmarks_off)
            variant = measured.get((floor.kernel, floor.impl))
            if floor.variant is not None and own is None and not fnmatch.fnmatchcase(variant or "", floor.variant):
                continue  # its impl ran a variant the floor is not for: the floor does not apply
            out.append(Unmeasured(floor, self._reason(floor, measured, benchmarks_off),
                                  required=floor.variant is None or not (own or "").startswith("skipped")))
        return out

    def _reason(self, floor: Floor, measured: Mapping[tuple[str, str], str | None], benchmarks_off: bool) -> str:
        """Why ``floor``'s row was not measured: its own impl's status, else the peer's, else the
        reference's (the session makes rows only for kernels whose reference was measured)."""
        if floor.impl == REFERENCE:
            return "a floor on the reference itself: rows compare another impl with the reference"
        roles = [(floor.impl, "")] + ([(floor.over, f"{floor.over!r} ")] if floor.over else [])
        for impl, who in [*roles, (REFERENCE, "reference ")]:
            status = self._status(floor, impl, measured, benchmarks_off)
            if status is not None:
                return who + status
        return "no row was made from its measurements"

    def _status(self, floor: Floor, impl: str, measured: Mapping[tuple[str, str], str | None],
                benchmarks_off: bool) -> str | None:
        """Why ``impl`` of ``floor``'s test was not timed, or None when it was."""
        if (floor.kernel, impl) in measured:
            return None
        if floor.impls and impl not in floor.impls:
            return f"not one of the test's impls {list(floor.impls)}"
        nodeid = self.nodeids.get((floor.kernel, impl))
        if nodeid is None:
            return "not collected"
        if nodeid in self.deselected:
            return "deselected"
        if nodeid in self.outcomes:
            return self.outcomes[nodeid]
        if nodeid in self.passed:
            return "ran once, untimed (benchmarks disabled)" if benchmarks_off else "passed without timing it"
        return "not run"
