"""per_sample_grads' lead over vmap(grad) with the result evicted from the last-level cache between calls.

    python -m evidence.llc_eviction [threads, default 2] [evicting MiB, default 1024]

The suite's MLP (784-256-256-10, B=64, a 69 MB result written with ``out=``), each row timed two
ways in one process, the rows interleaved in rounds:

- warm: calls back to back, as the suite times them. On a host whose shared last-level cache
  keeps the result between calls, an ordinary store finds its line cached;
- evicted: before each call, outside its reading, a pass over a buffer larger than the cache
  (``torch.add_`` over it), as a busy neighbour's traffic can leave the cache. An ordinary store then
  reads each line from memory before writing it (a read for ownership); a streaming store does not.
  The pass writes too: the write-back of its dirty lines may fall into the timed call, every row's alike.

Rows: the first layer's outer products alone (51 MB) by torch.mul and by kernels._nontemporal's
streaming stores; per_sample_grads(out=) as it runs (streamed, kernels.nontemporal.pays) and with
the streaming off (torch.mul); vmap(grad), whose result is written by torch's ordinary stores.
"""

import statistics
import sys
from unittest import mock

from perfgate.timing import configure_malloc

malloc = configure_malloc("cache")  # the suite's mode, before any large allocation

import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import nontemporal  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from perfgate.timing import HostClock, Timer  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
evicting = torch.zeros((int(sys.argv[2]) if len(sys.argv) > 2 else 1024) << 18)  # MiB of float32
assert nontemporal._nontemporal is not None, "kernels._nontemporal is not built here"
batch = 64
args = per_sample_problem(batch)
into = kernels.per_sample_grads(*args)
first = into["net.0.weight"]
g, a = torch.randn(batch, 256, 1), torch.randn(batch, 1, 784)


def plain(fn):
    """fn with kernels.nontemporal's streaming off (torch.mul for every layer)."""
    return mock.patch.object(nontemporal, "pays", lambda nbytes: False)(fn)


def reused():
    return kernels.per_sample_grads(*args, out=into)


rows = {
    "first layer, torch.mul": lambda: torch.mul(g, a, out=first),
    "first layer, streamed": lambda: nontemporal.outer(g, a, first, stream=True),
    "per_sample_grads(out=), streamed": reused,
    "per_sample_grads(out=), torch.mul": plain(reused),
    "vmap(grad)": lambda: vmap_grads(*args),
}
assert all(torch.equal(s, p) for s, p in zip(reused().values(), plain(reused)().values(), strict=True))
timers = {"warm": Timer(HostClock()), "evicted": Timer(HostClock(), flush=lambda: evicting.add_(1.0))}
times: dict[tuple[str, str], list[float]] = {(r, t): [] for r in rows for t in timers}
for _ in range(12):
    for row, fn in rows.items():
        for way, timer in timers.items():
            times[row, way] += timer.block((fn, None), 4, warm=1)
ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(f"# {_cpu_model()}, {torch.get_num_threads()} thread(s), malloc {malloc}, torch {torch.__version__}, "
      f"last-level cache {nontemporal.last_level_cache() >> 20} MiB (as reported), evicting pass over "
      f"{evicting.nbytes >> 20} MiB; MLP 784-256-256-10, B={batch}; medians of 12 rounds of 4 calls")
print(f"{'':36s} {'warm ms':>9s} {'evicted ms':>11s}   vmap / row: warm, evicted")
for row in rows:
    w, e = ms[row, "warm"], ms[row, "evicted"]
    ratios = "" if row.startswith("first") else \
        f"   {ms['vmap(grad)', 'warm'] / w:5.2f}x {ms['vmap(grad)', 'evicted'] / e:5.2f}x"
    print(f"{row:36s} {w:9.3f} {e:11.3f}{ratios}")
