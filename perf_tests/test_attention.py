"""RoPE attention, B8 H8 D64, causal or not: per-call RoPE + explicit softmax (the reference)
against cached RoPE + SDPA (or, on CPU fp32 up to 192 positions, the measured explicit path of
kernels/attention.py). Forward, as the MEASUREMENTS.md rows; the timed result must equal the
reference's.

Measured on the 2-core CPU (AMD EPYC, --perf-malloc cache), alone and in the whole suite: S=128
1.17-1.78x (reference 2.31-3.04 ms, kernel 1.68-2.11; the low end in a whole-suite run where this
test came first), causal 1.41-1.70x; S=512 1.42-1.66x (35.6-36.3 -> 21.9-25.1 ms), causal
1.64-1.92x. Floors: 1.05x at S=128, under that spread (it still fails a kernel that lost its
fast path, which measures ~1.0x), 1.2x at S=512. The issue aimed at 1.5x at S=128 (met in most
measurements, not all) and 3x at S=512 (not met): torch's flash CPU kernel needs 22-24 ms at
S=512 here and no path measured faster (the explicit one 24.7, blocked 21.9-29.2), while the
reference, which writes the 67 MB score matrix, is only 35.6: this host streams memory at
~150 GB/s, where MEASUREMENTS.md's Xeon (3.0-3.8x) had 24-37 GB/s.
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
