"""Where --perf-against's lasting per-worker offset comes from: the vCPU, the inputs, or the process.

workers: 4 worker processes (1 torch thread, glibc malloc in perfgate's ``cache`` mode, as the A/B's
workers run) each build the rope rotation's smoke inputs 3 times (the A/B's copies), SPACER MiB x k
of touched memory before copy k (0: none), so the copies land apart. The parent asks a worker at
random for a block of 10 calls on a copy at random, one block at a time; the worker reads the vCPU
it ran on before and after. With SHIFT_KIB > 0 the worker holds a spacer of random size (64 bytes to
SHIFT_KIB KiB, in 64-byte steps: perfgate's ``timing.HeapShift``, whose default is 16384)
over each block and frees it after, so every block's outputs and temporaries land at another place
of the heap. Prints each worker's median block, each
copy's, and each vCPU's, and the share of the blocks' log-time variance that lies between workers.
With ASLR 0 the workers start with address-space randomization off (``personality(ADDR_NO_RANDOMIZE)``,
inherited by the spawned processes, as ``setarch -R`` runs a command): each lays out its libraries,
heap and stack at the same addresses.

heap: one such process, its inputs fixed; with SPACERS=1 a spacer of random size is allocated (and
kept) before every other block, so the heap serves the call's outputs and temporaries elsewhere.
Prints each block's median.

usage: python -m evidence.process_offsets workers BLOCKS [SPACER_MIB [SHIFT_KIB [ASLR: 1 or 0]]]
       python -m evidence.process_offsets heap BLOCKS [SPACERS: 0 or 1]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import sys

SHAPE = (8, 8, 512, 64)  # perf_tests/test_rope.py's smoke size
ADDR_NO_RANDOMIZE = 0x0040000  # linux/personality.h


def _vcpu() -> int:
    """The vCPU this process last ran on (/proc/self/stat's field 39)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _setup():
    """torch at 1 thread under the cache malloc, and the rotation's call on given inputs."""
    from perfgate.timing import configure_malloc

    assert configure_malloc("cache") == "cache"
    import torch

    import kernels

    torch.set_num_threads(1)
    rope = kernels.RotaryEmbedding(SHAPE[-1], interleaved=True)
    return torch, lambda x, grad: torch.autograd.grad(rope(x), x, grad)[0]


def _block(call, x, grad, warm: int = 0, shift_kib: int = 0) -> float:
    """The median seconds of 10 back-to-back calls, by perfgate's CPU timer; with ``shift_kib``, a
    ``HeapShift`` of 0 to that many KiB held over the block (as --perf-against's workers hold one)."""
    from perfgate.timing import HeapShift, timer_for

    timer = timer_for("cpu")
    timer.shift = HeapShift(most=shift_kib << 10) if shift_kib else None
    return statistics.median(timer.block((lambda: call(x, grad), None), 10, warm=warm))


def _worker(conn, spacer_mib: int, shift_kib: int) -> None:
    torch, call = _setup()
    copies, spacers = [], []
    for k in range(3):
        if spacer_mib:
            spacers.append(torch.ones((spacer_mib * (k + 1)) << 18))  # float32: MiB x (k + 1), touched
        torch.manual_seed(k)
        copies.append((torch.randn(SHAPE, requires_grad=True), torch.randn(SHAPE)))
    for x, grad in copies:
        call(x, grad)
    conn.send("ready")
    while (copy := conn.recv()) is not None:
        before = _vcpu()
        conn.send((_block(call, *copies[copy], shift_kib=shift_kib), before, _vcpu()))


def _between(rows: list[tuple[int, int, int | None, float]]) -> str:
    """The one-way ANOVA of the blocks' log times by worker (perfgate's ``unit_components``, as the
    A/B reads its units): the between-worker component's share of the variance, and the F test's
    p-value (no lasting offset: share near 0, p not small)."""
    import numpy as np
    from scipy import stats

    from perfgate.stats import unit_components

    logs, workers = np.log([r[3] for r in rows]), np.array([r[0] for r in rows])
    component, within = unit_components(logs, workers)
    p = stats.f_oneway(*(logs[workers == w] for w in np.unique(workers))).pvalue
    return (f"between workers {component / (component + within):.0%} of the log-time variance "
            f"(sd {100 * component ** 0.5:.1f}% between, {100 * within ** 0.5:.1f}% within), F test p={p:.2g}")


def workers(blocks: int, spacer_mib: int, shift_kib: int = 0, aslr: bool = True) -> None:
    if not aslr:  # the spawned workers' address spaces laid out alike (Linux; inherited across exec)
        import ctypes

        ctypes.CDLL(None).personality(ADDR_NO_RANDOMIZE)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(4):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_worker, args=(child, spacer_mib, shift_kib)))
        procs[-1].start()
        pipes.append(parent)
    assert all(p.recv() == "ready" for p in pipes)
    rng, rows = random.Random(0), []
    for _ in range(blocks):
        w, copy = rng.randrange(4), rng.randrange(3)
        pipes[w].send(copy)
        t, before, after = pipes[w].recv()
        rows.append((w, copy, before if before == after else None, t))
    for p in pipes:
        p.send(None)
    for p in procs:
        p.join()
    def ms(worker: int, copy: int | None = None, vcpu: int | None = None) -> str:
        got = [r[3] for r in rows if r[0] == worker and copy in (None, r[1]) and vcpu in (None, r[2])]
        return f"{1e3 * statistics.median(got):.3f} ({len(got)})" if got else "-"

    shift = f", a spacer of 0-{shift_kib} KiB over each block" if shift_kib else ""
    print(f"{blocks} blocks, 4 workers, spacer {spacer_mib} MiB x copy{shift}, ASLR {'on' if aslr else 'off'}, "
          f"vCPUs {os.cpu_count()}; ms (blocks)")
    for w in range(4):
        copies = ", ".join(f"{k}: {ms(w, copy=k)}" for k in range(3))
        vcpus = ", ".join(f"{c}: {ms(w, vcpu=c)}" for c in range(os.cpu_count()))
        print(f"  worker {w}: {ms(w)}; by copy {copies}; by vCPU {vcpus}")
    print(f"  {_between(rows)}")


def heap(blocks: int, spacers: bool) -> None:
    torch, call = _setup()
    torch.manual_seed(0)
    x, grad = torch.randn(SHAPE, requires_grad=True), torch.randn(SHAPE)
    rng, held, medians = random.Random(1), [], []
    for block in range(blocks):
        if spacers and block % 2 == 0:
            held.append(torch.ones(rng.randrange(1, 16384) * 1024))  # up to 64 MiB, 4 KiB steps, kept
        medians.append(_block(call, x, grad, warm=1))
    print(f"one process, {blocks} blocks, spacers {'on' if spacers else 'off'}: block medians (ms)")
    print("  " + " ".join(f"{1e3 * t:.2f}" for t in medians))


if __name__ == "__main__":
    mode, count = sys.argv[1], int(sys.argv[2])
    extra = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    shift = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    aslr = sys.argv[5] != "0" if len(sys.argv) > 5 else True
    workers(count, extra, shift, aslr) if mode == "workers" else heap(count, bool(extra))
