"""Batched outer products larger than the CPU's last-level cache, written with streaming stores.

An ordinary store to a cache line that is not cached reads the line from memory first (a read
for ownership), so writing N bytes moves 2N; a non-temporal (streaming) store writes whole lines
and moves N. Where a result is larger than the last-level cache, none of it stays cached for its
reader anyway, so writing it with streaming stores only saves the reads. ``outer`` does that on
x86-64 Linux through ``kernels._nontemporal`` (C, built by ``pip install``), for float32 into
memory whose pages are all resident (a reused buffer, or glibc's reused block under
``--perf-malloc cache``): a page mapped by the first write is zeroed through the cache, where an
ordinary store then finds it. Everywhere else, and where the C part is not built, it is
``torch.mul``; both write the same bits but for a NaN times a NaN, whose payload (x86 keeps the
first operand's, and the compiler orders the operands) may differ.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from kernels import checks

try:
    from kernels import _nontemporal
except ImportError:  # not built (no C compiler at install): torch.mul everywhere
    _nontemporal = None

CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
THREAD_BYTES = 8 << 20  # output bytes a team thread gets at the least: 300-500 us of writing at 17-28 GB/s
# The most of the last-level cache a result can count on keeping for its reader. A virtual machine's
# sysfs reports its host socket's whole L3, which the host's other tenants share (480 MiB on a
# 2-vCPU Intel Xeon guest, where a 35 MB result was already written 1.4x faster streamed); the AMD
# hosts measured report 32 MiB, their core complex's own L3 (docs/kernels/per_sample.md).
CACHE_CAP = 32 << 20


@functools.cache
def last_level_cache() -> int:
    """Bytes of CPU 0's largest data cache as Linux's sysfs reports it; 0 where it does not."""
    sizes = []
    for index in CACHES.glob("index*"):
        try:
            kind, size = (index / "type").read_text().strip(), (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction" and size[:-1].isdigit():
            sizes.append(int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 0))
    return max(sizes, default=0)


def pays(nbytes: int) -> bool:
    """Streaming stores pay for a result of ``nbytes``: it is larger than the last-level cache,
    or than ``CACHE_CAP`` of a larger one (unknown size: never), and this build has them."""
    return (_nontemporal is not None and _nontemporal.NONTEMPORAL
            and 0 < min(last_level_cache(), CACHE_CAP) < nbytes)


def outer(g: Tensor, a: Tensor, out: Tensor, *, stream: bool) -> Tensor:
    """``torch.mul(g, a, out=out)`` for g (B, O, 1), a (B, 1, I), out (B, O, I): the batched
    outer products, by streaming stores where ``stream`` (the caller's ``pays``) and the module
    note's conditions hold. Returns ``out``."""
    return outer_all([(g, a, out)], stream=stream)[0][0]


def outer_all(parts: list[tuple[Tensor, Tensor, Tensor]], *,
              stream: bool) -> tuple[list[Tensor], list[tuple[float, float]] | None]:
    """``outer`` of each (g, a, out) of ``parts``: the outs, and where the C part wrote them, each
    part's largest |g| and |a| its pass read (all of both where the out is not empty; NaN where one
    read is NaN), which a caller checking g and a finite need not read again; None unless the one
    C pass wrote them all.
    Where every part streams (``outer``'s conditions) and no out overlaps another out or any
    part's inputs, they are written in one parallel region, their rows split over the threads by
    elements, so a layer's small result does not hold a thread alone; else each part as ``outer``
    writes it, in order."""
    if stream and parts and all(_streamable(*p) for p in parts) and _apart(parts):
        dsts = [out.numpy() for _, _, out in parts]
        if all(_nontemporal.resident(dst) for dst in dsts):
            nbytes = sum(dst.nbytes for dst in dsts)
            threads = min(torch.get_num_threads(), nbytes // THREAD_BYTES, _nontemporal.MAX_THREADS)
            reads = _nontemporal.outer_all([(g.detach().contiguous().numpy(), a.detach().contiguous().numpy(),
                                             dst, tuple(out.shape))
                                            for (g, a, out), dst in zip(parts, dsts, strict=True)],
                                           max(1, threads))
            for _, _, out in parts:
                torch.autograd.graph.increment_version(out)  # written in place, as torch.mul's out= counts it
            return [out for _, _, out in parts], reads
    if len(parts) > 1:
        return [outer(*part, stream=stream) for part in parts], None
    return [torch.mul(g, a, out=out) for g, a, out in parts], None


def _apart(parts: list[tuple[Tensor, Tensor, Tensor]]) -> bool:
    """No out's memory meets another out's or any part's inputs' (``checks.span``): the threads
    write every out at once."""
    outs = [checks.span(out) for _, _, out in parts]
    others = outs + [checks.span(t) for g, a, _ in parts for t in (g, a)]
    return not any(lo < hi2 and lo2 < hi for i, (lo, hi) in enumerate(outs)
                   for j, (lo2, hi2) in enumerate(others) if j != i)


def _streamable(g: Tensor, a: Tensor, out: Tensor) -> bool:
    """The C part computes what torch.mul(g, a, out=out) would, and torch.mul would not refuse it:
    plain float32 CPU tensors of the outer product's shapes, out contiguous, no gradient asked of
    the inputs, out writable here (not an inference tensor outside inference mode). Its memory
    apart from the inputs' is ``_apart``'s."""
    tensors = (g, a, out)
    if _nontemporal is None or not all(t.device.type == "cpu" and t.layout == torch.strided
                                       and t.dtype == torch.float32 and not t.is_neg()
                                       and t.data_ptr() % 4 == 0 for t in tensors):  # numpy calls a misaligned
        return False  # float32 '=f', which the C part's buffer check refuses
    if not (g.dim() == a.dim() == out.dim() == 3 and g.shape[2] == 1 and a.shape[1] == 1
            and out.shape == (g.shape[0], g.shape[1], a.shape[2]) and g.shape[0] == a.shape[0]):
        return False
    if out.requires_grad or (torch.is_grad_enabled() and (g.requires_grad or a.requires_grad)):
        return False
    if out.is_inference() and not torch.is_inference_mode_enabled():
        return False
    if checks.tangent(g, a, out):  # forward-mode AD: torch.mul differentiates (or refuses), a C pass would not
        return False
    return out.is_contiguous() and out.numel() > 0  # apart from the inputs' memory: _apart
