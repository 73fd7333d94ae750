"""Device-correct timing and peak memory.

CUDA kernels are asynchronous: a clock read without a device synchronize measures only the
launch. Every timed callable built here synchronizes before it returns, and so does every
setup, so each clock read of the timer follows a synchronize.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any


def torch_or_none() -> Any:
    """torch when it is installed, else None: perfgate times plain Python callables too."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def resolve_device(requested: str) -> str:
    """``auto`` means cuda when available, else cpu; ``cuda`` without a GPU is an error."""
    if requested != "auto" and requested != "cpu" and not requested.startswith("cuda"):
        raise ValueError(f"--perf-device must be auto, cpu or cuda[:N], got {requested!r}")
    torch = torch_or_none() if requested != "cpu" else None
    cuda = torch is not None and torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if cuda else "cpu"
    if requested.startswith("cuda") and not cuda:
        why = "torch is not installed" if torch is None else "no CUDA device is available"
        raise ValueError(f"--perf-device {requested}: {why}; use --perf-device cpu")
    return requested


def synchronizer(device: str) -> Callable[[], None]:
    """A no-argument function that waits for all queued work on ``device``."""
    if device.startswith("cuda"):
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def synced(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn`` followed by a device synchronize, so a timer around it sees the real duration."""
    sync = synchronizer(device)

    def run(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        sync()
        return out

    return run


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="utf8") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt parameters


def configure_malloc(mode: str) -> str:
    """``cache``: glibc serves every block from its heap (no mmap) and keeps freed memory
    (trims only above 2 GiB free), so a fresh tensor reuses resident pages, as CUDA's caching
    allocator does. Without it a large tensor (a (B, P) per-sample gradient) is mmap-ed and
    page-faulted anew on every call, or not, depending on what ran before, which moved timings
    several-fold (docs/measurements/from-the-code.md). Returns the mode in effect ("default"
    where mallopt is absent)."""
    if mode != "cache":
        return "default"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return "default"
    return "cache" if ok else "default"


def _release_free_heap() -> None:
    """Hand glibc's free heap pages back to the OS, so a call cannot reuse pages an earlier
    call left resident and read as using no memory (no-op off glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory(fn: Callable[[], Any], device: str) -> int | None:
    """Peak memory one call of ``fn`` adds, in bytes, above what was in use before it.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus the allocation before the call.
    CPU (Linux): free heap pages are returned to the OS (glibc ``malloc_trim``), the process's
    resident-set high-water mark is reset (``/proc/self/clear_refs`` with 5), and
    ``VmHWM - VmRSS(before)`` is read after the call: the pages the call touched at its peak.
    Memory an allocator keeps cached outside glibc's heap would still be reused uncounted, so
    this is a lower bound of the footprint. None where neither measure is available.
    """
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        synced(fn, device)()
        return int(torch.cuda.max_memory_allocated(device) - before)
    _release_free_heap()
    before = _proc_status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf8") as fh:
            fh.write("5")
    except OSError:
        return None
    fn()
    after = _proc_status_bytes("VmHWM")
    if before is None or after is None:
        return None
    return max(0, after - before)


Timed = tuple[Callable[..., Any], Callable[[], Any] | None]  # (synced callable, synced setup or None)


def _time_block(timed: Timed, calls: int) -> float:
    """Median seconds of ``calls`` back-to-back calls after one untimed call (which warms the
    caches the other side's block just flushed), each with its own setup, untimed."""
    fn, setup = timed
    times = []
    for i in range(calls + 1):
        args = () if setup is None else (setup(),)
        t0 = time.perf_counter()
        fn(*args)
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def interleaved(reference: Timed, impl: Timed, rounds: int, calls: tuple[int, int],
                first_round: int = 0) -> list[tuple[float, float]]:
    """(reference s, impl s) pairs from blocks timed alternately in ABBA order (reference first in
    even rounds, the impl first in odd ones; rounds count from ``first_round``): both blocks of a
    pair see the same host state (memory bandwidth, clocks, neighbours), so their ratio does not
    move with it. A block is
    ``calls`` back-to-back calls after a warming one, so each side runs with its own data in
    cache, as in its separate rounds; alternating single calls measured small kernels with the
    other's data in cache (docs/measurements/from-the-code.md)."""
    pairs = []
    for i in range(first_round, first_round + rounds):
        if i % 2 == 0:
            r = _time_block(reference, calls[0])
            o = _time_block(impl, calls[1])
        else:
            o = _time_block(impl, calls[1])
            r = _time_block(reference, calls[0])
        pairs.append((r, o))
    return pairs
