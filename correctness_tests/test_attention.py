"""kernels.rope_attention / RopeSelfAttention == reference (per-call RoPE, explicit softmax), outputs
and gradients of q, k, v; bf16 against an fp64 oracle; refusals; the fused path's softmax."""

from __future__ import annotations

import copy
import itertools
import platform
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given
from hypothesis import strategies as st

import kernels
import kernels.attention as KA
import reference.attention as RA
from correctness_tests.conftest import torch_threads
from correctness_tests.tolerances import ELEMENTWISE, REDUCTION, assert_close, assert_dicts_close
from kernels.rope import RotaryEmbedding

SIDES = {"kernels": kernels, "reference": RA}

# the fused path's softmax (kernels.attention._softmax_): kernels._softmax's kernels, or torch.softmax
C = KA._c_softmax
ISAS = () if C is None else C.ISAS  # the C kernels this CPU runs, widest first
runs_c = pytest.mark.skipif(not ISAS, reason="kernels._softmax not built, or none of its kernels runs here")
# each softmax test runs through every C kernel this CPU runs and through torch.softmax ("torch")
SOFTMAX_PATHS = pytest.mark.parametrize("path", [*ISAS, "torch"])
EACH_ISA = pytest.mark.parametrize("isa", [pytest.param(isa) for isa in ISAS] or
                                   [pytest.param("avx512f", marks=runs_c)])


def through_softmax(path: str):
    """``_softmax_`` goes through ``path``: one of the C kernels, or torch.softmax."""
    return mock.patch.object(KA, "_c_softmax", None) if path == "torch" else mock.patch.object(C, "ISA", path)


AMD = "AuthenticAMD"  # the vendor whose fused-path lengths are the longest (CPU_FUSED_SEQ_TWO_THREADS)
VENDORS = ("AuthenticAMD", "GenuineIntel", "")  # "": a CPU /proc/cpuinfo names no vendor of


def on_cpu(vendor: str):
    """kernels.attention chooses its path as on a CPU of ``vendor``."""
    return mock.patch.object(KA.cpu, "vendor", lambda: vendor)


@st.composite
def problems(draw: st.DrawFn, dtypes=(torch.float32, torch.float64)) -> dict:
    b, hk, groups = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    h, s, d = hk * groups, draw(st.integers(1, 40)), 2 * draw(st.integers(4, 64))
    dtype = draw(st.sampled_from(dtypes))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(b, n, s, d, dtype=dtype) for n in (h, hk, hk))
    mask = None
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    if kind != "none":
        shape = draw(st.sampled_from([(s, s), (b, 1, s, s), (1, h, s, s), (b, 1, 1, s)]))
        if kind == "bool":
            mask = torch.rand(shape) < 0.7
            mask[..., 0] = True  # every query keeps key 0 (causal too)
        else:
            mask = (2 * torch.randn(shape)).to(dtype)
    rope = RotaryEmbedding(d, max_seq_len=8, interleaved=draw(st.booleans()))  # S up to 40 grows it
    return dict(q=q, k=k, v=v, rope=rope, causal=draw(st.booleans()), attn_mask=mask)


