"""RoPE attention, B8 H8 D64, causal or not: per-call RoPE + explicit softmax (the reference)
against cached RoPE + SDPA (or, on CPU fp32 up to 192 positions, the measured explicit path of
kernels/attention.py). Forward only; the timed result must equal the reference's.

The floors sit under the measured spread and above a kernel that lost its fast path (~1.0x)
(docs/measurements/from-the-code.md).
"""

from __future__ import annotations

import pytest
import torch

import kernels
import reference
from correctness_tests.tolerances import REDUCTION, assert_close

IMPLS = {"reference": reference, "optimized": kernels}


def _time(perf, impl: str, seq: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 8, seq, 64, device=perf.device) for _ in range(3))
    rope = kernels.RotaryEmbedding(64).to(perf.device)
    fn = IMPLS[impl].rope_attention
    got = perf(lambda: fn(q, k, v, rope, causal=causal), label=f"B8 H8 S{seq} D64")
    assert_close(got, reference.rope_attention(q, k, v, rope, causal=causal), REDUCTION)


@pytest.mark.speedup(cpu=1.05)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_rope_attention_s128(perf, impl: str, causal: bool) -> None:
    _time(perf, impl, 128, causal)


@pytest.mark.speedup(cpu=1.2)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_rope_attention_s512(perf, impl: str, causal: bool) -> None:
    _time(perf, impl, 512, causal)
