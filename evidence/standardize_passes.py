"""kernels.Standardizer's C passes (kernels._standardize) against its torch ops (row blocks of
BLOCK_BYTES, the path without the C part), interleaved in one process, with the memory's own
passes over the same X timed alongside.

    python -m evidence.standardize_passes [cache|default]

For X (N, 512) at the suite's sizes (smoke 10000, full 50000 rows; fp32, and fp64 at 10000),
1 and 2 threads: fit, transform(out=) and the suite's call (fit, then transform into a fresh
result), torch ops / C as point (95% CI) and the two medians of 15 interleaved ABBA pairs
(evidence/ab.py). Then the medians of fit and transform(out=) in C beside X.sum(0) (one read of
X) and out.copy_(X) (one read, one write), in interleaved rounds: how near each pass is to the
memory's pace, and GB/s of the bytes each must move (fit reads X; transform reads X and writes
the result).
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from unittest import mock  # noqa: E402

import torch  # noqa: E402

from evidence.ab import medians, versus  # noqa: E402
from kernels import standardize  # noqa: E402
from kernels.standardize import Standardizer  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

assert standardize._c is not None, "kernels._standardize is not built"
timer = timer_for("cpu")
print(f"{_cpu_model()}, malloc {mode}, torch {torch.__version__}")


def path(fn, in_c: bool):
    """fn run with the C passes, or with the torch ops (the C part patched away)."""
    def run():
        if in_c:
            return fn()
        with mock.patch.object(standardize, "_c", None):
            return fn()

    return run


for threads in (2, 1):
    torch.set_num_threads(threads)
    for n, dtype in ((10_000, torch.float32), (50_000, torch.float32), (10_000, torch.float64)):
        x = (5.0 + 3.0 * torch.randn(n, 512, generator=torch.Generator().manual_seed(0))).to(dtype)
        fitted, buf = Standardizer().fit(x), torch.empty_like(x)
        calls = {"fit": lambda x=x: Standardizer().fit(x),
                 "transform(out=)": lambda x=x, s=fitted, b=buf: s.transform(x, out=b),
                 "fit + transform": lambda x=x: Standardizer().fit(x).transform(x)}
        print(f"\n{threads} thread(s), X {n} x 512 {str(dtype)[6:]} ({x.nbytes / 1e6:.1f} MB), torch ops / C:")
        for name, fn in calls.items():
            print(f"   {name:16s} {versus(timer, path(fn, False), path(fn, True))}", flush=True)
        ms = medians({"fit": calls["fit"], "transform(out=)": calls["transform(out=)"],
                      "X.sum(0)": lambda x=x: x.sum(0), "out.copy_(X)": lambda x=x, b=buf: b.copy_(x)},
                     rounds=15, calls=5)
        reads = {"fit": 1, "transform(out=)": 2, "X.sum(0)": 1, "out.copy_(X)": 2}  # X's bytes moved, times
        moved = {k: r * x.nbytes for k, r in reads.items()}
        print("   medians, ms (GB/s of the bytes moved): "
              + ", ".join(f"{k} {v:.3f} ({moved[k] / v / 1e6:.1f})" for k, v in ms.items()), flush=True)
