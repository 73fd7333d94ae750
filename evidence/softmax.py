"""The fused attention's softmax (kernels._softmax, AVX-512F) against torch.softmax, in place over
the last dim, interleaved in one process: its error, and its time on the fused path's chunks.

    python -m evidence.softmax [cache|default]

Error: the largest relative error of each against float64's softmax, over scores of a (4, 512,
512) chunk at three spreads (the largest probability near 1 and the rest underflowing at 64).
Time: each chunk of scores the fused path makes (kernels/attention.py, FUSED_BYTES: B8 H8 D64,
4-64 heads a chunk at S=512-64), torch.softmax(out=) over the softmax C part, 1 and 2 threads,
point (95% CI) and the two medians of 15 interleaved ABBA pairs (evidence/ab.py).
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

import torch  # noqa: E402

from evidence.ab import versus  # noqa: E402
from kernels import attention  # noqa: E402
from kernels.attention import FUSED_BYTES, _softmax_  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

assert attention._c_softmax is not None and attention._c_softmax.AVX512F, "kernels._softmax does not run here"
timer = timer_for("cpu")
print(f"{_cpu_model()}, malloc {mode}, torch {torch.__version__}")

torch.manual_seed(0)
print("\nlargest relative error against float64, (4, 512, 512)")
for spread in (1.0, 8.0, 64.0):
    x = torch.randn(4, 512, 512) * spread
    want = torch.softmax(x.double(), -1)
    theirs, ours = torch.softmax(x, -1), _softmax_(x.clone())
    tiny = want > 1e-30  # relative error where the probability is a normal float
    err = {name: ((got.double() - want).abs()[tiny] / want[tiny]).max().item()
           for name, got in (("torch.softmax", theirs), ("kernels._softmax", ours))}
    print(f"   scores x {spread:4.0f}: " + ", ".join(f"{k} {v:.2e}" for k, v in err.items()))

print("\ntorch.softmax / kernels._softmax on one chunk of the fused path's scores")
for threads in (2, 1):
    torch.set_num_threads(threads)
    for s in (512, 256, 128, 64):
        heads = min(64, max(1, FUSED_BYTES // ((2 * s * 64 + s * s) * 4)))  # of B8 H8's 64
        x = torch.randn(heads, s, s)
        line = versus(timer, lambda x=x: torch.softmax(x, -1, out=x), lambda x=x: _softmax_(x), calls=(20, 20))
        print(f"   {threads} thread(s), S={s:3d}, {heads:2d} heads: {line}", flush=True)
