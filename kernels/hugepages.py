"""Large CPU outputs in transparent huge pages, so writing them fresh faults 2 MiB at a time.

A tensor of tens of MB that glibc's default malloc maps fresh is written at the speed of page
faults: one per 4 KiB page. Where Linux offers transparent huge pages on request (its
``/sys/kernel/mm/transparent_hugepage/enabled`` mode is ``madvise``), ``empty`` asks for them on
the tensor's 2 MiB-aligned interior (``madvise(MADV_HUGEPAGE)``) before anything touches it, so
the first write faults one 2 MiB page instead of 512 small ones. Where the mode is ``always``, the
kernel gives the interior huge pages unasked where it has them free, and ``empty`` asks nothing.
Memory glibc already has resident (a reused block) is not moved. Elsewhere (CUDA, another OS, THP
``never``, torch's own ``THP_MEM_ALLOC_ENABLE=1``) it is plain ``torch.empty``.

Those huge pages are faulted one of two ways: by torch's threads as they write the tensor, or
first by the calling thread, a store a page (``prefault``). Under a hypervisor, which is faster
depends on the host, and on one host on the minute (docs/kernels/per_sample.md). So the kernels
take their fresh results from ``fresh``, which, under a hypervisor where torch runs more than one
thread, times each call's faulting and writing and takes the way with the shorter recent times,
trying the other again after ``EXPLORE_S`` seconds and ``EXPLORE_CALLS`` calls, twice as far apart
after each try slower than the faster way (to ``MAX_BACKOFF`` times). Elsewhere the writers fault
(one thread: a prefault only cost; outside a VM: not measured).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from kernels import cpu

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
EXPLORE_S = 10.0  # seconds the slower way goes untried at the least (times its backoff)
EXPLORE_CALLS = 10  # calls of the faster way between two tries of the slower at the least (times its backoff)
MAX_BACKOFF = 16  # the most the spacing of those tries grows while they find the slower way slower
KEPT = 3  # each way's latest call times, whose median scores it
SITES = 64  # (site, bytes, threads) whose times are kept, the least recently used dropped first


def _bracketed(path: str) -> str:
    """The setting a Linux THP file (``enabled``, ``defrag``) marks as chosen, ``[madvise]`` in
    "always [madvise] never"; "" where the file cannot be read or marks none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


@functools.cache
def _mode() -> str:
    """Linux's THP mode ("always", "madvise", "never"); "" off Linux or where it cannot be read."""
    return _bracketed(THP_MODE) if sys.platform.startswith("linux") else ""


def _torch_aligns() -> bool:
    """Whether torch's CPU allocator aligns its allocations for THP itself (``THP_MEM_ALLOC_ENABLE=1``)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where asking helps (THP in ``madvise`` mode, torch not aligning for THP itself);
    None elsewhere."""
    if _mode() != "madvise" or _torch_aligns():
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _huge_unasked() -> bool:
    """Whether fresh anonymous memory comes in huge pages without advice (THP ``always``; torch not
    aligning for THP itself)."""
    return _mode() == "always" and not _torch_aligns()


