"""kernels.RotaryEmbedding == reference.rope (per-call cos/sin, rotate_half), == fp64, refusals;
through the one-pass C rotation (kernels._rope) and through torch ops alike; the C part's
arithmetic bit for bit, its fallbacks, its second derivatives, its traced graphs."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.rope as K
import reference.rope as R
from correctness_tests.tolerances import ELEMENTWISE, REDUCTION, assert_close, assert_dicts_close

needs_c = pytest.mark.skipif(K._c is None, reason="kernels._rope is not built (no C compiler at install)")
# each rotation test runs through the C part ("c", where built) and through torch ops ("torch")
PATHS = pytest.mark.parametrize("path", [pytest.param("c", marks=needs_c), "torch"])


def through(path: str):
    """The rotations of kernels.rope go through ``path``: the C part as built, or torch ops."""
    return nullcontext() if path == "c" else mock.patch.object(K, "_c", None)


@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 40), half=st.integers(1, 32),
       interleaved=st.booleans(), offset=st.integers(0, 50), dtype=st.sampled_from([torch.float32, torch.float64]),
       transposed=st.booleans())
@PATHS
def test_rotation_and_its_gradient_equal_reference(path, b, h, s, half, interleaved, offset, dtype,
                                                   transposed) -> None:
    with through(path):
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
@PATHS
def test_paired_is_the_rotation_with_each_pair_made_neighbours(path, b, h, s, half, interleaved, per_batch, dtype,
                                                               odd_offset) -> None:
    with through(path):
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


@PATHS
def test_any_strides_including_a_strided_last_dim(path) -> None:
    base = torch.randn(2, 9, 3, 32)
    for x in (base[..., ::2], base.transpose(1, 2), base[:, ::2]):  # last-dim stride 2, (B,S,H,D) view, gaps
        x = x.transpose(1, 2) if x.shape[1] != 3 else x
        with through(path):
            got = K.RotaryEmbedding(x.shape[-1])(x, offset=3)
        assert_close(got, R.RotaryEmbedding(x.shape[-1])(x, offset=3), ELEMENTWISE)


def _model(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_pairs: bool, out_pairs: bool,
           inverse: bool) -> torch.Tensor:
    """What the C part computes, one torch op a rounding: y_a = a c - b s, y_b = a s + b c, s
    negated for the inverse, pairs read and written in the layouts named."""
    h = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if x_pairs else (x[..., :h], x[..., h:])
    sin = -sin if inverse else sin
    ya, yb = torch.sub(torch.mul(a, cos), torch.mul(b, sin)), torch.add(torch.mul(a, sin), torch.mul(b, cos))
    return torch.stack([ya, yb], -1).flatten(-2) if out_pairs else torch.cat([ya, yb], -1)


@needs_c
@settings(max_examples=100, deadline=None, derandomize=True)
@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 70), half=st.integers(1, 40),
       x_pairs=st.booleans(), out_pairs=st.booleans(), inverse=st.booleans(), per_batch=st.booleans(),
       layout=st.sampled_from(["bhsd", "bshd", "gaps"]), out_layout=st.sampled_from(["bhsd", "bshd", "gaps"]),
       threads=st.integers(1, 8))
def test_the_c_rotation_is_two_products_and_a_sum_each_rounded(b, h, s, half, x_pairs, out_pairs, inverse,
                                                              per_batch, layout, out_layout, threads) -> None:
    """Bit for bit, on any layout of x and of out (a view into a larger buffer, whose other
    elements stay as they were), either pair layout in and out, by +-angle, per-batch tables, the
    rows split over any number of threads; IEEE specials included."""
    d = 2 * half
    views = {"bhsd": lambda t: t.view(b, h, s, d), "bshd": lambda t: t.view(b, s, h, d).transpose(1, 2),
             "gaps": lambda t: t.view(b, 2 * h, s, d + 3)[:, ::2, :, 1 : d + 1]}
    x = views[layout](torch.randn(b * 2 * h * s * (d + 3)) if layout == "gaps" else torch.randn(b * h * s * d))
    x[0, 0, 0, :2] = torch.tensor([float("inf"), -0.0])
    x[-1, -1, -1, -1] = float("nan")
    angles = torch.rand(b if per_batch else 1, 1, s, half, dtype=torch.float64) * 100
    cos, sin = angles.cos().float(), angles.sin().float()
    want = _model(x, cos, sin, x_pairs, out_pairs, inverse)
    buffer = torch.full((b * 2 * h * s * (d + 3) if out_layout == "gaps" else x.numel(),), 7.0)
    got = views[out_layout](buffer)  # the C part itself, at the thread count drawn
    K._c.turn(x.numpy(), got.numpy(), cos[:, 0].contiguous().numpy(), sin[:, 0].contiguous().numpy(), x_pairs,
              out_pairs, inverse, threads)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    views[out_layout](untouched).fill_(False)
    assert bool((buffer[untouched] == 7.0).all())
    # and through kernels.rope's wrapper, its tables (S, D/2) or (B, 1, S, D/2)
    got = K._turn(x, cos if per_batch else cos[0, 0], sin if per_batch else sin[0, 0], x_pairs=x_pairs,
                  out_pairs=out_pairs, inverse=inverse)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_the_c_rotation_is_used_only_where_it_applies() -> None:
    x, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(5, 4), torch.randn(5, 4)
    turn = lambda x, cos=cos, sin=sin: K._turn(x, cos, sin, x_pairs=False, out_pairs=True)
    assert (turn(x) is None) == (K._c is None)
    strided = torch.randn(2, 3, 5, 16)[..., ::2]
    unaligned = torch.frombuffer(bytearray(4 * 240 + 1), dtype=torch.float32, offset=1, count=240).view(2, 3, 5, 8)
    for other in (x.double(), x.half(), strided, x.new_empty(2, 3, 0, 8), unaligned, x.requires_grad_(True)):
        # fp64, fp16, a strided last dim, no elements, off 4-byte alignment, a result to differentiate
        assert turn(other) is None, other.dtype
    with torch.no_grad():
        assert (turn(x) is None) == (K._c is None)  # x needs no gradient of this result
    with mock.patch.object(K, "_c", None):
        assert turn(x.detach()) is None


@PATHS
def test_rotations_that_the_c_part_leaves_to_torch_equal_reference(path) -> None:
    unaligned = torch.frombuffer(bytearray(4 * 240 + 1), dtype=torch.float32, offset=1, count=240).view(2, 3, 5, 8)
    with through(path):
        rope = K.RotaryEmbedding(8)
        got = rope(unaligned)
        with torch.device("meta"):  # a default device elsewhere: the result stays on x's
            on_cpu = rope(unaligned.clone())
    assert_close(got, R.RotaryEmbedding(8)(unaligned), ELEMENTWISE)
    assert on_cpu.device.type == "cpu"
    assert_close(on_cpu, got, ELEMENTWISE)


def _second_derivative(rotate, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """d/dx of (|g|^2 + x.g), g = d/dx |w * rotate(x)|^2 built with create_graph."""
    x = x.detach().requires_grad_(True)
    (g,) = torch.autograd.grad((rotate(x) * w).pow(2).sum(), x, create_graph=True)
    return torch.autograd.grad(g.pow(2).sum() + (x * g).sum(), x)[0]


@PATHS
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("paired", [False, True])
def test_second_derivatives_equal_reference(path, interleaved, paired) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    rope, ref = K.RotaryEmbedding(8, interleaved=interleaved), R.RotaryEmbedding(8, interleaved=interleaved)
    if paired and not interleaved:  # the reference's pairs (i, i + 4) made neighbours (2i, 2i + 1)
        want_fn = lambda x: torch.stack([ref(x)[..., :4], ref(x)[..., 4:]], -1).flatten(-2)
    else:
        want_fn = ref
    with through(path):
        got = _second_derivative(rope.paired if paired else rope, x, w)
    assert_close(got, _second_derivative(want_fn, x, w), REDUCTION)


@PATHS
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("paired", [False, True])
def test_torch_func_transforms_and_forward_ad_equal_reference(path, interleaved, paired) -> None:
    """torch.func.grad, vmap (per-sample gradients: vmap of grad), jacrev and a forward-mode tangent
    through the rotation, against the reference's rotation (pairs made neighbours for ``paired``)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    rope, ref = K.RotaryEmbedding(8, interleaved=interleaved), R.RotaryEmbedding(8, interleaved=interleaved)
    ours = rope.paired if paired else rope
    theirs = (lambda x: torch.stack([ref(x)[..., :4], ref(x)[..., 4:]], -1).flatten(-2)) if paired and not \
        interleaved else ref

    def transforms(rotate) -> dict[str, torch.Tensor]:
        loss = lambda x: (rotate(x) * w).square().sum()
        per_sample = torch.func.vmap(torch.func.grad(lambda xi: (rotate(xi[None]) * w[:1]).square().sum()))(x)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x, w)
            tangent = torch.autograd.forward_ad.unpack_dual(rotate(dual)).tangent
        return {"grad": torch.func.grad(loss)(x), "vmap of grad": per_sample, "tangent": tangent,
                "jacrev": torch.func.jacrev(rotate)(x[:1, :1, :2])}

    with through(path):
        got = transforms(ours)
    assert_dicts_close(got, transforms(theirs), ELEMENTWISE)


