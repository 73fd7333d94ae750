"""Streaming stores for per_sample_grads' outer products: what they save, interleaved in one process.

    python -m evidence.nontemporal_stores cache     (or default: glibc's malloc as a user has it)

Part 1 writes the 784-256 layer's product at B=64 (51 MB) into a mapped buffer by torch.mul, by
kernels._nontemporal on 1 and on 2 threads, and by memset (zero_), median GB/s written. Part 2
times per_sample_grads (fresh result and out=) with the streaming stores and with torch.mul
(kernels.nontemporal's C part switched off) against torch.func's vmap(grad), on the OCS MLP
784-256-256-10 at B=64 and B=256, 2 threads. Medians of 48 calls a row, rows interleaved.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

import statistics  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from kernels import nontemporal  # noqa: E402
from kernels.models import MLP  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.common import vmap_grads  # noqa: E402

torch.set_num_threads(2)
C = nontemporal._nontemporal
assert C is not None and C.NONTEMPORAL, "kernels._nontemporal is not built with streaming stores here"


def medians(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median ms of each fn, rounds interleaved, by perfgate's timer (the previous call's result
    alive while the next is made, as in a perf session's block)."""
    timer = timer_for("cpu")
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += timer.block((fn, None), calls, warm=0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def without_c(fn):
    def call():
        nontemporal._nontemporal = None
        try:
            return fn()
        finally:
            nontemporal._nontemporal = C
    return call


print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, "
      f"torch {torch.__version__}, last-level cache {nontemporal.last_level_cache() >> 20} MiB")

shape = (64, 256, 784)
g, a, out = torch.randn(64, 256, 1), torch.randn(64, 1, 784), torch.zeros(shape)
writes = {"torch.mul": lambda: torch.mul(g, a, out=out),
          "streamed, 1 thread": lambda: C.outer(g.numpy(), a.numpy(), out.numpy(), shape, 1),
          "streamed, 2 threads": lambda: C.outer(g.numpy(), a.numpy(), out.numpy(), shape, 2),
          "memset (zero_)": lambda: out.zero_()}
print(f"\n1. writing {shape} float32, {out.numel() * 4 / 1e6:.1f} MB, into mapped pages")
for name, ms in medians(writes, rounds=20, calls=1).items():
    print(f"   {name:22s} {ms:6.2f} ms  {out.numel() * 4 / ms / 1e6:5.1f} GB/s")


def rows(batch: int) -> dict:
    """The per_sample_grads rows at ``batch``, after checking streamed and plain give the same bits."""
    torch.manual_seed(0)
    model, x, y = MLP((784, 256, 256, 10)), torch.randn(batch, 784), torch.randint(0, 10, (batch,))
    into = kernels.per_sample_grads(model, F.cross_entropy, x, y)

    def fresh():
        return kernels.per_sample_grads(model, F.cross_entropy, x, y)

    def reused():
        return kernels.per_sample_grads(model, F.cross_entropy, x, y, out=into)

    streamed, plain = fresh(), without_c(fresh)()
    assert all(torch.equal(streamed[n], plain[n]) for n in plain)
    return {"fresh, streamed": fresh, "fresh, torch.mul": without_c(fresh),
            "out=, streamed": reused, "out=, torch.mul": without_c(reused),
            "vmap(grad)": lambda: vmap_grads(model, F.cross_entropy, x, y)}


print("\n2. per_sample_grads, ms a call (vmap / row)")
for batch in (64, 256):
    ms = medians(rows(batch), rounds=8, calls=6)
    for name, t in ms.items():
        print(f"   B={batch:3d} {name:18s} {t:7.2f} ms  {ms['vmap(grad)'] / t:5.2f}x")