def _forward_backward(side, p: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    qkv = [p[n].detach().to(dtype or p[n].dtype).requires_grad_(True) for n in "qkv"]
    mask = p["attn_mask"]
    if mask is not None and mask.is_floating_point():
        mask = mask.to(qkv[0].dtype)
    out = side.rope_attention(*qkv, p["rope"], causal=p["causal"], attn_mask=mask)
    grads = torch.autograd.grad(out, qkv, torch.ones_like(out) / out.numel() ** 0.5)
    return out, *grads


@given(problems(), st.booleans(), st.one_of(st.none(), st.integers(1, 16)))
def test_outputs_and_gradients_equal_reference(p: dict, explicit: bool, block: int | None) -> None:
    """Every kernel path: SDPA, the explicit one wherever it may be taken (not causal), and causal
    SDPA in blocks of ``block`` query rows (any mask, grouped heads, a last block cut short)."""
    with (mock.patch.object(KA, "_takes_explicit", lambda q, causal: explicit and not causal),
          mock.patch.object(KA, "_causal_block", lambda q, causal: block if causal else None)):
        got = _forward_backward(kernels, p)
    want = _forward_backward(RA, p)
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
    assert_close(got[0], want[0], REDUCTION, msg="out")
    # gradients on one scale: dq is ~0 where softmax has one key, yet carries the backward's rounding
    assert_dicts_close(dict(zip("qkv", got[1:], strict=True)), dict(zip("qkv", want[1:], strict=True)), REDUCTION)


def test_explicit_path_only_where_it_measured_faster() -> None:
    """CPU fp32, not causal, up to CPU_MATH_MAX_SEQ positions (evidence/from-the-code.md)."""
    def q(s: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(1, 1, s, 8, dtype=dtype)
    assert KA._takes_explicit(q(KA.CPU_MATH_MAX_SEQ), causal=False)
    assert not KA._takes_explicit(q(KA.CPU_MATH_MAX_SEQ), causal=True)
    assert not KA._takes_explicit(q(KA.CPU_MATH_MAX_SEQ + 1), causal=False)
    assert not KA._takes_explicit(q(8, torch.float64), causal=False)


class Doubled(RotaryEmbedding):
    """A subclass with a paired rotation of its own (twice the plain one)."""

    def paired(self, x, *, offset=0, positions=None):
        return 2 * super().paired(x, offset=offset, positions=positions)


@given(problems(dtypes=(torch.float32,)), st.integers(1, 1 << 20), st.booleans(),
       st.sampled_from([None, "offset", "positions"]))
def test_fused_path_equals_reference(p: dict, budget: int, strided: bool, where: str | None) -> None:
    """The fused CPU path (each chunk's q and k rotated by the C pass, then its scores) at any chunk
    size, chunks of whole batch rows or of one row's heads; grouped heads, masks or the causal
    one, q, k and v as views into one projection (strides the C pass reads as they are), v of
    another head dim."""
    q, k, v, mask = p["q"], p["k"], p["v"], p["attn_mask"]
    b, h, s, d = q.shape
    hk = k.shape[1]
    if strided:  # as RopeSelfAttention's projection leaves them: (B, S, heads, D) transposed
        qkv = torch.randn(b, s, h + hk, d)
        q, k = qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:].transpose(1, 2)
        v = torch.randn(b, s, hk, d // 2).transpose(1, 2)
    kw = {"offset": {"offset": 5}, "positions": {"positions": torch.randperm(s) * 3}}.get(where, {})
    causal = p["causal"] and mask is None  # causal with a mask: SDPA (as measured)
    with (torch.no_grad(), mock.patch.object(KA, "FUSED_BYTES", budget),
          mock.patch.object(KA, "_fused_attention", wraps=KA._fused_attention) as fused):
        got = kernels.rope_attention(q, k, v, p["rope"], causal=causal, attn_mask=mask, **kw)
    assert fused.call_count == (1 if not causal or KA._softmax_in_c() else 0)  # causal: a C kernel's rows
    want = RA.rope_attention(q, k, v, p["rope"], causal=causal, attn_mask=mask, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, REDUCTION)


@SOFTMAX_PATHS
def test_fused_path_at_its_longest_and_at_the_default_chunks(path: str) -> None:
    """S = the longest CPU_FUSED_SEQ_TWO_THREADS (AMD's) at 2 threads, the module's chunk size:
    grouped heads but through kernels._softmax's AVX2 kernel (where they stop at CPU_FUSED_SEQ, and
    the heads here are one a kv head); a mask there takes SDPA."""
    s, groups = (KA.CPU_FUSED_SEQ_TWO_THREADS[AMD], 1 if path == "avx2" else 2)
    q, k, v = torch.randn(2, 2 * groups, s, 16), torch.randn(2, 2, s, 16), torch.randn(2, 2, s, 16)
    mask = torch.rand(2, 1, s, s) < 0.5
    mask[..., 0] = True
    rope = RotaryEmbedding(16)
    with (torch_threads(2), through_softmax(path), on_cpu(AMD),
          mock.patch.object(KA, "_fused_attention", wraps=KA._fused_attention) as fused):
        got = kernels.rope_attention(q, k, v, rope)
        assert fused.call_count == 1
        masked = kernels.rope_attention(q, k, v, rope, attn_mask=mask)
        assert fused.call_count == 1
    assert_close(got, RA.rope_attention(q, k, v, rope), REDUCTION)
    assert_close(masked, RA.rope_attention(q, k, v, rope, attn_mask=mask), REDUCTION)


@SOFTMAX_PATHS
def test_fused_path_at_one_thread_up_to_its_longest(path: str) -> None:
    """At 1 thread, S = the longest CPU_FUSED_SEQ_ONE_THREAD (AMD's) where kernels._softmax's
    AVX-512F kernel runs (CPU_FUSED_SEQ with its AVX2 kernel or torch.softmax), grouped heads."""
    s = KA.CPU_FUSED_SEQ_ONE_THREAD[AMD] if path == "avx512f" else KA.CPU_FUSED_SEQ
    q, k, v = torch.randn(2, 4, s, 16), torch.randn(2, 2, s, 16), torch.randn(2, 2, s, 16)
    rope = RotaryEmbedding(16)
    with (torch_threads(1), through_softmax(path), on_cpu(AMD),
          mock.patch.object(KA, "_fused_attention", wraps=KA._fused_attention) as fused):
        got = kernels.rope_attention(q, k, v, rope)
    assert fused.call_count == 1
    assert_close(got, RA.rope_attention(q, k, v, rope), REDUCTION)


def test_fused_path_only_where_it_measured_faster() -> None:
    """CPU fp32, up to CPU_FUSED_SEQ positions (causal: without another mask, where a C softmax kernel
    runs, where the unmasked path is taken up to CPU_FUSED_CAUSAL_SEQ; without a mask the
    CPU vendor's CPU_FUSED_SEQ_TWO_THREADS at 2 threads, for grouped heads not where
    kernels._softmax's AVX2 kernel runs, and its CPU_FUSED_SEQ_ONE_THREAD at 1 where the AVX-512F
    kernel runs; CPU_FUSED_SEQ on a CPU of no vendor measured), one table for all batch rows,
    nothing to differentiate, no autocast (evidence/fused-attention-zen4.txt, fused-attention-zen3.txt,
    fused-attention-xeon.txt, fused-causal-zen3.txt)."""
    rope = RotaryEmbedding(8)

    def fuses(s: int = 8, dtype: torch.dtype = torch.float32, *, causal: bool = False, mask=None,
              positions=None, grad: str = "", emb: torch.nn.Module = rope) -> bool:
        q, k, v = (torch.empty(2, 2, s, 8, dtype=dtype, requires_grad=n in grad) for n in "qkv")
        return KA._fuses(q, k, v, emb, causal, mask, positions)

    def longest(limits: dict[str, int], vendor: str) -> int:
        return limits.get(vendor, KA.CPU_FUSED_SEQ)

    for vendor in VENDORS:
        two, one = longest(KA.CPU_FUSED_SEQ_TWO_THREADS, vendor), longest(KA.CPU_FUSED_SEQ_ONE_THREAD, vendor)
        with on_cpu(vendor), torch_threads(2):
            assert fuses(two) and not fuses(two + 1), vendor
            mask = torch.ones(KA.CPU_FUSED_SEQ + 1, KA.CPU_FUSED_SEQ + 1, dtype=torch.bool)
            assert fuses(KA.CPU_FUSED_SEQ, mask=mask[1:, 1:]) and not fuses(KA.CPU_FUSED_SEQ + 1, mask=mask)
            # grouped-query heads (4 q heads over 2 kv heads) past 128: not with the AVX2 softmax
            for path in [*ISAS, "torch"]:
                with through_softmax(path):
                    grouped = [KA._fuses(torch.empty(2, 4, s, 8), *(torch.empty(2, 2, s, 8) for _ in "kv"), rope,
                                         False, None, None) for s in (KA.CPU_FUSED_SEQ, two)]
                    assert grouped == [True, path != "avx2" or two == KA.CPU_FUSED_SEQ], (vendor, path, grouped)
        with on_cpu(vendor), torch_threads(1):
            assert fuses(one) == (KA._softmax_in_c() == "avx512f" or one == KA.CPU_FUSED_SEQ), vendor
            assert not fuses(one + 1) and fuses(KA.CPU_FUSED_SEQ), vendor
            for path in [p for p in ISAS if p != "avx512f"] + ["torch"]:  # 128 at 1 thread, as measured
                with through_softmax(path):
                    assert fuses(KA.CPU_FUSED_SEQ) and not fuses(KA.CPU_FUSED_SEQ + 1)
        with on_cpu(vendor), torch_threads(3):
            assert fuses(KA.CPU_FUSED_SEQ) and not fuses(KA.CPU_FUSED_SEQ + 1)
    # causal: where the unmasked path is taken, up to CPU_FUSED_CAUSAL_SEQ, without another mask,
    # where a C kernel's causal rows run (evidence/fused-causal-zen3.txt)
    ends = (KA.CPU_FUSED_SEQ, *KA.CPU_FUSED_SEQ_TWO_THREADS.values(), *KA.CPU_FUSED_SEQ_ONE_THREAD.values(),
            KA.CPU_FUSED_CAUSAL_SEQ, *KA.CPU_CAUSAL_SEQ)
    lengths = sorted({n + e for n in ends for e in (-1, 0, 1)})
    for vendor, threads, path in itertools.product(VENDORS, (1, 2, 3), [*ISAS, "torch"]):
        with on_cpu(vendor), torch_threads(threads), through_softmax(path):
            for s in lengths:
                want = fuses(s) and path != "torch" and s <= KA.CPU_FUSED_CAUSAL_SEQ
                assert fuses(s, causal=True) == want, (vendor, threads, path, s)
            assert fuses(8, causal=True) == (path != "torch")
            assert not fuses(8, causal=True, mask=torch.ones(8, 8, dtype=torch.bool))
    assert not fuses(dtype=torch.float64) and not fuses(dtype=torch.bfloat16)
    assert not fuses(dtype=torch.float64, causal=True)
    assert fuses(positions=torch.arange(8)) and not fuses(positions=torch.arange(8).expand(2, 8))
    assert not fuses(positions=list(range(8)))  # refused by the rotation's own checks, with its message
    assert not fuses(grad="v") and not fuses(grad="q")
    assert not fuses(mask=torch.zeros(8, 8, requires_grad=True))  # a learned bias gets its gradient
    with torch.no_grad():
        assert fuses(grad="qkv") and fuses(mask=torch.zeros(8, 8, requires_grad=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fuses()

    assert not fuses(emb=Doubled(8))


def test_what_the_fused_path_does_not_record_takes_the_other_paths() -> None:
    """A mask that needs its gradient, a forward-mode tangent, and a RotaryEmbedding subclass with a
    rotation of its own are served as before the fused path; without kernels._rope (no compiler at
    install) rope_attention rotates by torch ops."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    rope = RotaryEmbedding(8)
    bias = torch.randn(1, 2, 6, 6, requires_grad=True)
    (got,) = torch.autograd.grad(kernels.rope_attention(q, k, v, rope, attn_mask=bias).sum(), bias)
    (want,) = torch.autograd.grad(RA.rope_attention(q, k, v, rope, attn_mask=bias).sum(), bias)
    assert_close(got, want, REDUCTION)
    with fwAD.dual_level():
        dual = fwAD.make_dual(v, torch.ones_like(v))
        got = fwAD.unpack_dual(kernels.rope_attention(q, k, dual, rope)).tangent
        want = fwAD.unpack_dual(RA.rope_attention(q, k, dual, rope)).tangent
    assert got is not None
    assert_close(got, want, REDUCTION)

    # its paired rotation doubles q and k: the scores, and so the output, differ from the plain one's
    assert not torch.allclose(kernels.rope_attention(q, k, v, Doubled(8)), kernels.rope_attention(q, k, v, rope))
    with mock.patch.object(KA, "_fused_attention", wraps=KA._fused_attention) as fused:
        with mock.patch("kernels.rope._c", None):
            assert_close(kernels.rope_attention(q, k, v, rope), RA.rope_attention(q, k, v, rope), REDUCTION)
        assert fused.call_count == 0
        kernels.rope_attention(q, k, v, rope)
        assert fused.call_count == 1


@pytest.mark.parametrize("causal", [False, True])
def test_rope_attention_compiles_whole_and_exports(causal: bool) -> None:
    """torch.compile(fullgraph=True) and torch.export trace rope_attention on the CPU in fp32,
    where the eager call would take the fused path (a traced graph takes the torch ops)."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    rope = RotaryEmbedding(8)
    want = kernels.rope_attention(q, k, v, rope, causal=causal)
    fn = torch.compile(lambda q, k, v: kernels.rope_attention(q, k, v, rope, causal=causal),
                       fullgraph=True, backend="eager")
    assert_close(fn(q, k, v), want, REDUCTION)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return kernels.rope_attention(q, k, v, rope, causal=causal)

    exported = torch.export.export(Attend(), (q, k, v), strict=True)
    assert_close(exported.module()(q, k, v), want, REDUCTION)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")  # still in use
@pytest.mark.parametrize("causal", [False, True])
def test_a_jit_traced_rope_attention_replays_new_inputs(causal: bool) -> None:
    """torch.jit.trace records torch ops only: where the eager call would take the fused path or
    the C rotation, the trace takes the torch ops, and its graph computes new inputs right."""
    rope = RotaryEmbedding(16)
    q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
    with torch.no_grad():
        traced = torch.jit.trace(lambda q, k, v: kernels.rope_attention(q, k, v, rope, causal=causal), (q, k, v),
                                 check_trace=False)
        q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
        assert_close(traced(q, k, v), RA.rope_attention(q, k, v, rope, causal=causal), REDUCTION)


def test_blocked_causal_path_only_where_it_measured_faster() -> None:
    """CPU causal over CPU_CAUSAL_SEQ positions in fp32, bf16 or fp16 (evidence/causal_blocks.py)."""
    lo, hi = KA.CPU_CAUSAL_SEQ
    def q(s: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(1, 1, s, 8, dtype=dtype)
    assert KA._causal_block(q(lo), causal=True) == KA._causal_block(q(hi), causal=True) == KA.CPU_CAUSAL_BLOCK
    assert KA._causal_block(q(hi), causal=False) is None
    assert KA._causal_block(q(lo - 1), causal=True) is None and KA._causal_block(q(hi + 1), causal=True) is None
    for dtype in (torch.bfloat16, torch.float16):
        assert KA._causal_block(q(lo, dtype), causal=True) == KA.CPU_CAUSAL_BLOCK
        assert KA._causal_block(q(hi, dtype), causal=True) == KA.CPU_CAUSAL_BLOCK
    assert KA._causal_block(q(hi, torch.float64), causal=True) is None


@pytest.mark.parametrize("s, masked", [(KA.CPU_CAUSAL_SEQ[1], False), (KA.CPU_CAUSAL_SEQ[0] + 64, True)])
def test_blocked_causal_path_equals_one_call_at_its_lengths(s: int, masked: bool) -> None:
    """At the path's lengths the kernel takes the blocks (a last one cut short at 448, a caller's
    mask sliced); outputs and gradients equal one causal SDPA call's."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, s, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, s, 16, requires_grad=True) for _ in range(2))  # grouped-query heads
    mask = torch.rand(1, 1, s, s) < 0.7 if masked else None
    if mask is not None:
        mask[..., 0] = True
    rope = RotaryEmbedding(16)
    with mock.patch.object(KA, "_blocked_causal", wraps=KA._blocked_causal) as blocked:
        got = kernels.rope_attention(q, k, v, rope, causal=True, attn_mask=mask)
    assert blocked.call_count == 1
    one = KA.combined_mask(mask, True, s, q.device, q.dtype)
    want = torch.nn.functional.scaled_dot_product_attention(rope.paired(q), rope.paired(k), v, attn_mask=one,
                                                            is_causal=one is None, enable_gqa=True)
    assert_close(got, want, REDUCTION)
    g = torch.randn_like(got)
    assert_dicts_close(dict(zip("qkv", torch.autograd.grad(got, (q, k, v), g), strict=True)),
                       dict(zip("qkv", torch.autograd.grad(want, (q, k, v), g), strict=True)), REDUCTION)


def test_blocked_causal_path_under_autocast_returns_what_one_call_does() -> None:
    """fp32 inputs under CPU bf16 autocast: SDPA computes in bf16, and the blocks' output is bf16
    as one call's is, equal to the fp64 oracle at bf16's tolerance."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, KA.CPU_CAUSAL_SEQ[1], 16) for _ in range(3))
    rope = RotaryEmbedding(16)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            mock.patch.object(KA, "_blocked_causal", wraps=KA._blocked_causal) as blocked:
        got = kernels.rope_attention(q, k, v, rope, causal=True)
        one = torch.nn.functional.scaled_dot_product_attention(rope.paired(q), rope.paired(k), v, is_causal=True)
    assert blocked.call_count == 1 and got.dtype == one.dtype == torch.bfloat16
    oracle = RA.rope_attention(q.double(), k.double(), v.double(), rope, causal=True)
    assert_close(got.double(), oracle, REDUCTION, dtype=torch.bfloat16)


def test_a_subclass_with_its_own_forward_rotates_through_it() -> None:
    """The paired rotation stands in for RotaryEmbedding.forward only: an override is called."""
    class Unrotated(kernels.RotaryEmbedding):
        def forward(self, x, *, offset=0, positions=None):
            return x

    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    want = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
    assert_close(kernels.rope_attention(q, k, v, Unrotated(8)), want, REDUCTION)


@given(problems(dtypes=(torch.float32,)), st.one_of(st.none(), st.integers(1, 16)))
def test_bf16_against_fp64_oracle(p: dict, block: int | None) -> None:
    """bf16 through SDPA's reduced-precision kernel, in one call or in blocks of query rows."""
    with mock.patch.object(KA, "_causal_block", lambda q, causal: block if causal else None):
        got = _forward_backward(kernels, p, torch.bfloat16)
    oracle = _forward_backward(RA, p, torch.float64)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert_close(got[0].double(), oracle[0], REDUCTION, msg="out", dtype=torch.bfloat16)
    assert_dicts_close({n: g.double() for n, g in zip("qkv", got[1:], strict=True)},
                       dict(zip("qkv", oracle[1:], strict=True)), REDUCTION, dtype=torch.bfloat16)


@given(dim_heads=st.sampled_from([(32, 4, 4), (48, 6, 2), (64, 4, 1)]), s=st.integers(1, 20),
       causal=st.booleans(), interleaved=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_module_equals_reference_module(dim_heads, s, causal, interleaved, dtype) -> None:
    """The module's q/k/v are strided views of one projection; S passes the 4-position cache."""
    dim, heads, kv = dim_heads
    torch.manual_seed(s)
    kw = dict(max_seq_len=4, causal=causal, interleaved=interleaved)
    mod = kernels.RopeSelfAttention(dim, heads, kv, **kw).to(dtype)
    ref = RA.RopeSelfAttention(dim, heads, kv, **kw).to(dtype)
    ref.load_state_dict(mod.state_dict())  # the same parameters; the RoPE cache is not in the state dict
    x = torch.randn(2, s, dim, dtype=dtype)
    got, want = mod(x), ref(x)
    assert_close(got, want, REDUCTION)
    names = [n for n, _ in mod.named_parameters()]
    gm = dict(zip(names, torch.autograd.grad(got.square().sum(), list(mod.parameters())), strict=True))
    gr = dict(zip(names, torch.autograd.grad(want.square().sum(), list(ref.parameters())), strict=True))
    assert_dicts_close(gm, gr, REDUCTION)


def test_module_under_bf16_autocast_with_a_float_mask() -> None:
    torch.manual_seed(0)
    mod = kernels.RopeSelfAttention(32, 4, 2)
    ref = RA.RopeSelfAttention(32, 4, 2).double()
    ref.load_state_dict(mod.state_dict())
    x, mask = torch.randn(2, 10, 32), torch.randn(10, 10)  # an fp32 mask, bf16 activations
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mod(x, attn_mask=mask)
    assert_close(got.double(), ref(x.double(), attn_mask=mask.double()), REDUCTION, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype, s", [(torch.float32, 200), (torch.float32, 6), (torch.bfloat16, 6),
                                      (torch.float64, 20)])
def test_a_mask_of_one_value_or_one_per_key_equals_reference(dtype: torch.dtype, s: int) -> None:
    """0-d and (S,) masks broadcast to (B, H, S, S), as the reference takes them; SDPA's own
    path needed them 2-d."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, s, 8, dtype=dtype) for _ in range(3))
    keys = torch.rand(s) < 0.7
    keys[0] = True  # every query keeps a key
    for mask in (torch.tensor(True), keys, torch.where(keys, 0.0, float("-inf")).to(dtype)):
        got = kernels.rope_attention(q, k, v, RotaryEmbedding(8), attn_mask=mask)
        want = RA.rope_attention(q.double(), k.double(), v.double(), RA.RotaryEmbedding(8),
                                 attn_mask=mask if mask.dtype == torch.bool else mask.double())
        assert_close(got.double(), want, REDUCTION, dtype=dtype)


def test_a_module_grown_under_inference_mode_trains() -> None:
    mod, ref = _module_pair(32, 4, 4, max_seq_len=8)
    with torch.inference_mode():
        mod(torch.randn(1, 16, 32))
    x, grad = torch.randn(2, 12, 32), torch.randn(2, 12, 32)
    assert_dicts_close(_trained(mod, x, grad), _trained(ref, x, grad), REDUCTION)


def test_a_head_dim_other_than_ropes_is_refused_naming_q() -> None:
    q = torch.randn(1, 2, 4, 6)
    with pytest.raises(ValueError, match=r"q has head dim 6, rope was built for 8"):
        kernels.rope_attention(q, q, q, RotaryEmbedding(8))


def _module_pair(dim: int, heads: int, kv: int, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """kernels' RopeSelfAttention and the reference's, with the same parameters."""
    mod, ref = kernels.RopeSelfAttention(dim, heads, kv, **kw), RA.RopeSelfAttention(dim, heads, kv, **kw)
    ref.load_state_dict(mod.state_dict())  # the RoPE cache is not in the state dict
    return mod, ref


def _trained(mod: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module's output and the gradients of x and of every parameter for ``grad``."""
    x = x.detach().requires_grad_(True)
    out = mod(x)
    names = ["x", *(n for n, _ in mod.named_parameters())]
    return {"out": out, **dict(zip(names, torch.autograd.grad(out, [x, *mod.parameters()], grad), strict=True))}


@SOFTMAX_PATHS
@given(dim_heads=st.sampled_from([(32, 4, 4), (48, 6, 2), (64, 4, 1), (192, 6, 6)]), b=st.integers(1, 3),
       s=st.integers(1, 40), interleaved=st.booleans(), bias=st.booleans(), threads=st.integers(1, 3),
       causal=st.booleans())
def test_module_training_path_equals_reference_module(path, dim_heads, b, s, interleaved, bias, threads,
                                                      causal) -> None:
    """The projected attention (module note): the module's output and the gradients of x and every
    parameter equal the reference module's and the unfused path's; grouped heads, either pair
    layout, causal or not (causal where a C softmax kernel runs), every softmax kernel, any threads."""
    dim, heads, kv = dim_heads
    torch.manual_seed(s)
    mod, ref = _module_pair(dim, heads, kv, interleaved=interleaved, bias=bias, causal=causal)
    x, grad = torch.randn(b, s, dim), torch.randn(b, s, dim)
    taken = 0 if causal and path == "torch" else 1
    with (torch_threads(threads), through_softmax(path),
          mock.patch.object(KA._ProjectedAttention, "apply", wraps=KA._ProjectedAttention.apply) as fused):
        got = _trained(mod, x, grad)
        assert fused.call_count == taken
        with mock.patch.object(KA, "_trains_fused", lambda *a: False):
            unfused = _trained(mod, x, grad)
    assert fused.call_count == taken
    assert_dicts_close(got, _trained(ref, x, grad), REDUCTION)
    assert_dicts_close(got, unfused, REDUCTION)


def test_module_training_path_at_its_longest() -> None:
    """S = CPU_MATH_MAX_SEQ, grouped heads; one position more takes SDPA."""
    mod, ref = _module_pair(64, 8, 2)
    for s, taken in ((KA.CPU_MATH_MAX_SEQ, 1), (KA.CPU_MATH_MAX_SEQ + 1, 0)):
        x, grad = torch.randn(2, s, 64), torch.randn(2, s, 64)
        with mock.patch.object(KA._ProjectedAttention, "apply", wraps=KA._ProjectedAttention.apply) as fused:
            got = _trained(mod, x, grad)
        assert fused.call_count == taken
        assert_dicts_close(got, _trained(ref, x, grad), REDUCTION)


class OwnAttend(kernels.RopeSelfAttention):
    """A module subclass attending its own way (the reference's attention)."""

    attend = staticmethod(RA.rope_attention)


def test_module_training_path_only_where_it_applies() -> None:
    """A gradient to build, CPU fp32, no mask, S in 1..CPU_MATH_MAX_SEQ, causal only where a C softmax
    kernel runs, the module's own attention and rotation, kernels._rope built, no autocast, nothing
    traced or transformed."""
    x = torch.randn(2, 8, 32)

    def takes(mod=None, x=x, mask=None, qkv=None, **kw) -> bool:
        mod = kernels.RopeSelfAttention(32, 4, **kw) if mod is None else mod
        return KA._trains_fused(mod, mod.qkv(x) if qkv is None else qkv, mask)

    assert takes() and takes(n_kv_heads=2, interleaved=True)
    assert takes(causal=True) == bool(ISAS) and not takes(mask=torch.ones(8, 8, dtype=torch.bool))
    with through_softmax("torch"):
        assert not takes(causal=True) and takes()
    assert not takes(x=x.double(), mod=kernels.RopeSelfAttention(32, 4).double())
    assert not takes(x=x[:, :0]) and not takes(x=torch.randn(1, KA.CPU_MATH_MAX_SEQ + 1, 32))
    assert not takes(mod=OwnAttend(32, 4))
    doubled = kernels.RopeSelfAttention(32, 4)
    doubled.rope = Doubled(8)
    assert not takes(mod=doubled)
    frozen = kernels.RopeSelfAttention(32, 4).requires_grad_(False)
    assert not takes(mod=frozen) and takes(mod=frozen, x=x.requires_grad_(True))
    with torch.no_grad():
        assert not takes()
    own = kernels.RopeSelfAttention(32, 4)
    own.attend = RA.rope_attention  # an instance's own attention
    assert not takes(mod=own)
    fp32 = kernels.RopeSelfAttention(32, 4).qkv(x)  # float32, made outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes() and not takes(qkv=fp32)
    with mock.patch("kernels.rope._c", None):
        assert not takes()
    with mock.patch("torch.compiler.is_compiling", lambda: True):
        assert not takes()
    with mock.patch("torch.jit.is_tracing", lambda: True):
        assert not takes()
    # a torch.func transform active over other inputs: x and the projection stay plain tensors
    seen, plain = [], kernels.RopeSelfAttention(32, 4)
    torch.func.vmap(lambda w: seen.append(takes(mod=plain)) or w)(torch.randn(3))
    assert seen == [False]


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=runs_c)])
def test_module_training_path_differentiates_twice(causal: bool) -> None:
    """create_graph through the projected attention (a gradient penalty): its backward recomputes
    the attention in differentiable torch ops, and the second derivatives equal the reference's."""
    torch.manual_seed(0)
    mod, ref = _module_pair(48, 6, 2, causal=causal)
    x, grad = torch.randn(2, 7, 48), torch.randn(2, 7, 48)

    def penalty_grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        xs = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad((m(xs) * grad).sum(), xs, create_graph=True)
        names = [n for n, _ in m.named_parameters()]
        return dict(zip(names, torch.autograd.grad(gx.square().sum(), list(m.parameters())), strict=True))

    with mock.patch.object(KA._ProjectedAttention, "apply", wraps=KA._ProjectedAttention.apply) as fused:
        got = penalty_grads(mod)
    assert fused.call_count == 1
    assert_dicts_close(got, penalty_grads(ref), REDUCTION)


def test_module_under_torch_func_and_forward_ad_takes_the_torch_ops() -> None:
    """torch.func.grad over the parameters (functional_call) and a forward-mode tangent of x are
    followed by the differentiable path, and equal the reference's."""
    torch.manual_seed(0)
    mod, ref = _module_pair(32, 4, 2)
    x = torch.randn(2, 6, 32)

    def loss(m: torch.nn.Module):
        return lambda params: torch.func.functional_call(m, params, (x,)).square().sum()

    with mock.patch.object(KA._ProjectedAttention, "apply", wraps=KA._ProjectedAttention.apply) as fused:
        got = torch.func.grad(loss(mod))(dict(mod.named_parameters()))
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(mod(fwAD.make_dual(x.requires_grad_(True), torch.ones_like(x)))).tangent
    assert fused.call_count == 0
    assert_dicts_close(got, torch.func.grad(loss(ref))(dict(ref.named_parameters())), REDUCTION)
    with fwAD.dual_level():
        want = fwAD.unpack_dual(ref(fwAD.make_dual(x, torch.ones_like(x)))).tangent
    assert_close(tangent, want, REDUCTION)
    # vmap over a weight of the loss, the module's input unbatched (its tensors plain, a transform active)
    w = torch.randn(3, 32)
    per_w = lambda m: torch.func.vmap(lambda wi: (m(x) * wi).sum())(w)
    assert_close(per_w(mod), per_w(ref), REDUCTION)


@pytest.mark.parametrize(("s", "causal", "dtype"), [(8, True, torch.float32), (150, False, torch.float32),
                                               (400, True, torch.float32), (8, False, torch.float64)],
                         ids=["causal", "sdpa", "blocked-causal", "fp64"])
def test_forward_mode_tangents_on_every_sdpa_route(s: int, causal: bool, dtype: torch.dtype) -> None:
    """torch.func.jvp through the routes that end in SDPA (causal, long, blocked, not fp32), whose
    CPU flash kernel has no forward-mode formula (NotImplementedError before): its math backend
    takes them, and the tangent is the reference's; the module's causal path too."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    q, k, v, t = (torch.randn(1, 2, s, 8, dtype=dtype) for _ in range(4))
    got, want = (torch.func.jvp(lambda q, side=side: side.rope_attention(q, k, v, rope, causal=causal), (q,), (t,))
                 for side in (kernels, RA))
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, REDUCTION)
    if s == 8 and dtype == torch.float32:
        mod, ref = _module_pair(32, 4, 2, causal=True)
        x, tx = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
        assert_close(torch.func.jvp(mod, (x,), (tx,))[1], torch.func.jvp(ref, (x,), (tx,))[1], REDUCTION)


@pytest.mark.parametrize("causal", [False, True])
def test_a_value_cache_made_under_inference_mode(causal: bool) -> None:
    """v an inference tensor (a cache filled under inference_mode) while q needs a gradient: the
    gradient is the reference's (autograd refused to save v before, naming no argument)."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    with torch.inference_mode():
        v = torch.randn(1, 2, 6, 8)
    q, k = torch.randn(1, 2, 6, 8, requires_grad=True), torch.randn(1, 2, 6, 8)
    got, want = (torch.autograd.grad(side.rope_attention(q, k, v, rope, causal=causal).sum(), q)[0]
                 for side in (kernels, RA))
    assert_close(got, want, REDUCTION)


def test_module_training_path_backward_under_autocast() -> None:
    """A forward in fp32 (the projected attention) whose backward runs inside an autocast region:
    the backward keeps the forward's fp32, as autograd does for the unfused ops."""
    torch.manual_seed(0)
    mod, ref = _module_pair(48, 6, 2)
    x = torch.randn(2, 7, 48, requires_grad=True)
    with mock.patch.object(KA._ProjectedAttention, "apply", wraps=KA._ProjectedAttention.apply) as fused:
        out = mod(x)
    assert fused.call_count == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (got,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(ref(x).sum(), x)
    assert got.dtype == torch.float32  # the projections' backward ran in bf16 (autocast's), its own in fp32
    assert_close(got, want, REDUCTION, dtype=torch.bfloat16)


def test_value_head_dim_may_differ_and_offset_positions_pass_through() -> None:
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 4)
    rope = RotaryEmbedding(8)
    for kw in ({}, {"offset": 7}, {"positions": torch.tensor([3, 1, 4, 1, 5])}):
        got = kernels.rope_attention(q, k, v, rope, causal=True, **kw)
        assert got.shape == (1, 2, 5, 4)
        assert_close(got, RA.rope_attention(q, k, v, rope, causal=True, **kw), REDUCTION)


def test_causal_attention_does_not_see_the_future() -> None:
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    rope = RotaryEmbedding(8)
    out = kernels.rope_attention(q, k, v, rope, causal=True)
    v2 = v.clone()
    v2[:, :, 4:] += 1.0
    out2 = kernels.rope_attention(q, k, v2, rope, causal=True)
    torch.testing.assert_close(out[:, :, :4], out2[:, :, :4])
    assert not torch.allclose(out[:, :, 4:], out2[:, :, 4:])


def _qkv(h=4, hk=4, s=5, d=8, dtype=torch.float32):
    return torch.randn(2, h, s, d, dtype=dtype), torch.randn(2, hk, s, d, dtype=dtype), torch.randn(2, hk, s, d,
                                                                                                   dtype=dtype)


@pytest.mark.parametrize("side", sorted(SIDES))
def test_bad_input_is_refused(side: str) -> None:
    fn, rope = SIDES[side].rope_attention, RotaryEmbedding(8)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="kv heads"):
        fn(*_qkv(h=4, hk=3), rope)
    with pytest.raises(ValueError, match="share dtype"):
        fn(q, k.double(), v, rope)
    with pytest.raises(ValueError, match="share dtype"):
        fn(q, k, v.double(), rope)
    with pytest.raises(ValueError, match="share dtype and device"):
        fn(q, k.to("meta"), v, rope)
    with pytest.raises(ValueError, match="attn_mask is on meta"):
        fn(q, k, v, rope, attn_mask=torch.ones(5, 5, dtype=torch.bool, device="meta"))
    for fill in (float("-inf"), float("inf")):  # a row of infinities alone: no finite score (kernels: NaN before)
        with pytest.raises(ValueError, match="no key to attend to"):
            fn(q, k, v, rope, attn_mask=torch.zeros(5, 5).index_fill_(0, torch.tensor([2]), fill))
    with pytest.raises(ValueError, match="head dim"):
        fn(*_qkv(d=6), rope)
    with pytest.raises(ValueError, match="does not broadcast"):
        fn(q, k, v, rope, attn_mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        fn(q, k, v, rope, attn_mask=torch.ones(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="no key to attend to"):
        fn(q, k, v, rope, attn_mask=torch.zeros(5, 5, dtype=torch.bool).fill_diagonal_(True).roll(1, 1),
           causal=True)
    with pytest.raises(ValueError, match="beyond the cache"):
        fn(*_qkv(s=20), RotaryEmbedding(8, max_seq_len=16, grow=False))
    with pytest.raises(ValueError, match=r"\(B, H, S, D\)"):
        fn(q[0], k, v, rope)
    with pytest.raises(ValueError, match="head_dim must be an even"):
        kernels.RopeSelfAttention(14, 2)
    with pytest.raises(ValueError, match="must divide"):
        kernels.RopeSelfAttention(32, 4, 3)


def test_module_does_not_change_the_rope_cache_in_state_dicts() -> None:
    mod = kernels.RopeSelfAttention(32, 4)
    assert not any("rope" in n for n in mod.state_dict())
    clone = copy.deepcopy(mod)
    clone(torch.randn(1, 3000, 32))  # grows the clone's cache
    assert clone.rope.max_seq_len == 4096 and mod.rope.max_seq_len == 2048


# -- the fused path's softmax (kernels.attention._softmax_: kernels._softmax's AVX-512F or AVX2
# kernel where the CPU runs one, else torch.softmax): float64's softmax, exact zeros for masked
# scores, NaN rows where torch.softmax gives them; the C part refuses what it cannot take --------


def test_softmax_kernels_are_the_cpus() -> None:
    """The C kernels this CPU runs are those its flags name: AVX-512F; AVX2 with FMA."""
    cpuinfo = Path("/proc/cpuinfo")
    if C is None or platform.machine() != "x86_64" or not cpuinfo.is_file():
        pytest.skip("kernels._softmax not built, or not x86-64 Linux")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert C.ISAS == (("avx512f",) if "avx512f" in flags else ()) + (("avx2",) if {"avx2", "fma"} <= flags else ())
    assert C.ISA == (C.ISAS[0] if C.ISAS else "")


@given(rows=st.integers(1, 6), n=st.integers(1, 300), spread=st.sampled_from([0.1, 1.0, 10.0, 100.0]),
       shift=st.sampled_from([0.0, -200.0, 1e4]), masked=st.floats(0.0, 0.9), seed=st.integers(0, 2**16))
@SOFTMAX_PATHS
def test_softmax_equals_float64_softmax(path: str, rows: int, n: int, spread: float, shift: float,
                                        masked: float, seed: int) -> None:
    """Any row length (the vector's tail lanes), scores from flat to one-hot, every score far below
    exp's range or far above it (the row's max is taken out first), a share of -inf (masked) scores,
    each row keeping one finite score: each probability within an elementwise op's tolerance of
    float64's, masked scores exactly 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * spread + shift
    off = torch.rand(rows, n, generator=g) < masked
    off[:, torch.randint(0, n, (1,), generator=g)] = False
    x[off] = -float("inf")
    want = torch.softmax(x.double(), -1)
    with through_softmax(path):
        got = KA._softmax_(x.clone())
    assert_close(got, want.float(), ELEMENTWISE)
    assert (got[off] == 0).all()


@SOFTMAX_PATHS
def test_softmax_of_extreme_scores(path: str) -> None:
    """Subnormal, huge and signed-zero scores, and gaps where exp leaves the normal floats (a
    subnormal or 0 probability), against float64's softmax rounded to float32."""
    tiny, huge = 1e-40, 3e38
    x = torch.tensor([[tiny, -tiny, 0.0, -0.0] * 5,
                      [huge, -huge, 0.0, 1.0] * 5,
                      [0.0, -87.0, -88.0, -89.0, -100.0, -103.0, -104.0, -105.0, -150.0, -1e30] * 2])
    with through_softmax(path):
        got = KA._softmax_(x.clone())
    want = torch.softmax(x.double(), -1).float()
    assert_close(got, want, ELEMENTWISE)
    assert (got[2][want[2] == 0] == 0).all()


@EACH_ISA
def test_the_c_softmax_rounds_subnormal_probabilities_once(isa: str) -> None:
    """Rows of one 0 score and the rest in [-104, -87]: the sum rounds to exactly 1, so each
    probability is exp(t) rounded once to float32, subnormal or 0 below -87.3: within 1 ulp of
    float64's exp rounded, and the same bits from every kernel."""
    x = torch.cat([torch.zeros(40, 1), torch.linspace(-104.0, -87.0, 23 * 40).view(40, 23)], 1)
    want = torch.exp(x.double()).float()
    got = x.clone()
    C.softmax_(got.numpy(), 1, isa)
    assert (got.view(torch.int32).long() - want.view(torch.int32).long()).abs().max() <= 1
    for other in ISAS:
        again = x.clone()
        C.softmax_(again.numpy(), 1, other)
        assert torch.equal(again, got), other


@SOFTMAX_PATHS
def test_softmax_nan_rows_where_torch_gives_them(path: str) -> None:
    """A NaN, +inf (inf - inf) or nothing but -inf makes the whole row NaN, as torch.softmax gives."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, 1.0, nan], [inf, 0.0, 1.0], [-inf, -inf, -inf], [inf, inf, 0.0], [1e30, -1e30, 0.0]])
    x = x.repeat(1, 7)  # 21 a row: a whole vector and a tail
    with through_softmax(path):
        got = KA._softmax_(x.clone())
    assert got[:4].isnan().all() and not got[4].isnan().any()
    assert torch.equal(got.isnan(), torch.softmax(x, -1).isnan())
    assert_close(got[4], torch.softmax(x[4].double(), -1).float(), ELEMENTWISE)


@given(squares=st.integers(1, 4), n=st.integers(1, 70), spread=st.sampled_from([0.1, 10.0]),
       seed=st.integers(0, 2**16))
@SOFTMAX_PATHS
def test_causal_softmax_equals_float64_softmax_of_the_masked_scores(path: str, squares: int, n: int,
                                                                     spread: float, seed: int) -> None:
    """Stacked (n, n) squares, causal: each row's softmax over its keys up to its position, within an
    elementwise op's tolerance of float64's softmax with the later scores -inf, and those exactly 0
    whatever they held (NaN, +inf: never read)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(squares, n, n, generator=g) * spread
    above = torch.ones(n, n, dtype=torch.bool).triu(1)
    want = torch.softmax(x.double().masked_fill(above, -float("inf")), -1)
    x.masked_fill_(above, float("nan") if seed % 2 else float("inf"))
    with through_softmax(path):
        got = KA._softmax_(x.clone().view(squares * n, n), causal=True).view(squares, n, n)
    assert_close(got, want.float(), ELEMENTWISE)
    assert (got[:, above] == 0).all()


@EACH_ISA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows, n", [(3 * 37, 37), (5, 5), (1, 1)])
def test_the_c_softmax_splits_rows_over_threads_to_the_same_bits(isa: str, causal: bool, rows: int,
                                                                  n: int) -> None:
    """Any thread count, more threads than rows too (causal: the rows' shares by their work), gives
    one thread's bits."""
    x = torch.randn(rows, n) * 5
    one = x.clone()
    C.softmax_(one.numpy(), 1, isa, causal)
    for threads in (2, 3, 7):
        many = x.clone()
        C.softmax_(many.numpy(), threads, isa, causal)
        assert torch.equal(one, many), threads


@SOFTMAX_PATHS
@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (3, 0)])
def test_causal_softmax_of_nothing(path: str, shape: tuple[int, int]) -> None:
    """No rows, or rows of no keys: returned as they are (no division by a row length of 0), by
    ``_softmax_`` and by the C kernel called on them."""
    with through_softmax(path):
        assert KA._softmax_(torch.empty(shape), causal=True).shape == shape
    if path != "torch":
        C.softmax_(torch.empty(shape).numpy(), 2, path, True)


@runs_c
def test_the_c_softmax_refuses_causal_rows_that_are_not_squares() -> None:
    with pytest.raises(ValueError, match="stacked n x n squares"):
        C.softmax_(torch.zeros(5, 3).numpy(), 1, C.ISA, True)


@EACH_ISA
@pytest.mark.parametrize("score", [-100.0, -200.0])
def test_the_c_softmax_raises_no_overflow_for_lanes_past_the_row(isa: str, score: float, tmp_path) -> None:
    """Every score below -88 and a row that ends mid-vector: the lanes past its end compute no
    exp that overflows (a process with overflow traps on would die). -100: exp(100) overflows in
    both kernels (exp(200) wraps in the AVX2 one's exponent bits instead)."""
    script = tmp_path / "trap.py"
    script.write_text(
        "import ctypes, ctypes.util, torch\n"
        "from kernels import _softmax\n"
        "ctypes.CDLL(ctypes.util.find_library('m')).feenableexcept(0x08)  # FE_OVERFLOW\n"
        f"x = torch.full((3, 17), {score})\n"
        f"_softmax.softmax_(x.numpy(), 1, {isa!r})\n"
        "assert torch.allclose(x, torch.full_like(x, 1 / 17))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@EACH_ISA
def test_the_c_softmax_computes_no_underflow_for_masked_scores(isa: str, tmp_path) -> None:
    """Masked (-inf) scores and scores more than 104 below their row's max get exactly 0 without an
    exp that underflows: on Intel CPUs each underflowing result takes a microcode assist (rows of
    30% masked scores ran 6x slower than torch.softmax's), so a process with underflow traps on
    survives such rows, and gets torch.softmax's probabilities."""
    script = tmp_path / "trap.py"
    script.write_text(
        "import ctypes, ctypes.util, torch\n"
        "from kernels import _softmax\n"
        "libm = ctypes.CDLL(ctypes.util.find_library('m'))\n"
        "x = torch.randn(5, 37).masked_fill(torch.rand(5, 37) < 0.4, float('-inf'))\n"
        "x[:, 0], x[:, 1], x[:, 2] = 1.0, -150.0, -1e30  # a kept score, and two far below it\n"
        "want, got = torch.softmax(x, -1), x.clone()\n"
        "libm.feenableexcept(0x10)  # FE_UNDERFLOW\n"
        f"_softmax.softmax_(got.numpy(), 1, {isa!r})\n"
        "libm.fedisableexcept(0x10)\n"
        "assert torch.allclose(got, want) and (got[want == 0] == 0).all() and (got[:, 1:3] == 0).all()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@runs_c
def test_the_c_softmax_serves_the_fused_path() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    with torch.no_grad(), mock.patch.object(C, "softmax_", wraps=C.softmax_) as c:
        kernels.rope_attention(q, k, v, RotaryEmbedding(16))
    assert c.call_count >= 1


@runs_c
@pytest.mark.parametrize("bad, error", [
    (lambda: torch.zeros(4, 5, dtype=torch.float64).numpy(), TypeError),  # not float32
    (lambda: torch.zeros(4, 5).t().numpy(), ValueError),  # not C-contiguous (numpy says so)
    (lambda: torch.zeros(()).numpy(), TypeError),  # no dim
    (lambda: bytes(16), BufferError),  # not writable
])
def test_the_c_softmax_refuses_buffers_it_cannot_take(bad, error) -> None:
    with pytest.raises(error):
        C.softmax_(bad(), 1, C.ISA)


@runs_c
@pytest.mark.parametrize("threads", [0, C.MAX_THREADS + 1 if C is not None else 257])
def test_the_c_softmax_refuses_thread_counts_out_of_range(threads: int) -> None:
    with pytest.raises(ValueError, match="threads must be"):
        C.softmax_(torch.zeros(2, 3).numpy(), threads, C.ISA)


@runs_c
@pytest.mark.parametrize("isa", ["", "sse2", "AVX2", "avx512", *(n for n in ("avx512f", "avx2") if n not in ISAS)])
def test_the_c_softmax_refuses_a_kernel_it_does_not_have(isa: str) -> None:
    with pytest.raises(ValueError, match="isa must name a kernel"):
        C.softmax_(torch.zeros(2, 3).numpy(), 1, isa)


@pytest.mark.parametrize("causal", [False, True])
def test_a_default_device_elsewhere_leaves_the_result_on_qs(causal: bool) -> None:
    """Under ``torch.device("meta")`` (as ``set_default_device("cuda")`` with a CPU model) the
    fused path allocated its output and work buffer on the default device (a TypeError there)."""
    torch.manual_seed(0)
    rope, q, k, v = RotaryEmbedding(8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    want = RA.rope_attention(q, k, v, rope, causal=causal)
    with torch.no_grad(), torch.device("meta"):
        got = kernels.rope_attention(q, k, v, rope, causal=causal)
    assert got.device.type == "cpu"
    assert_close(got, want, REDUCTION)


@pytest.mark.parametrize("side", sorted(SIDES))
def test_keys_of_another_length_than_the_queries_are_refused(side: str) -> None:
    """Self-attention: k and v of another S than q are refused on every path (a cross-attention
    SDPA would otherwise compute, or the fused path's C rotation refuse with its own message)."""
    fn, rope = SIDES[side].rope_attention, RotaryEmbedding(8)
    for s, sk in ((5, 6), (6, 5), (200, 199)):  # the explicit and fused paths, SDPA's
        q, _, _ = _qkv(s=s)
        _, k, v = _qkv(s=sk)
        for causal in (False, True):
            with pytest.raises(ValueError, match="the same B and S"), torch.no_grad():
                fn(q, k, v, rope, causal=causal)


@pytest.mark.parametrize("strided", ["k", "q", "qk"])
def test_the_fused_path_takes_keys_the_c_rotation_cannot_read_through_the_other_paths(strided: str) -> None:
    """q or k whose features are not at unit stride (every other element of a wider tensor), under
    no_grad in float32 at a fused length: the C rotation reads neither, so such a call takes the
    other paths and equals the reference, it is not refused."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    q, k, v = _qkv(s=12)
    wide = {n: torch.randn(2, 4, 12, 16)[..., ::2] for n in strided}
    q, k = wide.get("q", q), wide.get("k", k)
    assert not q.is_contiguous() or not k.is_contiguous()
    with torch.no_grad():
        got = kernels.rope_attention(q, k, v, rope)
    assert_close(got, RA.rope_attention(q, k, v, rope), REDUCTION)


@SOFTMAX_PATHS
def test_a_masked_key_gets_no_weight_where_every_visible_score_is_very_negative(path: str) -> None:
    """A False in a bool mask is -inf, not a large negative number: where the one visible key
    scores -2.8e4 (q = -100, k = 100 at one position: no rotation), the output is that key's
    value exactly as the reference's, on the fused, the explicit and SDPA's paths."""
    rope = RotaryEmbedding(8)
    for s in (6, 200):  # the fused and explicit paths (their masks in place), SDPA
        q, k, v = torch.full((1, 2, s, 8), -100.0), torch.full((1, 2, s, 8), 100.0), torch.randn(1, 2, s, 8)
        k[:, :, 1:] = torch.randn(1, 2, s - 1, 8)  # masked keys: scores of order 1 above -2.8e4
        mask = torch.zeros(s, s, dtype=torch.bool)
        mask[:, 0] = True  # every query sees key 0 alone
        positions = torch.zeros(s, dtype=torch.int64)
        with through_softmax(path):
            for grad in (False, True):  # q needing its gradient: not the fused path
                got = kernels.rope_attention(q.clone().requires_grad_(grad), k, v, rope, attn_mask=mask,
                                             positions=positions)
                assert_close(got.detach(), v[:, :, :1].expand_as(got), REDUCTION, msg=f"S={s}, grad={grad}")
    assert_close(RA.rope_attention(q, k, v, rope, attn_mask=mask, positions=positions),
                 v[:, :, :1].expand(1, 2, s, 8), REDUCTION)


@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.float16])
def test_a_float_mask_of_another_dtype_than_q_is_added_in_qs(mask_dtype: torch.dtype) -> None:
    """A float mask of another floating dtype than q (float64, float16 with float32 q, k, v) is
    cast to q's dtype on every path: the fused and explicit ones, SDPA's (causal, longer), the
    blocked causal one; output equal to the reference's, in q's dtype."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    for s, causal in ((12, False), (12, True), (200, False), (200, True), (400, True)):
        q, k, v = _qkv(h=2, hk=2, s=s)
        mask = torch.randn(s, s).to(mask_dtype)
        want = RA.rope_attention(q, k, v, rope, causal=causal, attn_mask=mask)
        for grad in (False, True):  # q needing its gradient: not the fused path
            got = kernels.rope_attention(q.clone().requires_grad_(grad), k, v, rope, causal=causal, attn_mask=mask)
            assert got.dtype == torch.float32
            assert_close(got.detach(), want, REDUCTION, msg=f"S={s}, causal={causal}, grad={grad}")


@EACH_ISA
def test_the_c_softmax_takes_rows_of_no_scores(isa: str) -> None:
    """A buffer whose last dim is 0 (the scores of S = 0) has nothing to normalize: softmax_
    returns without dividing by the row length, as an empty buffer of no rows does."""
    for shape in ((3, 0), (0, 0), (2, 0, 0), (0, 5)):
        x = torch.empty(shape)
        assert C.softmax_(x.numpy(), 1, isa) is None
        assert C.softmax_(x.numpy(), 2, isa) is None
    q = torch.empty(2, 2, 0, 8)
    with torch.no_grad():
        assert kernels.rope_attention(q, q, q, RotaryEmbedding(8)).shape == (2, 2, 0, 8)


def test_the_explicit_and_blocked_paths_are_the_cpus_only() -> None:
    """The explicit and the blocked causal paths were measured against SDPA on the CPU: a tensor of
    another device (meta here: no accelerator needed) takes SDPA at their lengths and dtypes."""
    meta = torch.empty(1, 1, KA.CPU_MATH_MAX_SEQ, 8, device="meta")
    assert KA._takes_explicit(torch.empty(meta.shape), causal=False)
    assert not KA._takes_explicit(meta, causal=False)
    blocked = torch.empty(1, 1, KA.CPU_CAUSAL_SEQ[0], 8, device="meta")
    assert KA._causal_block(torch.empty(blocked.shape), causal=True) is not None
    assert KA._causal_block(blocked, causal=True) is None
    assert not KA._fuses(meta, meta, meta, RotaryEmbedding(8), False, None, None)
