"""pytester's inline runs unload the modules first imported inside them: perfgate.inline.preload
imports once, at configure, what each session would otherwise load again (a C extension cannot load
twice)."""

import contextlib
import copy
import functools

import pytest

from perfgate import roofline, timing
from perfgate.inline import preload


def pytest_configure(config: pytest.Config) -> None:
    """Preload in the process that runs the tests: not in a pytest-xdist controller (-n, and no
    ``workerinput``), which runs none (its workers preload for themselves)."""
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        preload()


# pytest-benchmark reads the CPU with py-cpuinfo, which runs CPUID in a fresh Python process (0.2 s)
# in every session that saves a run or writes JSON: one reading serves this process's sessions.
with contextlib.suppress(ImportError):
    import cpuinfo

    _cpu_info = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(_cpu_info())



REAL_LAST_LEVEL_CACHE = roofline.last_level_cache  # before any test's stand-in


@pytest.fixture
def real_last_level_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """roofline.last_level_cache itself again, over ``cache_of_32_mib``'s stand-in, its reading
    forgotten before and after the test."""
    REAL_LAST_LEVEL_CACHE.cache_clear()
    monkeypatch.setattr(roofline, "last_level_cache", REAL_LAST_LEVEL_CACHE)
    yield
    REAL_LAST_LEVEL_CACHE.cache_clear()


@pytest.fixture(autouse=True)
def cache_of_32_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    """A last-level cache of 32 MiB on every host, so the stream passes' arrays are 128 MiB
    (``roofline.stream_bytes``): a limits file a test writes without ``stream_bytes`` then reads as
    measured over arrays large enough, whatever this host's cache; the sizing's tests set their own."""
    monkeypatch.setattr(roofline, "last_level_cache", lambda: 32 << 20)


# The streaming probe's reading of a quiet host, GB/s: what ``quiet_host`` pins it at
QUIET_GBPS = 10.0
STEADY_PACE_NS = 60_000.0  # what the pace probe reads in inline sessions (pytester): never slowed


@pytest.fixture
def quiet_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that withholds no CPU time and whose streaming probe reads its quiet figure
    throughout: a test that scripts one host reading pins the rest, so a shared host's real
    readings (a bandwidth shortfall excuses a miss) cannot move the verdict it expects."""
    monkeypatch.setattr(timing.HostLoad, "share", lambda self, before, after: (0.1, 0.0, 0.0))
    monkeypatch.setattr(timing.Bandwidth, "read", lambda self: QUIET_GBPS)


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester whose sessions (inline or in a fresh process) run without hypothesis's plugin: they
    hold no hypothesis test, and the plugin imports hypothesis in each fresh process (0.75 s).
    Its inline sessions read no thread placement and a steady core's pace: where this host ran
    torch's two threads apart or a core slowed (a busy neighbour), a verdict a test expects would
    turn "unresolved"; the probes' own tests give their sessions readings of their own
    (test_placement.py, test_pace.py).
    Run in a pytest-xdist worker (make correctness's paced tests), its sessions are not one: the
    worker's variables would turn pytest-benchmark off in them."""
    pytester.plugins.append("no:hypothesispytest")
    monkeypatch.setattr(timing.RoundTrip, "open", staticmethod(lambda threads: None))
    monkeypatch.setattr(timing.Pace, "read", lambda self: STEADY_PACE_NS)
    # a steady core's scan, at once: a real one sleeps between its passes (0.5-2 s a session)
    monkeypatch.setattr(timing.Pace, "scan", lambda self, seconds=0.0, every=0.1, most=64: STEADY_PACE_NS)
    # and no CPU to move to: a failure timed again at one thread stays where it runs (under xdist,
    # every worker would otherwise pin itself to the lowest-numbered CPU)
    monkeypatch.setattr(timing.Pace, "fastest", lambda self, most=64: None)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    return pytester
