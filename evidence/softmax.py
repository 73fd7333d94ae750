"""The fused attention's softmax (kernels._softmax: AVX-512F and AVX2 kernels) against torch.softmax,
in place over the last dim, interleaved in one process: its error, and its time on the fused path's
chunks.

    python -m evidence.softmax [cache|default]
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m evidence.softmax
        (torch's and MKL's AVX2 code: a stand-in for a CPU without AVX-512)

Error: the largest relative error of each against float64's softmax, over scores of a (4, 512,
512) chunk at three spreads (the largest probability near 1 and the rest underflowing at 64).
Time: each chunk of scores the fused path makes (kernels/attention.py, FUSED_BYTES: B8 H8 D64,
4-64 heads a chunk at S=512-64), torch.softmax(out=) over each kernel this CPU runs, 1 and 2
threads, point (95% CI) and the two medians of 15 interleaved ABBA pairs (evidence/ab.py). Then
the whole of rope_attention (B8 H8 D64, 2 threads, the fused path) with torch.softmax over it
with each kernel. Then masked scores: the chunks at S=128 and 64 with 30% of their scores -inf
(each call copies them in first, both sides), and rope_attention at S=128 with a boolean mask
keeping 70% of the keys, torch.softmax over each kernel.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from unittest import mock  # noqa: E402

import torch  # noqa: E402

import kernels  # noqa: E402
import kernels.attention as KA  # noqa: E402
from evidence.ab import versus  # noqa: E402
from kernels.attention import FUSED_BYTES, _c_softmax  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

assert _c_softmax is not None and _c_softmax.ISAS, "kernels._softmax runs no kernel here"
timer = timer_for("cpu")
print(f"{_cpu_model()}, malloc {mode}, torch {torch.__version__} (its kernels: "
      f"{torch.backends.cpu.get_cpu_capability()}), kernels._softmax: {', '.join(_c_softmax.ISAS)}")


def ours(isa: str, threads: int):
    def run(x: torch.Tensor) -> torch.Tensor:
        _c_softmax.softmax_(x.numpy(), threads, isa)
        return x

    return run


torch.manual_seed(0)
print("\nlargest relative error against float64, (4, 512, 512)")
for spread in (1.0, 8.0, 64.0):
    x = torch.randn(4, 512, 512) * spread
    want = torch.softmax(x.double(), -1)
    tiny = want > 1e-30  # relative error where the probability is a normal float
    got = {"torch.softmax": torch.softmax(x, -1), **{isa: ours(isa, 2)(x.clone()) for isa in _c_softmax.ISAS}}
    err = {name: ((g.double() - want).abs()[tiny] / want[tiny]).max().item() for name, g in got.items()}
    print(f"   scores x {spread:4.0f}: " + ", ".join(f"{k} {v:.2e}" for k, v in err.items()))

print("\ntorch.softmax / kernels._softmax on one chunk of the fused path's scores")
for threads in (2, 1):
    torch.set_num_threads(threads)
    for s in (512, 256, 128, 64):
        heads = min(64, max(1, FUSED_BYTES // ((2 * s * 64 + s * s) * 4)))  # of B8 H8's 64
        x = torch.randn(heads, s, s)
        for isa in _c_softmax.ISAS:
            f = ours(isa, threads)
            line = versus(timer, lambda x=x: torch.softmax(x, -1, out=x), lambda x=x, f=f: f(x), calls=(20, 20))
            print(f"   {threads} thread(s), S={s:3d}, {heads:2d} heads, {isa:7s}: {line}", flush=True)

rope = kernels.RotaryEmbedding(64, interleaved=True)


def attend(isa: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """rope_attention through kernels._softmax's ``isa`` kernel, or through torch.softmax (None)."""
    def run() -> torch.Tensor:
        off = mock.patch.object(KA, "_c_softmax", None)
        with off if isa is None else mock.patch.object(_c_softmax, "ISA", isa):
            return kernels.rope_attention(q, k, v, rope, attn_mask=mask)

    return run


print("\nrope_attention with torch.softmax / with each kernel, B8 H8 D64, 2 threads")
torch.set_num_threads(2)
for s in (128, 512):
    q, k, v = (torch.randn(8, 8, s, 64) for _ in range(3))
    for isa in _c_softmax.ISAS:
        print(f"   S={s:3d}, {isa:7s}: {versus(timer, attend(None, q, k, v), attend(isa, q, k, v))}", flush=True)

print("\ntorch.softmax / kernels._softmax, 30% of the scores masked (-inf), 2 threads (a copy in first)")
torch.set_num_threads(2)
for s in (128, 64):
    heads = min(64, max(1, FUSED_BYTES // ((2 * s * 64 + s * s) * 4)))
    src = torch.randn(heads, s, s).masked_fill(torch.rand(heads, s, s) < 0.3, float("-inf"))
    src[..., 0] = 0.0  # every row keeps a key
    x = src.clone()
    for isa in _c_softmax.ISAS:
        f = ours(isa, 2)
        line = versus(timer, lambda x=x, src=src: torch.softmax(x.copy_(src), -1, out=x),
                      lambda x=x, src=src, f=f: f(x.copy_(src)), calls=(20, 20))
        print(f"   S={s:3d}, {heads:2d} heads, {isa:7s}: {line}", flush=True)

print("\nrope_attention with a boolean mask (70% of the keys kept), torch.softmax / each kernel, B8 H8 D64, "
      "2 threads")
q, k, v = (torch.randn(8, 8, 128, 64) for _ in range(3))
mask = torch.rand(8, 1, 128, 128) < 0.7
mask[..., 0] = True
for isa in _c_softmax.ISAS:
    line = versus(timer, attend(None, q, k, v, mask), attend(isa, q, k, v, mask))
    print(f"   S=128, {isa:7s}: {line}", flush=True)
