"""What bounds rope_attention's lead over rotary-embedding-torch + SDPA at S=512, non-causal, fp32,
on the CPU: its parts timed alone, interleaved in one process with the whole calls.

    python -m evidence.attention_s512_ceiling [cache|default] [threads, default 2]

The perf suite's row (B8 H8 S512 D64, interleaved RoPE; 2 threads unless told). Timed, medians of interleaved
rounds (evidence/ab.py): ours (the fused path), the peer, SDPA on q and k rotated before, the
peer's rotation of q and k alone, ours' rotation alone and followed by SDPA (the unfused path);
then the fused path's own parts over its chunks of heads (kernels/attention.py, FUSED_BYTES),
each alone on q and k rotated before: the two matmuls (scores by ``baddbmm``, then probabilities
times v by ``bmm``), and the softmax in place, by torch.softmax and by the fused path's own
(``_softmax_``: kernels._softmax's widest kernel here). Ours cannot take less than its matmuls
plus its softmax, so the peer's time over that sum is the most ours could lead by with nothing
else left to trim. The peer is SDPA plus its rotation, so an attention no faster than SDPA leads
it by the rotation's share of SDPA's time at most (peer / SDPA alone). The roofline's least time
(its FLOPs at this machine's float32 GEMM peak, perfgate's measure) is printed beside it.
"""

import sys
from collections.abc import Callable

from perfgate.timing import configure_malloc

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from correctness_tests.tolerances import REDUCTION, assert_close  # noqa: E402
from evidence.ab import medians  # noqa: E402
from kernels.attention import FUSED_BYTES, _softmax_  # noqa: E402
from perf_tests.peers import rotary_attention, rotary_rotation  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from perfgate.roofline import Limits  # noqa: E402

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
B, H, S, D = 8, 8, 512, 64
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
rope = kernels.RotaryEmbedding(D, interleaved=True)  # the rotation rotary-embedding-torch computes
peer, peer_rotate = rotary_attention(D, "cpu"), rotary_rotation(D, "cpu")
qr, kr = rope.paired(q), rope.paired(k)
assert_close(kernels.rope_attention(q, k, v, rope), peer(q, k, v, causal=False), REDUCTION)

# the fused path's chunks: heads whose rotated q, k and scores fit FUSED_BYTES (no grouped heads)
per = max(1, FUSED_BYTES // ((2 * S * D + S * S) * 4))
qf, kf, vf = (t.reshape(B * H, S, D) for t in (qr, kr, v))
scores, out = torch.empty(per, S, S), torch.empty(B * H, S, D)
torch.baddbmm(scores, qf[:per], kf[:per].transpose(1, 2), beta=0, alpha=D**-0.5, out=scores)  # real scores


def matmuls() -> None:
    for i in range(0, B * H, per):
        sc = scores[: min(per, B * H - i)]
        torch.baddbmm(sc, qf[i : i + per], kf[i : i + per].transpose(1, 2), beta=0, alpha=D**-0.5, out=sc)
        torch.bmm(sc, vf[i : i + per], out=out[i : i + per])


def softmaxes(softmax) -> Callable[[], None]:
    def run() -> None:
        for i in range(0, B * H, per):
            softmax(scores[: min(per, B * H - i)])  # the cost of exp does not depend on the values

    return run


fns = {"ours (rope_attention)": lambda: kernels.rope_attention(q, k, v, rope),
       "peer (rotary-embedding-torch + SDPA)": lambda: peer(q, k, v, causal=False),
       "SDPA on q, k rotated before": lambda: F.scaled_dot_product_attention(qr, kr, v),
       "peer's rotation of q and k": lambda: (peer_rotate(q), peer_rotate(k)),
       "ours' rotation of q and k": lambda: (rope.paired(q), rope.paired(k)),
       "ours' rotation, then SDPA": lambda: F.scaled_dot_product_attention(rope.paired(q), rope.paired(k), v),
       "ours' matmuls alone": matmuls,
       "torch.softmax alone": softmaxes(lambda sc: torch.softmax(sc, -1, out=sc)),
       "ours' softmax alone": softmaxes(_softmax_)}
flops = 2 * 2 * B * H * S * S * D  # two matmuls, as torch's flop counter counts SDPA
limits = Limits("cpu", "probe", None)
print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
      f"B{B} H{H} S{S} D{D} fp32, non-causal; {per} heads a chunk")
for run in range(3):
    ms = medians(fns, rounds=10, calls=3)
    print(f"\nround {run + 1}, medians of 30 calls, ms")
    for name, t in ms.items():
        extra = f"  {flops / t / 1e6:.0f} GFLOP/s" if name == "ours' matmuls alone" else ""
        print(f"   {name:38s} {t:7.2f}{extra}")
    least = ms["ours' matmuls alone"] + ms["ours' softmax alone"]
    peer_ms, ours = ms["peer (rotary-embedding-torch + SDPA)"], ms["ours (rope_attention)"]
    sdpa, unfused = ms["SDPA on q, k rotated before"], ms["ours' rotation, then SDPA"]
    print(f"   peer / ours {peer_ms / ours:.2f}x; peer / (ours' matmuls + softmax, {least:.2f} ms) "
          f"{peer_ms / least:.2f}x at most; 1.2x needs ours at {peer_ms / 1.2:.2f} ms")
    # the peer is SDPA plus its rotation: an attention no faster than SDPA leads it by that rotation's share
    print(f"   peer / SDPA alone {peer_ms / sdpa:.2f}x (ours no faster than SDPA: at most that); "
          f"peer / (ours' rotation, then SDPA) {peer_ms / unfused:.2f}x")
print(f"\nroofline: {flops / 1e9:.2f} GFLOP at the float32 GEMM peak {limits.peak('float32'):.1f} GFLOP/s "
      f"(perfgate's measure, this process) = {flops / limits.peak('float32') / 1e6:.2f} ms")