def interior(t: Tensor) -> tuple[int, int]:
    """The addresses [lo, hi) of the whole 2 MiB pages inside contiguous ``t``'s memory (lo >= hi:
    none)."""
    start = t.data_ptr()
    return -(-start // HUGE_PAGE) * HUGE_PAGE, (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE


def _huge(out: Tensor) -> bool:
    """Whether ``out``'s whole 2 MiB pages (a CPU tensor with some) are to be huge: advised where
    THP asks for advice (and the advice taken), or huge unasked."""
    if out.device.type != "cpu":
        return False
    lo, hi = interior(out)
    if hi <= lo:
        return False
    madvise = _madvise()
    if madvise is not None:
        return madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
    return _huge_unasked()


def _filled() -> bool:
    """Whether torch's deterministic mode fills a fresh tensor (NaN), its pages with it: a prefault's
    zeros would break that fill."""
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory


def _prefault(out: Tensor) -> None:
    """Fault ``out``'s whole huge pages from this thread: a byte at the start of each, written here
    (a strided write this short runs on this thread alone; bytes: any dtype)."""
    lo, hi = interior(out)
    start = out.data_ptr()
    out.view(-1).view(torch.uint8)[lo - start:hi - start:HUGE_PAGE].zero_()


def _allocate(shape: tuple[int, ...], like: Tensor) -> tuple[Tensor, bool]:
    """An uninitialized tensor of ``shape`` in ``like``'s dtype and device, its whole 2 MiB pages
    made huge where they can be (``_huge``); and whether a prefault may touch them (huge, and not
    filled by torch's deterministic mode)."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    return out, _huge(out) and not _filled()


def empty(shape: tuple[int, ...], like: Tensor, *, prefault: bool = False) -> Tensor:
    """An uninitialized tensor of ``shape`` in ``like``'s dtype and device; on CPU its whole
    2 MiB pages huge (advised where THP asks for advice) and, with ``prefault``, faulted by this
    thread. Advice the kernel refuses changes nothing, and is not followed by a prefault."""
    out, faultable = _allocate(shape, like)
    if prefault and faultable:
        _prefault(out)
    return out


class _Ways:
    """The latest call times of one site's fresh results, prefaulted (True) and faulted by the
    writers (False), and when each way last ran."""

    def __init__(self) -> None:
        self.seconds: dict[bool, collections.deque[float]] = {way: collections.deque(maxlen=KEPT)
                                                             for way in (True, False)}
        self.ran = {True: -float("inf"), False: -float("inf")}  # perf_counter seconds
        self.since = {True: 0, False: 0}  # calls since each way last ran
        self.backoff = 1  # the tries of the slower way spaced EXPLORE_S and EXPLORE_CALLS times this
        self.best: bool | None = None

    def _best(self) -> bool:
        return min((True, False), key=lambda way: statistics.median(self.seconds[way]))

    def choose(self, now: float) -> bool:
        """The way to take now: each once at first (the prefault first), then the one whose latest
        times have the lower median, or the other where it has not run for EXPLORE_S seconds and
        EXPLORE_CALLS calls (each times ``backoff``)."""
        for way in (True, False):
            if not self.seconds[way]:
                return way
        other = not self._best()
        due = (now - self.ran[other] >= EXPLORE_S * self.backoff
               and self.since[other] >= EXPLORE_CALLS * self.backoff)
        return other if due else not other

    def note(self, prefault: bool, seconds: float, now: float) -> None:
        """Keep a call's time. A try of the slower way slower than the faster way's median doubles
        ``backoff`` (to MAX_BACKOFF); a faster try (its older times may still outvote it) or a change
        of the faster way sets it back to 1."""
        tried = self.best is not None and prefault != self.best  # the slower way, tried
        slower = tried and seconds >= statistics.median(self.seconds[not prefault])
        self.seconds[prefault].append(seconds)
        self.ran[prefault], self.since[prefault], self.since[not prefault] = now, 0, self.since[not prefault] + 1
        if not self.seconds[not prefault]:
            return
        best = self._best()
        if best != self.best or (tried and not slower):
            self.backoff = 1
        elif tried:
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        self.best = best


_sites: collections.OrderedDict[tuple[str, int, int], _Ways] = collections.OrderedDict()
_clock = time.perf_counter  # seconds, for the calls' times (a test's host stands in its own)


def _ways(key: tuple[str, int, int]) -> _Ways:
    """The times kept for ``key``, kept anew where there are none (the least recently used key dropped
    past SITES)."""
    ways = _sites.pop(key, None) or _Ways()
    _sites[key] = ways
    while len(_sites) > SITES:
        _sites.popitem(last=False)
    return ways


@contextlib.contextmanager
def fresh(shape: tuple[int, ...], like: Tensor, *, site: str) -> Iterator[Tensor]:
    """A tensor like ``empty``'s for the ``with`` block to write whole. Under a hypervisor, where
    torch runs more than one thread, the huge pages are prefaulted or not as the faster way for
    ``site`` (a caller's name for one kind of write: the same work at the same size) at this size
    and thread count has recently been: the time from here to the block's end is kept for the way
    taken (module note). Elsewhere no prefault."""
    out, faultable = _allocate(shape, like)
    threads = torch.get_num_threads()
    if not (faultable and threads > 1 and cpu.virtual()):
        yield out
        return
    ways = _ways((site, out.numel() * out.element_size(), threads))
    start = _clock()
    prefault = ways.choose(start)
    if prefault:
        _prefault(out)
    yield out  # an exception in the block leaves its time unkept
    ways.note(prefault, _clock() - start, start)
