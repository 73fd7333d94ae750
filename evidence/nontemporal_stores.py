"""Streaming stores for per_sample_grads' outer products: what they save, interleaved in one process.

    python -m evidence.nontemporal_stores cache     (or default: glibc's malloc as a user has it)

Part 1 writes the 784-256 layer's product at B=64 (51 MB) into a mapped buffer by torch.mul, by
kernels._nontemporal on 1 and on 2 threads, and by memset (zero_), median GB/s written. Part 2
times per_sample_grads (fresh result and out=) with the streaming stores and with torch.mul
(kernels.nontemporal's C part switched off) against torch.func's vmap(grad), on the OCS MLP
784-256-256-10 at B=64 and B=256, 2 threads, each with its result's bytes over its time, and that
as a share of a memset's rate over the same result in the same rounds (the write bandwidth of this
run). Part 3 times the call streamed and by torch.mul at batch sizes whose results straddle
kernels.nontemporal.CACHE_CAP (streaming forced on and off, whatever the cap says), fresh result and
out=. Medians of 48 calls a row (part 3: 15 rounds), rows interleaved.
"""

import sys
from unittest import mock

from perfgate.timing import configure_malloc

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

import torch  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import medians  # noqa: E402
from kernels import nontemporal  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

torch.set_num_threads(2)
C = nontemporal._nontemporal
assert C is not None and C.NONTEMPORAL, "kernels._nontemporal is not built with streaming stores here"


def streaming(on: bool, fn):
    """fn with kernels.nontemporal.pays answering ``on`` whatever the result's size."""
    return mock.patch.object(nontemporal, "pays", lambda nbytes: on)(fn)


def without_c(fn):
    """fn with kernels.nontemporal's C part switched off (torch.mul everywhere)."""
    return mock.patch.object(nontemporal, "_nontemporal", None)(fn)


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


def rows(batch: int) -> tuple[dict, int]:
    """The per_sample_grads rows at ``batch``, after checking streamed and plain give the same bits,
    and the bytes of the result they write."""
    args = per_sample_problem(batch)
    into = kernels.per_sample_grads(*args)

    def fresh():
        return kernels.per_sample_grads(*args)

    def reused():
        return kernels.per_sample_grads(*args, out=into)

    streamed, plain = fresh(), without_c(fresh)()
    assert all(torch.equal(streamed[n], plain[n]) for n in plain)
    return ({"fresh, streamed": fresh, "fresh, torch.mul": without_c(fresh),
             "out=, streamed": reused, "out=, torch.mul": without_c(reused),
             "vmap(grad)": lambda: vmap_grads(*args),
             "memset of the result": lambda: [t.zero_() for t in into.values()]},
            sum(t.nbytes for t in into.values()))


# the whole call's rate of writing its B x P result, against a memset of the same result timed in
# the same rounds: the write bandwidth the host gave this run (the roofline column's limit is the
# best it ever gave)
print("\n2. per_sample_grads, ms a call (vmap / row); the result's bytes a call over its time, and that "
      "over the rate of the memset of the result in the same rounds")
for batch in (64, 256):
    fns, nbytes = rows(batch)
    ms = medians(fns, rounds=8, calls=6)
    for name, t in ms.items():
        rate = nbytes / t / 1e6
        print(f"   B={batch:3d} {name:20s} {t:7.2f} ms  {ms['vmap(grad)'] / t:5.2f}x  {nbytes / 1e6:6.1f} MB "
              f"{rate:5.1f} GB/s  {ms['memset of the result'] / t:4.0%}")

# where streaming starts to pay in the whole call: the cap is the most of the last-level cache a
# result counts on keeping, so results on either side of it, each way
print(f"\n3. per_sample_grads streamed and by torch.mul, forced, around CACHE_CAP = "
      f"{nontemporal.CACHE_CAP >> 20} MiB (torch.mul / streamed)")
for batch in (8, 16, 24, 32, 48, 64):
    fns, nbytes = rows(batch)
    ms = medians({"fresh, streamed": streaming(True, fns["fresh, streamed"]),
                  "fresh, torch.mul": streaming(False, fns["fresh, streamed"]),
                  "out=, streamed": streaming(True, fns["out=, streamed"]),
                  "out=, torch.mul": streaming(False, fns["out=, streamed"])},
                 rounds=15, calls=max(2, 128 // batch))
    print(f"   B={batch:3d} {nbytes / 1e6:6.1f} MB  " + "  ".join(f"{k} {t:5.2f} ms" for k, t in ms.items())
          + f"  fresh {ms['fresh, torch.mul'] / ms['fresh, streamed']:.2f}x, out= "
          f"{ms['out=, torch.mul'] / ms['out=, streamed']:.2f}x")
