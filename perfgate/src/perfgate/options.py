"""perfgate's ``--perf-*`` options: their table (flag, default, help), their registration, and
``Options``, the values one session was given, read and checked once at configure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

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
                            "floor or its stored baseline's line, before it is reported unresolved, or, in a "
                            "session saving a baseline, while its interval reaches past half the tolerance of its "
                            "speedup (default 60; 0: never extend)"),
    ("--perf-contended", 0.05, "share of the CPU time the host may withhold while a row's pairs run (CPU "
                               "time other processes took from our threads, and the hypervisor's steal, read "
                               "from Linux's /proc) "
                               "before the row's floor or baseline failure, or a pass the withheld time could "
                               "explain, or a --perf-against row's reading either way, is reported unresolved "
                               "instead: evidence about the host, not the kernel "
                               "(default 0.05; inf: never, and a miss while the host ran torch's threads apart is "
                               "judged on all pairs too)"),
    ("--perf-shard", None, "K/N: run shard K of N of the perf suite (each test function with all its impls in one "
                           "shard, balanced by this fingerprint's stored run); merge the shards' --benchmark-json "
                           "files with python -m perfgate.report --merge"),
    ("--perf-against", None, "REV: also time each impl the suite makes a claim about (optimized, and those a "
                             "speedup or memory marker names with impl=) against REV's library (a git revision "
                             "of this repository: HEAD, HEAD~1, a branch, a SHA; or a folder holding another "
                             "copy), in worker processes interleaved pair by pair, and fail a row this tree runs "
                             "more than --perf-against-tolerance slower than REV"),
    ("--perf-against-workers", 2, "worker processes a side for --perf-against, each block on one chosen at random "
                                  "(default 2, at least 2)"),
    ("--perf-against-tolerance", 0.05, "with --perf-against: fail a row whose time is more than this fraction "
                                       "over REV's, the whole interval beyond it (default 0.05)"),
    ("--perf-against-budget", 240.0, "with --perf-against: seconds of extra pairs shared by the rows whose "
                                     "interval straddles the tolerance after every row's planned pairs, each "
                                     "taking at most its share of what is left and --perf-extend (default 240)"),
    ("--perf-remeasure-limits", False, "measure this machine's streaming bandwidth and GEMM peaks anew for the "
                                       "roofline column, replacing the fingerprint's stored limits.json (default: "
                                       "measured once per fingerprint, each the first time a row needs it)"),
    ("--perf-require-floors", False, "fail the session when a speedup or memory floor declared for this device "
                                     "class and size was not checked because its row was not measured (its impl, "
                                     "its reference or its peer deselected, skipped, failed, errored or not run); "
                                     "without it such floors are listed, not failed"),
]
_TYPES = {"--perf-tolerance": float, "--perf-threads": int, "--perf-visits": int, "--perf-extend": float,
          "--perf-contended": float, "--perf-against-workers": int,
          "--perf-against-tolerance": float, "--perf-against-budget": float}
_CHOICES = {"--perf-size": SIZES, "--perf-malloc": ("cache", "default")}

def add_options(parser: pytest.Parser) -> None:
    parser.addini("perfgate_against_library", type="linelist", default=[],
                  help="the top-level packages --perf-against imports from REV (default: every package under the "
                       "rootdir that holds no test file)")
    parser.addini("perfgate_against_build", type="args", default=[],
                  help="a command --perf-against runs in REV's exported copy before importing it, to build what "
                       "the library compiles (its C extensions); {python} is the session's Python")
    group = parser.getgroup("perfgate", "perfgate: speedup gate over a reference")
    for flag, default, text in OPTIONS:
        if isinstance(default, bool):  # a switch
            group.addoption(flag, default=default, action="store_true", help=text)
        else:
            group.addoption(flag, default=default, type=_TYPES.get(flag), choices=_CHOICES.get(flag), help=text)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Options:
    """The ``--perf-*`` values of one session, checked: a bad one is a usage error naming it."""

    device: str
    size: str | None  # None: smoke on CPU, full on CUDA
    tolerance: float
    malloc: str
    threads: int | None  # None: torch's default
    visits: int
    all_visits: bool
    gated_only: bool
    extend_s: float
    contended: float
    shard: tuple[int, int] | None
    l2_flush: bool
    against: str | None
    against_workers: int
    against_tolerance: float
    against_budget: float
    require_floors: bool
    remeasure_limits: bool
    asked: bool  # some --perf-* option was given: the session is a perf session

    @classmethod
    def read(cls, config: pytest.Config) -> Options:
        opt = {flag: config.getoption(_dest(flag)) for flag, _, _ in OPTIONS}
        checks = [("--perf-tolerance", 0.0 <= opt["--perf-tolerance"] < 1.0, "must be in [0, 1)"),
                  ("--perf-threads", opt["--perf-threads"] is None or opt["--perf-threads"] >= 1, "must be >= 1"),
                  ("--perf-visits", opt["--perf-visits"] >= 1, "must be >= 1"),
                  ("--perf-extend", opt["--perf-extend"] >= 0.0, "must be seconds >= 0"),
                  ("--perf-contended", opt["--perf-contended"] > 0.0, "must be a share > 0 (inf: never)")]
        for flag, ok, rule in checks:
            if not ok:
                raise pytest.UsageError(f"{flag} {rule}, got {opt[flag]}")
        shard = None
        if opt["--perf-shard"] is not None:
            from .shard import parse

            try:
                shard = parse(opt["--perf-shard"])
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from exc
        values = {_dest(flag).removeprefix("perf_"): value for flag, value in opt.items()}
        values.update(shard=shard, extend_s=values.pop("extend"),
                      asked=any(opt[flag] != default for flag, default, _ in OPTIONS))
        return cls(**values)
