"""Large CPU outputs in transparent huge pages, so writing them fresh faults 2 MiB at a time.

A tensor of tens of MB that glibc's default malloc maps fresh is written at the speed of page
faults: one per 4 KiB page. Where Linux offers transparent huge pages on request (its
``/sys/kernel/mm/transparent_hugepage/enabled`` mode is ``madvise``), ``empty`` asks for them on
the tensor's 2 MiB-aligned interior (``madvise(MADV_HUGEPAGE)``) before anything touches it, so
the first write faults one 2 MiB page instead of 512 small ones. Where the mode is ``always``, the
kernel gives the interior huge pages unasked where it has them free, and ``empty`` asks nothing.
Memory glibc already has resident (a reused block) is not moved. Elsewhere (CUDA, another OS, THP
``never``, torch's own ``THP_MEM_ALLOC_ENABLE=1``) it is plain ``torch.empty``.

Under a hypervisor, where torch runs more than one thread, the calling thread then faults those
huge pages itself, one write a page, before the caller's threads write the tensor: on a 2-vCPU
VM, two threads faulting them at once were many times slower than one thread faulting them, in
stretches of minutes (docs/kernels/per_sample.md); where they would have been fast, the
prefault costs about one thread's zeroing of the tensor. One writing thread faults them as it writes,
each page's zeroing still in cache for its write; outside a VM (not measured) the writers fault
them as before. A page already mapped costs the prefault a store.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from kernels import cpu

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def empty(shape: tuple[int, ...], like: Tensor, *, prefault: bool | None = None) -> Tensor:
    """An uninitialized tensor of ``shape`` in ``like``'s dtype and device; on CPU its whole
    2 MiB pages huge (advised where THP asks for advice) and, with ``prefault`` (default: under a
    hypervisor, where torch runs more than one thread), faulted by this thread (module note).
    Advice the kernel refuses changes nothing, and is not followed by a prefault."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.device.type != "cpu":
        return out
    lo, hi = interior(out)
    if hi <= lo:
        return out
    madvise = _madvise()
    if madvise is not None:
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            return out
    elif not _huge_unasked():
        return out
    if prefault is None:
        prefault = torch.get_num_threads() > 1 and cpu.virtual()
    # torch's deterministic mode filled the tensor (NaN) already, its pages with it: no store of ours
    filled = torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    if prefault and not filled:
        # a byte at the start of each huge page, written here: its fault maps the whole huge page (a
        # strided write this short runs on this thread alone; bytes: any dtype)
        start = out.data_ptr()
        out.view(-1).view(torch.uint8)[lo - start:hi - start:HUGE_PAGE].zero_()
    return out
