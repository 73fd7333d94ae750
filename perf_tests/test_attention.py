"""RoPE attention, B8 H8 D64, causal or not: per-call RoPE + explicit softmax (the reference)
against cached RoPE + SDPA (on CPU the measured paths of kernels/attention.py: in fp32 the
rotation fused into the attention a chunk of heads at a time, without the causal mask up to 512
positions at 2 threads on AMD CPUs and 192 on Intel ones, with it at those lengths up to 256
(docs/kernels/attention.md); causal SDPA in blocks of query rows over 384-512 positions). Forward
only;
the timed result must equal the reference's.

The floors sit under the measured spread and above a kernel that lost its fast path (~1.0x)
(evidence/from-the-code.md).

Peer row: rotary-embedding-torch (interleaved pairs, its cached frequencies) then SDPA, what a
user would write instead; checked against the reference with the same (interleaved) rotation.
Skipped, with the reason, where rotary-embedding-torch is not installed. And torch.compile of the
reference (perf_tests/peers.py), a user's first alternative to a hand-written kernel.

Ablation row "sdpa alone": SDPA on q and k rotated before the timing, the time any
rotate-then-SDPA implementation at least takes; "optimized vs sdpa alone" is then the share of
that bound ours reaches (under 1x: what its rotation costs; over 1x: the lead of a path that does
less than one SDPA call, the fused one's or the causal blocks').

Ablation row on CUDA: ``optimized+cudagraphs``, the optimized call replayed from a CUDA graph,
what launches cost a forward of tens of microseconds (perf_tests/graphs.py; skipped elsewhere).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
import reference
from correctness_tests.tolerances import REDUCTION, assert_close
from perf_tests.graphs import GRAPHED, cuda_graphed
from perf_tests.peers import COMPILED, compiled, rotary_attention
from perf_tests.peers import ROTARY as PEER

IMPLS = {"reference": reference, "optimized": kernels}
SDPA_ALONE = "sdpa alone"


def _time(perf, impl: str, seq: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 8, seq, 64, device=perf.device) for _ in range(3))
    rope = kernels.RotaryEmbedding(64).to(perf.device)
    if impl == PEER:  # the interleaved RoPE, which rotary-embedding-torch computes
        rotary = rotary_attention(64, perf.device)
        rope = kernels.RotaryEmbedding(64, interleaved=True).to(perf.device)
        fn = lambda: rotary(q, k, v, causal=causal)
    elif impl == COMPILED:
        fn = lambda: compiled(reference.rope_attention)(q, k, v, rope, causal=causal)
    elif impl == SDPA_ALONE:
        qr, kr = rope(q), rope(k)
        fn = lambda: F.scaled_dot_product_attention(qr, kr, v, is_causal=causal)
    elif impl == GRAPHED:
        fn = cuda_graphed(lambda: kernels.rope_attention(q, k, v, rope, causal=causal), perf.device)
    else:
        fn = lambda: IMPLS[impl].rope_attention(q, k, v, rope, causal=causal)
    got = perf(fn, label=f"B8 H8 S{seq} D64")
    assert_close(got, reference.rope_attention(q, k, v, rope, causal=causal), REDUCTION)


@pytest.mark.speedup(cpu=1.05, cuda={"full": 1.5})
@pytest.mark.speedup(cpu={"smoke": 0.85}, over=PEER)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.speedup(cpu={"smoke": 1.9}, over=COMPILED)
@pytest.mark.speedup(over=SDPA_ALONE)
@pytest.mark.parametrize("impl", [*IMPLS, PEER, COMPILED, SDPA_ALONE, GRAPHED])
def test_rope_attention_s128(perf, impl: str, causal: bool) -> None:
    _time(perf, impl, 128, causal)


@pytest.mark.speedup(cpu=1.2, cuda={"full": 1.5})
@pytest.mark.speedup(cpu={"smoke": 0.85}, over=PEER)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.speedup(cpu={"smoke": 1.6}, over=COMPILED)
@pytest.mark.speedup(over=SDPA_ALONE)
@pytest.mark.parametrize("impl", [*IMPLS, PEER, COMPILED, SDPA_ALONE, GRAPHED])
def test_rope_attention_s512(perf, impl: str, causal: bool) -> None:
    _time(perf, impl, 512, causal)


TRAIN_BATCH = {"smoke": 32, "full": 128}  # the RoPE ViT's batch; its attention layer: S 64, dim 192, 6 heads


@pytest.mark.speedup(cpu={"smoke": 0.95})
@pytest.mark.speedup(cpu={"smoke": 1.0}, over=PEER)
@pytest.mark.speedup(cpu={"smoke": 1.1}, over=COMPILED)
@pytest.mark.parametrize("impl", [*IMPLS, PEER, COMPILED])
def test_rope_self_attention_training(perf, impl: str) -> None:
    """RopeSelfAttention's forward and backward in fp32 (the gradients of x and every parameter) at
    the RoPE ViT's attention layer: the reference module against ours (on CPU the projected
    attention, kernels/attention.py), the reference compiled, and the peer: rotary-embedding-torch
    and SDPA between the same two projections, checked against the interleaved reference. Its
    floors say "not slower" (evidence/floors.md); the kernel's measurements:
    evidence/attention_training.py."""
    torch.manual_seed(0)
    b, s, dim, heads = TRAIN_BATCH[perf.size], 64, 192, 6
    x = torch.randn(b, s, dim, device=perf.device, requires_grad=True)
    grad = torch.randn(b, s, dim, device=perf.device)
    interleaved = impl == PEER  # the pairs rotary-embedding-torch rotates
    ours = kernels.RopeSelfAttention(dim, heads, interleaved=interleaved).to(perf.device)
    ref = reference.RopeSelfAttention(dim, heads, interleaved=interleaved).to(perf.device)
    ref.load_state_dict(ours.state_dict())
    if impl == PEER:
        attend = rotary_attention(dim // heads, perf.device)
        forward = lambda x: ref.proj(attend(*ref.qkv(x).view(b, s, 3 * heads, -1).transpose(1, 2).split(heads, 1),
                                            causal=False).transpose(1, 2).reshape(b, s, dim))
    else:
        forward = {"optimized": ours, "reference": ref, COMPILED: compiled(ref)}[impl]
    params = [x, *ref.parameters()] if impl != "optimized" else [x, *ours.parameters()]
    got = perf(lambda: torch.autograd.grad(forward(x), params, grad), label=f"B{b} S{s} dim {dim} heads {heads}")
    want = torch.autograd.grad(ref(x), [x, *ref.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, REDUCTION)
