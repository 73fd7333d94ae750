"""Non-causal fp32 attention at S=512 on the CPU: torch's flash CPU kernel (SDPA) against an
explicit matmul-softmax-matmul over a few heads at a time, and against rotating q and k one batch
row at a time before SDPA.

    python -m evidence.attention_s512_explicit [cache|default]

Whether anything within reach leads SDPA at this size, where `rope_attention` calls it (the
rotate-then-SDPA bound of docs/peers.md). Explicit: for each group of ``heads`` of the B*H heads,
scores by ``baddbmm`` (the 1/sqrt(D) scale as its alpha) into one reused buffer, softmax in place,
then ``bmm`` into the output: the (S, S) scores of a group stay in the caches, which the all-heads
explicit path of kernels/attention.py (used up to 128 positions) does not allow at 512. Then
``rope_attention`` as it is (both tensors rotated, then one SDPA call) against rotating the
tensors one batch row at a time, each row's SDPA reading its rotated q and k from the caches.
B8 H8 S512 D64 fp32, 2 threads; each line: SDPA's time (or the whole call's) over the variant's,
point (95% CI) and the two medians from 15 interleaved ABBA pairs (evidence/ab.py). Every
variant is checked against SDPA's result at the project's tolerance.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import kernels  # noqa: E402
from correctness_tests.tolerances import REDUCTION, assert_close  # noqa: E402
from evidence.ab import versus  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

torch.set_num_threads(2)
timer = timer_for("cpu")
B, H, S, D = 8, 8, 512, 64


def explicit(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Callable[[], Tensor]:
    """softmax(q k^T / sqrt(D)) v, ``heads`` of the B*H heads at a time, scores in one buffer."""
    qf, kf, vf = (t.reshape(B * H, S, D) for t in (q, k, v))

    def run() -> Tensor:
        out = torch.empty(B * H, S, D)
        scores = torch.empty(heads, S, S)
        for i in range(0, B * H, heads):
            j = min(i + heads, B * H)
            s = scores[: j - i]
            torch.baddbmm(s, qf[i:j], kf[i:j].transpose(1, 2), beta=0, alpha=D**-0.5, out=s)
            torch._softmax(s, -1, False, out=s)
            torch.bmm(s, vf[i:j], out=out[i:j])
        return out.view(B, H, S, D)

    return run


def by_row(q: Tensor, k: Tensor, v: Tensor, rope: kernels.RotaryEmbedding) -> Callable[[], Tensor]:
    """rope_attention's work with q and k rotated one batch row at a time, each row's SDPA next."""
    return lambda: torch.cat([F.scaled_dot_product_attention(rope.paired(q[b : b + 1]), rope.paired(k[b : b + 1]),
                                                             v[b : b + 1]) for b in range(B)])


torch.manual_seed(0)
q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
      f"B{B} H{H} S{S} D{D} fp32, non-causal")
sdpa = lambda: F.scaled_dot_product_attention(q, k, v)
want = sdpa()
for heads in (2, 4, 8, 16):
    fn = explicit(q, k, v, heads)
    assert_close(fn(), want, REDUCTION)
    print(f"SDPA / explicit, {heads} heads at a time: {versus(timer, sdpa, fn)}", flush=True)
rope = kernels.RotaryEmbedding(D)
whole = lambda: kernels.rope_attention(q, k, v, rope)
rows = by_row(q, k, v, rope)
assert_close(rows(), whole(), REDUCTION)
print(f"rope_attention / rotated and attended by batch row: {versus(timer, whole, rows)}", flush=True)
qr, kr = rope.paired(q), rope.paired(k)
print(f"SDPA on q, k rotated before / rope_attention: "
      f"{versus(timer, lambda: F.scaled_dot_product_attention(qr, kr, v), whole)}", flush=True)
