"""Where rope_attention's fused CPU path spends its time, against rotating first and SDPA.

    python -m evidence.fused_attention_parts [cache|default]

At 2 threads, D 64, B8 H8, no mask: the fused path's calls of the C rotation (each chunk's q and k)
and of its softmax are timed by wrapping kernels.attention's own functions (the loop is the
module's); the rest of the call is its two matmuls and the loop. Beside it, the rotations of the
whole q and k (``RotaryEmbedding.paired``) and SDPA over them, the other path's two parts. Per call,
medians over 9 blocks of 3 calls, the two paths' blocks in turn.
"""

import statistics
import sys
import time

from perfgate.timing import configure_malloc

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from unittest import mock  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
import kernels.attention as KA  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402


def clocked(fn, spent: list[float]):
    """``fn``, adding each call's seconds to spent[0]."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return run


def parts(s: int, rounds: int = 9, calls: int = 3) -> str:
    """One line at S=s: each path's parts, per call, medians over ``rounds`` blocks of ``calls`` calls."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 8, s, 64) for _ in range(3))
    rope = kernels.RotaryEmbedding(64)
    times: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # the first round warms up and is dropped
        rot, soft = [0.0], [0.0]
        with (mock.patch.object(KA, "_fuses", lambda *a: True),
              mock.patch.object(KA, "rotate_into", clocked(KA.rotate_into, rot)),
              mock.patch.object(KA, "_softmax_", clocked(KA._softmax_, soft))):
            start = time.perf_counter()
            for _ in range(calls):
                kernels.rope_attention(q, k, v, rope)
            call = time.perf_counter() - start
        turning, attending = 0.0, 0.0
        for _ in range(calls):
            start = time.perf_counter()
            rq, rk = rope.paired(q), rope.paired(k)
            turned = time.perf_counter()
            F.scaled_dot_product_attention(rq, rk, v)
            turning, attending = turning + turned - start, attending + time.perf_counter() - turned
        if r:
            for key, t in (("fused", call), ("chunk rotations", rot[0]), ("softmax", soft[0]),
                           ("whole rotations", turning), ("SDPA", attending)):
                times.setdefault(key, []).append(t / calls * 1e3)
    ms = {key: statistics.median(t) for key, t in times.items()}
    rest = ms["fused"] - ms["chunk rotations"] - ms["softmax"]
    return (f"S={s}: fused {ms['fused']:.2f} ms = chunk rotations {ms['chunk rotations']:.2f} + softmax "
            f"{ms['softmax']:.2f} + matmuls and loop {rest:.2f}; rotated first "
            f"{ms['whole rotations'] + ms['SDPA']:.2f} ms = whole rotations {ms['whole rotations']:.2f} + "
            f"SDPA {ms['SDPA']:.2f}")


torch.set_num_threads(2)
print(f"{_cpu_model()}, malloc {mode}, torch {torch.__version__}, 2 threads; B8 H8 D64 fp32, not causal, no mask")
for s in (128, 192, 256, 384, 512):
    print(parts(s), flush=True)
