"""Large CPU outputs in transparent huge pages, so writing them fresh faults 2 MiB at a time.

A tensor of tens of MB that glibc's default malloc maps fresh is written at the speed of page
faults: one per 4 KiB page. Where Linux offers transparent huge pages on request (its
``/sys/kernel/mm/transparent_hugepage/enabled`` mode is ``madvise``), ``empty`` asks for them on
the tensor's 2 MiB-aligned interior (``madvise(MADV_HUGEPAGE)``) before anything touches it, so
the first write faults one 2 MiB page instead of 512 small ones. Memory glibc already has
resident (a reused block) is not moved. Elsewhere (CUDA, another OS, THP ``always`` or
``never``, torch's own ``THP_MEM_ALLOC_ENABLE=1``) it is plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where asking helps: Linux, THP in ``madvise`` mode, torch not already
    aligning its CPU allocations for THP; None elsewhere."""
    if not sys.platform.startswith("linux") or os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        return None
    try:
        with open(THP_MODE) as f:
            mode = f.read()
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    if "[madvise]" not in mode:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialized tensor of ``shape`` in ``like``'s dtype and device; on CPU its whole
    2 MiB pages advised huge (module note). Advice the kernel refuses changes nothing."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    madvise = _madvise() if out.device.type == "cpu" else None
    if madvise is not None:
        start = out.data_ptr()
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = (start + out.numel() * out.element_size()) // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            madvise(lo, hi - lo, MADV_HUGEPAGE)
    return out
