"""The RoPE rotation of one (B, H, S, D) tensor, forward and backward (B8 H8 S512 D64 at smoke
size, 8 MiB: past the caches of one core, so the passes over memory count): cos/sin recomputed
and x cos + rotate_half(x) sin (the reference) against kernels.RotaryEmbedding (cached tables; on
the CPU in float32 one pass each way, kernels/_rope.c). Every row rotates interleaved pairs
(2i, 2i + 1), the layout rotary-embedding-torch computes and the one attention's paired rotation
writes, so the peer rows compare like with like. The timed gradient must equal the reference's.

Peer rows: rotary-embedding-torch's rotation (its cached frequencies), what a user would call
instead, checked against the reference at the tolerance of its fp32 angles
(correctness_tests/tolerances.py, FP32_ANGLES); and torch.compile of the reference
(perf_tests/peers.py).
"""

from __future__ import annotations

import pytest
import torch

import kernels
import reference
from correctness_tests.tolerances import ELEMENTWISE, FP32_ANGLES, assert_close
from perf_tests.peers import COMPILED, ROTATION, compiled, rotary_rotation

SHAPE = {"smoke": (8, 8, 512, 64), "full": (4, 32, 2048, 128)}


def rotate(rope: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """rope(x): a module-level function, so torch.compile compiles it once."""
    return rope(x)


@pytest.mark.speedup(cpu={"smoke": 4.3})
@pytest.mark.speedup(cpu={"smoke": 6.0}, over=ROTATION)
@pytest.mark.speedup(cpu={"smoke": 23.0}, over=COMPILED)
@pytest.mark.parametrize("impl", ["reference", "optimized", ROTATION, COMPILED])
def test_rope_rotation(perf, impl: str) -> None:
    torch.manual_seed(0)
    b, h, s, d = SHAPE[perf.size]
    x = torch.randn(b, h, s, d, device=perf.device, requires_grad=True)
    grad = torch.randn(b, h, s, d, device=perf.device)
    side = reference if impl in ("reference", COMPILED) else kernels
    rope = side.RotaryEmbedding(d, interleaved=True).to(perf.device)
    if impl == ROTATION:
        forward = rotary_rotation(d, perf.device)
    elif impl == COMPILED:
        forward = lambda x: compiled(rotate)(rope, x)
    else:
        forward = rope
    got = perf(lambda: torch.autograd.grad(forward(x), x, grad)[0], label=f"B{b} H{h} S{s} D{d}")
    want = reference.RotaryEmbedding(d, interleaved=True)(x)
    assert_close(got, torch.autograd.grad(want, x, grad)[0], FP32_ANGLES if impl == ROTATION else ELEMENTWISE)