@PATHS
def test_the_rotation_of_a_plain_tensor_while_a_transform_is_active(path) -> None:
    """x itself unbatched and unwrapped under vmap (over another input) and torch.func.jvp (the
    tangent of another input): while a transform is active the rotation is torch ops."""
    torch.manual_seed(0)
    x, ws = torch.randn(2, 3, 5, 8), torch.randn(4, 2, 3, 5, 8)
    rope, ref = K.RotaryEmbedding(8), R.RotaryEmbedding(8)
    with through(path):
        got = torch.func.vmap(lambda w: (rope(x) * w).sum())(ws)
        _, tangent = torch.func.jvp(lambda w: rope(x) * w, (ws[0],), (ws[1],))
    assert_close(got, torch.func.vmap(lambda w: (ref(x) * w).sum())(ws), REDUCTION)
    assert_close(tangent, ref(x) * ws[1], ELEMENTWISE)



@pytest.mark.parametrize("paired", [False, True])
def test_a_traced_rotation_runs_the_torch_ops(paired) -> None:
    """torch.compile(fullgraph=True) and torch.export trace the rotation (the C part is opaque to
    them), forward and backward, to the eager result."""
    rope = K.RotaryEmbedding(8)
    rotate = rope.paired if paired else rope
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    grad = torch.randn(2, 3, 5, 8)
    want = rotate(x)
    got = torch.compile(rotate, fullgraph=True, backend="eager")(x)
    assert_close(got, want, ELEMENTWISE)
    assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0], ELEMENTWISE)

    class Rotate(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return rotate(x)

    exported = torch.export.export(Rotate(), (x.detach(),))
    assert_close(exported.module()(x.detach()), want.detach(), ELEMENTWISE)


@needs_c
def test_the_c_part_refuses_buffers_it_cannot_rotate() -> None:
    x, table = torch.randn(2, 3, 5, 8), torch.randn(1, 5, 4)
    out = torch.empty_like(x)
    turn = lambda *args, threads=1: K._c.turn(*args, False, True, False, threads)
    with pytest.raises(TypeError, match="x must hold float32"):
        turn(x.double().numpy(), out.numpy(), table.numpy(), table.numpy())
    with pytest.raises(ValueError, match="4 dims"):
        turn(x[0].numpy(), out[0].numpy(), table.numpy(), table.numpy())
    with pytest.raises(ValueError, match="out must have x's shape"):
        turn(x.numpy(), out[:, :2].contiguous().numpy(), table.numpy(), table.numpy())
    with pytest.raises(ValueError, match="both a unit stride"):  # out's pairs must be its rows' neighbours
        turn(x.numpy(), torch.empty(2, 3, 5, 16)[..., ::2].numpy(), table.numpy(), table.numpy())
    with pytest.raises(ValueError, match=r"cos and sin must be \(1 or B, S, D/2\)"):
        turn(x.numpy(), out.numpy(), torch.randn(3, 5, 4).numpy(), torch.randn(3, 5, 4).numpy())
    with pytest.raises(ValueError, match="threads must be"):
        turn(x.numpy(), out.numpy(), table.numpy(), table.numpy(), threads=0)
    for empty in (x[:, :, :0], x[:, :0]):  # no rows: nothing done, nothing divided by zero
        assert turn(empty.numpy(), torch.empty(empty.shape).numpy(), table[:, : empty.shape[2]].numpy(),
                    table[:, : empty.shape[2]].numpy(), threads=2) is None


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


@settings(max_examples=60)
@given(b=st.integers(1, 3), s=st.integers(1, 6), half=st.integers(1, 4), interleaved=st.booleans(),
       max_seq_len=st.integers(1, 8), cache_limit=st.integers(1, 16), offset=st.integers(0, 80),
       where=st.sampled_from(["offset", "positions", "per batch"]), dtype=st.sampled_from([torch.float32,
                                                                                          torch.float64]))
@PATHS
def test_positions_past_the_cache_limit_equal_reference(path, b, s, half, interleaved, max_seq_len, cache_limit,
                                                        offset, where, dtype) -> None:
    """Positions past ``cache_limit`` (an offset, explicit (S,) or (B, S) ids, most of them beyond
    it) are rotated by tables computed for the call, as the reference's, forward and gradient;
    the cache never grows past the limit."""
    d = 2 * half
    x = torch.randn(b, 2, s, d, dtype=dtype, requires_grad=True)
    kwargs = {"offset": offset} if where == "offset" else {
        "positions": torch.randint(0, offset + 1, (s,) if where == "positions" else (b, s))}
    rope = K.RotaryEmbedding(d, max_seq_len, interleaved=interleaved, cache_limit=cache_limit)
    with through(path):
        got = rope(x, **kwargs)
        want = R.RotaryEmbedding(d, max_seq_len, interleaved=interleaved)(x, **kwargs)
        assert_close(got, want, ELEMENTWISE)
        grad = torch.randn_like(got)
        assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0], ELEMENTWISE)
    assert rope.max_seq_len <= max(cache_limit, max_seq_len)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offsets_and_positions_past_the_cache_limit(path, dtype) -> None:
    """A cache of 4 that may grow to 8: offset 10, positions (20, 30) and per-batch positions are
    computed for the call (the cache stays at 8 at most), equal to the reference."""
    rope, ref = K.RotaryEmbedding(4, max_seq_len=4, cache_limit=8), R.RotaryEmbedding(4, max_seq_len=4)
    x = torch.randn(2, 1, 2, 4, dtype=dtype)
    with through(path):
        for kwargs in ({"offset": 10}, {"positions": torch.tensor([20, 30])},
                       {"positions": torch.tensor([[20, 30], [9, 3]])}):
            assert_close(rope(x, **kwargs), ref(x, **kwargs), ELEMENTWISE)
    assert rope.max_seq_len <= 8


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
    # tables left on meta (a meta init, then load_state_dict(assign=True), which they are not in):
    # computed where x is on its first call, as they are derived (it raised, advising a .to() that
    # torch refuses from meta)
    x = torch.randn(1, 1, 4, 8)
    assert_close(meta(x), R.RotaryEmbedding(8)(x), ELEMENTWISE)
    assert meta.cos.device.type == "cpu"


