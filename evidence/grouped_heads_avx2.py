"""rope_attention with grouped-query heads where kernels._softmax runs its AVX2 kernel: the fused
path (taken up to 512 positions at 2 threads before grouped heads stopped at CPU_FUSED_SEQ there)
against what the call takes now (rotating q and k first, then SDPA), interleaved in one process.

    python -m evidence.grouped_heads_avx2

B8, 8 q heads over 2 kv heads, D64, fp32, 2 threads, perfgate's cache malloc; the fused side is
the same call with CPU_FUSED_SEQ raised to 512. Point (95% CI) and the two medians from 15
interleaved ABBA pairs (evidence/ab.py); both results checked equal first.
"""

from perfgate.timing import configure_malloc, timer_for

configure_malloc("cache")  # before any large allocation

from unittest import mock  # noqa: E402

import torch  # noqa: E402

import kernels  # noqa: E402
import kernels.attention as KA  # noqa: E402
from correctness_tests.tolerances import REDUCTION, assert_close  # noqa: E402
from evidence.ab import versus  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

torch.set_num_threads(2)
timer = timer_for("cpu")
print(f"{_cpu_model()}, softmax kernel {KA._softmax_in_c() or 'torch'}, 2 threads; fused (before) / now")
for s in (256, 384, 512):
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 8, s, 64), torch.randn(8, 2, s, 64), torch.randn(8, 2, s, 64)
    rope = kernels.RotaryEmbedding(64)

    def fused(q=q, k=k, v=v, rope=rope) -> torch.Tensor:
        with mock.patch.object(KA, "CPU_FUSED_SEQ", 512):
            return kernels.rope_attention(q, k, v, rope)

    now = lambda q=q, k=k, v=v, rope=rope: kernels.rope_attention(q, k, v, rope)  # noqa: E731
    with mock.patch.object(KA, "CPU_FUSED_SEQ", 512):
        assert KA._fuses(q, k, v, rope, False, None, None), "the fused side must take the fused path"
    assert KA._softmax_in_c() != "avx2" or not KA._fuses(q, k, v, rope, False, None, None)
    assert_close(fused(), now(), REDUCTION)
    print(f"S={s}: {versus(timer, fused, now)}", flush=True)
