"""RoPE attention, B8 H8 D64, S=128 and 512, causal or not: per-call RoPE + explicit softmax (the
reference) against cached RoPE + scaled_dot_product_attention. Forward, as in inference and as
the MEASUREMENTS.md rows; the timed result must equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

import kernels
import reference
from correctness_tests.tolerances import REDUCTION, assert_close

IMPLS = {"reference": reference, "optimized": kernels}


@pytest.mark.speedup(cpu=1.0)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq", [128, 512])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_rope_attention(perf, impl: str, seq: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 8, seq, 64, device=perf.device) for _ in range(3))
    rope = kernels.RotaryEmbedding(64).to(perf.device)
    fn = IMPLS[impl].rope_attention
    got = perf(lambda: fn(q, k, v, rope, causal=causal), label=f"B8 H8 S{seq} D64")
    assert_close(got, reference.rope_attention(q, k, v, rope, causal=causal), REDUCTION)