def test_a_cache_grown_under_inference_mode_serves_training() -> None:
    rope = K.RotaryEmbedding(8, max_seq_len=4)
    with torch.inference_mode():
        rope(torch.randn(1, 1, 8, 8))  # grows the cache to 8 positions
    assert rope.max_seq_len == 8 and not rope.cos.is_inference()
    x = torch.randn(1, 1, 8, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(rope(x).sum(), x)
    xr = x.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(R.RotaryEmbedding(8)(xr).sum(), xr)
    assert_close(gx, want, ELEMENTWISE)


def test_the_tables_are_built_on_the_default_device() -> None:
    # as the parameters beside them: a model built under ``with torch.device("cuda")`` runs as built
    with torch.device("meta"):
        rope, linear = K.RotaryEmbedding(8, 32), torch.nn.Linear(8, 8)
    assert rope.cos.device == rope.sin.device == linear.weight.device == torch.device("meta")
    assert K.RotaryEmbedding(8, 32).cos.device == torch.device("cpu")


def test_to_empty_after_a_meta_init_keeps_valid_tables() -> None:
    """meta init, to_empty, load_state_dict: the tables are not in the state dict, so to_empty
    must not leave them uninitialised."""
    with torch.device("meta"):
        model = torch.nn.Module()
        model.rope = K.RotaryEmbedding(8, 32)
    model.to_empty(device="cpu")
    x = torch.randn(1, 2, 30, 8)
    assert_close(model.rope(x), R.RotaryEmbedding(8)(x), ELEMENTWISE)
    on_meta = K.RotaryEmbedding(8, 32).to("meta")  # tables on meta: computed anew where they land
    on_meta.to_empty(device="cpu")
    assert_close(on_meta(x), R.RotaryEmbedding(8)(x), ELEMENTWISE)


@pytest.mark.parametrize("side", [K, R])
def test_fixed_cache_refuses_positions_beyond_it(side) -> None:
    rope = side.RotaryEmbedding(8, max_seq_len=16, grow=False)
    rope(torch.randn(1, 1, 16, 8))
    with pytest.raises(ValueError, match="beyond the cache of 16"):
        rope(torch.randn(1, 1, 4, 8), offset=13)
    with pytest.raises(ValueError, match="beyond the cache"):
        rope(torch.randn(1, 1, 2, 8), positions=torch.tensor([0, 16]))
    for dtype in (torch.float32, torch.float64):  # no position past an offset: nothing beyond the cache
        assert rope(torch.randn(1, 2, 0, 8, dtype=dtype), offset=20).shape == (1, 2, 0, 8)


@pytest.mark.parametrize("side", [K, R])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fixed_cache_refuses_positions_beyond_it_in_every_dtype(side, dtype) -> None:
    """grow=False in fp64 too (whose tables are computed per call): an offset or explicit
    positions past a cache of 4 positions are refused."""
    rope = side.RotaryEmbedding(8, max_seq_len=4, grow=False)
    x = torch.randn(1, 1, 2, 8, dtype=dtype)
    assert_close(rope(x, offset=2), R.RotaryEmbedding(8)(x, offset=2), ELEMENTWISE)  # within it: taken
    with pytest.raises(ValueError, match="position 11 is beyond the cache of 4 positions"):
        rope(x, offset=10)
    with pytest.raises(ValueError, match="position 7 is beyond the cache of 4 positions"):
        rope(x, positions=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="position 9 is beyond the cache of 4 positions"):
        rope(x, positions=torch.tensor([[0, 9]]))


@pytest.mark.parametrize("side", [K, R])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_positions_of_another_batch_size_are_refused(side, dtype) -> None:
    """(B, S) positions must have B rows (or 1): 2 rows for B = 1 would broadcast x to a batch of
    2, 3 rows for B = 2 fail inside torch; both refused by name."""
    rope = side.RotaryEmbedding(4)
    for b, rows in ((1, 2), (2, 3)):
        x = torch.randn(b, 2, 3, 4, dtype=dtype)
        with pytest.raises(ValueError, match=r"positions must be int32/int64 of shape \(S,\) or \(B, S\) with "
                                             rf"S = 3, got torch.int64 \({rows}, 3\)"):
            rope(x, positions=torch.zeros(rows, 3, dtype=torch.int64))
    assert rope(torch.randn(2, 2, 3, 4, dtype=dtype), positions=torch.zeros(1, 3, dtype=torch.int64)).shape == \
        (2, 2, 3, 4)  # one row: shared by the batch


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


@pytest.mark.parametrize("offset", [np.int64(6), torch.tensor(6)])
def test_an_integer_offset_of_another_type_grows_the_cache(offset) -> None:
    """A numpy integer or a 0-d tensor offset (accepted by the check) past a cache of 4 positions:
    the cache grows as for an int (it raised AttributeError: no bit_length)."""
    x = torch.randn(1, 2, 3, 8)
    got = K.RotaryEmbedding(8, max_seq_len=4)(x, offset=offset)
    assert_close(got, R.RotaryEmbedding(8)(x, offset=6), ELEMENTWISE)


@needs_c
def test_the_c_part_refuses_an_odd_head_dim_tables_of_another_length_or_shape_and_too_many_threads() -> None:
    """The C part's shape checks guard its reads: an odd D would leave a feature unwritten, cos or
    sin with other positions or another shape than each other would be read past their ends, and
    a team beyond MAX_THREADS is refused as one below 1 is."""
    x, table = torch.randn(2, 3, 5, 8), torch.randn(1, 5, 4)
    out = torch.empty_like(x)
    turn = lambda *args, threads=1: K._c.turn(*args, False, True, False, threads)
    odd, half = torch.randn(2, 3, 5, 7), torch.randn(1, 5, 3)
    with pytest.raises(ValueError, match="an even D"):
        turn(odd.numpy(), torch.empty_like(odd).numpy(), half.numpy(), half.numpy())
    for positions in (4, 6):  # S = 5
        other = torch.randn(1, positions, 4)
        with pytest.raises(ValueError, match=r"cos and sin must be \(1 or B, S, D/2\)"):
            turn(x.numpy(), out.numpy(), other.numpy(), other.numpy())
    with pytest.raises(ValueError, match=r"got cos \(1, 5, 4\) and sin \(1, 4, 4\)"):  # sin's shape is cos's
        turn(x.numpy(), out.numpy(), table.numpy(), torch.randn(1, 4, 4).numpy())
    with pytest.raises(ValueError, match="threads must be"):
        turn(x.numpy(), out.numpy(), table.numpy(), table.numpy(), threads=K._c.MAX_THREADS + 1)
    turn(x.numpy(), out.numpy(), table.numpy(), table.numpy(), threads=K._c.MAX_THREADS)  # the most it takes
