"""Per-sample gradients under glibc's default malloc and under perfgate's cache mode.

Run each mode in a fresh process, e.g.:
    for m in default cache; do for t in 0 1; do
        THP_MEM_ALLOC_ENABLE=$t python -m evidence.malloc_modes $m; done; done
Prints the median of 20 calls and the minor page faults per call (MLP 784-256-256-10, B=64).
"""

import sys

from perfgate.timing import configure_malloc

mode = configure_malloc(sys.argv[1])  # before any large allocation

import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
import reference  # noqa: E402
from kernels.models import MLP  # noqa: E402

torch.manual_seed(0)
model, x, y = MLP(), torch.randn(64, 784), torch.randint(0, 10, (64,))
for name, fn in (("optimized", kernels.per_sample_grads), ("reference", reference.per_sample_grads)):
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        t = time.perf_counter()
        fn(model, F.cross_entropy, x, y)
        times.append(time.perf_counter() - t)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // 20
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(f"malloc={mode} THP={thp} {name}: {sorted(times)[10] * 1e3:.2f} ms, {faults} page faults/call")
