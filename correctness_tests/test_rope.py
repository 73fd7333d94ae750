"""kernels.RotaryEmbedding == reference.rope (per-call cos/sin, rotate_half), == fp64, refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kernels.rope as K
import reference.rope as R
from correctness_tests.tolerances import ELEMENTWISE, assert_close


@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 40), half=st.integers(1, 32),
       interleaved=st.booleans(), offset=st.integers(0, 50), dtype=st.sampled_from([torch.float32, torch.float64]),
       transposed=st.booleans())
def test_rotation_and_its_gradient_equal_reference(b, h, s, half, interleaved, offset, dtype, transposed) -> None:
    d = 2 * half
    shape = (b, s, h, d) if transposed else (b, h, s, d)
    x = torch.randn(shape, dtype=dtype)
    x = x.transpose(1, 2) if transposed else x
    x.requires_grad_(True)
    rope = K.RotaryEmbedding(d, max_seq_len=8, interleaved=interleaved)  # S + offset grows the cache
    ref = R.RotaryEmbedding(d, max_seq_len=8, interleaved=interleaved)
    got, want = rope(x, offset=offset), ref(x, offset=offset)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, ELEMENTWISE)
    grad = torch.randn_like(got)
    (gx,) = torch.autograd.grad(got, x, grad)
    (wx,) = torch.autograd.grad(want, x, grad)
    assert_close(gx, wx, ELEMENTWISE)
    if dtype == torch.float32:  # the fp64 path computes its table per call
        assert rope.max_seq_len >= s + offset


@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 40), half=st.integers(1, 32),
       interleaved=st.booleans(), per_batch=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       odd_offset=st.booleans())
def test_paired_is_the_rotation_with_each_pair_made_neighbours(b, h, s, half, interleaved, per_batch, dtype,
                                                               odd_offset) -> None:
    d = 2 * half
    base = torch.randn(b * h * s * d + 1, dtype=dtype)
    x = (base[1:] if odd_offset else base[:-1]).view(b, h, s, d).requires_grad_(True)  # odd: no complex view
    positions = torch.randint(0, 70, (b, s) if per_batch else (s,))
    rope = K.RotaryEmbedding(d, max_seq_len=8, interleaved=interleaved)
    want = R.RotaryEmbedding(d, max_seq_len=8, interleaved=interleaved)(x, positions=positions)
    if not interleaved:  # pair i is features (i, i + D/2): they become 2i, 2i + 1
        want = torch.stack([want[..., :half], want[..., half:]], -1).flatten(-2)
    got = rope.paired(x, positions=positions)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, ELEMENTWISE)
    grad = torch.randn_like(got)
    assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0], ELEMENTWISE)


def test_any_strides_including_a_strided_last_dim() -> None:
    base = torch.randn(2, 9, 3, 32)
    for x in (base[..., ::2], base.transpose(1, 2), base[:, ::2]):  # last-dim stride 2, (B,S,H,D) view, gaps
        x = x.transpose(1, 2) if x.shape[1] != 3 else x
        assert_close(K.RotaryEmbedding(x.shape[-1])(x, offset=3), R.RotaryEmbedding(x.shape[-1])(x, offset=3),
                     ELEMENTWISE)


def test_half_precision_gradients_rotate_in_fp32() -> None:
    """fp16 in, fp16 gradient out, equal to the fp64 gradient rounded once."""
    x = torch.randn(2, 2, 40, 16).half().requires_grad_(True)
    y = K.RotaryEmbedding(16)(x, offset=500)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    xd = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(R.RotaryEmbedding(16)(xd, offset=500), xd, g.double())
    assert gx.dtype == torch.float16
    assert_close(gx.double(), want, ELEMENTWISE, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_rotated_in_fp32(dtype) -> None:
    x = torch.randn(2, 3, 300, 64).to(dtype)
    got = K.RotaryEmbedding(64)(x, offset=1000)
    oracle = R.RotaryEmbedding(64)(x.double(), offset=1000)
    assert got.dtype == dtype
    assert_close(got, oracle.to(dtype), ELEMENTWISE)
    # one rounding: the fp32 rotation cast back equals rounding the exact result
    assert (got.double() - oracle).abs().max() <= (oracle.abs().max() * torch.finfo(dtype).eps).item()


def test_norm_is_preserved_and_position_zero_is_identity() -> None:
    x = torch.randn(2, 2, 16, 32, dtype=torch.float64)
    y = K.RotaryEmbedding(32)(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_relative_positions_only() -> None:
    """<R(p) q, R(p') k> depends on p - p' only: the point of RoPE."""
    rope = K.RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    dots = [(rope(q, offset=p) * rope(k, offset=p + 3)).sum() for p in (0, 7, 100)]
    torch.testing.assert_close(dots[0], dots[1])
    torch.testing.assert_close(dots[0], dots[2])


@given(b=st.integers(1, 3), s=st.integers(1, 12), interleaved=st.booleans(), per_batch=st.booleans())
def test_explicit_positions_equal_reference_and_offset(b, s, interleaved, per_batch) -> None:
    x = torch.randn(b, 2, s, 8)
    pos = torch.randint(0, 40, (b, s) if per_batch else (s,))
    rope = K.RotaryEmbedding(8, 16, interleaved=interleaved)
    ref = R.RotaryEmbedding(8, 16, interleaved=interleaved)
    assert_close(rope(x, positions=pos), ref(x, positions=pos), ELEMENTWISE)
    assert_close(rope(x, positions=torch.arange(5, 5 + s)), rope(x, offset=5), ELEMENTWISE)


def test_cache_is_a_non_persistent_buffer_that_follows_the_module() -> None:
    model = torch.nn.Module()
    model.rope = K.RotaryEmbedding(8, 32)
    assert model.state_dict() == {} and {n for n, _ in model.named_buffers()} == {"rope.cos", "rope.sin"}
    model.to(torch.bfloat16).to(torch.float32)  # dtype casts must not round the fp32 tables
    x = torch.randn(1, 1, 30, 8)
    assert_close(model.rope(x, offset=2000), R.RotaryEmbedding(8)(x, offset=2000), ELEMENTWISE)
    assert model.rope.cos.dtype == torch.float32
    meta = K.RotaryEmbedding(8).to("meta")
    assert meta.cos.device.type == "meta"
    with pytest.raises(ValueError, match="move the module"):
        meta(torch.randn(1, 1, 4, 8))


@pytest.mark.parametrize("side", [K, R])
def test_fixed_cache_refuses_positions_beyond_it(side) -> None:
    rope = side.RotaryEmbedding(8, max_seq_len=16, grow=False)
    rope(torch.randn(1, 1, 16, 8))
    with pytest.raises(ValueError, match="beyond the cache of 16"):
        rope(torch.randn(1, 1, 4, 8), offset=13)
    with pytest.raises(ValueError, match="beyond the cache"):
        rope(torch.randn(1, 1, 2, 8), positions=torch.tensor([0, 16]))


@pytest.mark.parametrize("side", [K, R])
def test_bad_input_is_refused(side) -> None:
    with pytest.raises(ValueError, match="head_dim must be an even"):
        side.RotaryEmbedding(7)
    with pytest.raises(ValueError, match="base must be"):
        side.RotaryEmbedding(8, base=float("nan"))
    rope = side.RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"\(B, H, S, D\)"):
        rope(torch.randn(3, 8))
    with pytest.raises(ValueError, match="head dim 6"):
        rope(torch.randn(1, 1, 3, 6))
    with pytest.raises(TypeError, match="floating-point"):
        rope(torch.ones(1, 1, 3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="offset must be"):
        rope(torch.randn(1, 1, 3, 8), offset=-1)
    with pytest.raises(TypeError, match="positions must be one of"):  # a dtype: TypeError, as for x
        rope(torch.randn(1, 1, 3, 8), positions=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(torch.randn(1, 1, 3, 8), positions=torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="either offset or positions"):
        rope(torch.randn(1, 1, 3, 8), offset=1, positions=torch.arange(3))
