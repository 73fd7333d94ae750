"""Rotary position embedding (RoPE) with cos/sin cached once, rotation in one fused pass.

Position p rotates each pair of features (x_a, x_b) by the angle p * base^(-2i/D), i the pair:
pairs (i, i + D/2) by default (GPT-NeoX, LLaMA), or (2i, 2i + 1) with ``interleaved=True`` (GPT-J,
BDH). cos and sin are computed once in fp32, positions exact (integers below 2^24), and kept as
non-persistent buffers: built on the default device (as ``nn.Linear``'s weights; under
``torch.device("meta")`` computed anew by ``to_empty``), they move with ``.to(device)``, ignore
dtype casts (a model cast to bf16 keeps fp32 tables) and stay out of state dicts. A longer
sequence grows the cache to the next power of two, up to ``cache_limit`` positions (default
65,536): one large position id must not grow memory without bound, so tables past it are computed
per call, rounded alike (``grow=False``: it raises instead, for code that must not reallocate;
offset calls without a mask then need no host sync, explicit positions and masks are checked on
the host).

The rotation: the textbook form x cos + rotate_half(x) sin (the reference) makes five passes and
a concatenated copy. Here float32 on the CPU rotates in one pass, reading x once and writing the
output once in either pair layout (``kernels._rope``, C, built by ``pip install``; each product and
sum rounded apart, as torch's vectorized complex multiply rounds them). Elsewhere (and where the C
part is not built, a graph is traced, or a backward is differentiated again) torch ops: interleaved
pairs are complex numbers turned by one complex multiply; half-split pairs have each half written
once (x_a c - x_b s, x_b c + x_a s). Where only dot products of rotated tensors matter (attention
scores), ``paired`` makes each pair's features neighbours (in torch an interleaving copy, then the
complex multiply). The backward, a rotation by -angle, reuses the same pass: an autograd Function
that saves nothing but the cache slice. bf16/fp16 inputs are rotated in fp32 and cast back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from kernels import checks
from kernels._team import c_team

try:
    from kernels import _rope as _c
except ImportError:  # not built (no C compiler at install): torch ops rotate
    _c = None

CACHE_LIMIT = 1 << 16  # positions the cos/sin cache may grow to by default (2 x 32 MiB at head_dim 256)


def rope_angles(head_dim: int, positions: Tensor, base: float) -> Tensor:
    """Angles (..., D/2) in fp64: positions (...) times base^(-2i/D), i = 0..D/2-1. Tables
    rounded from these once are correctly rounded fp32, which fp32 arithmetic of large angles
    is not."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    return positions.to(torch.float64)[..., None] * base**-exponents


def compute_dtype(x: Tensor) -> torch.dtype:
    """Rotations run in fp32 (bf16, fp16, fp32 inputs) or fp64 (fp64 inputs)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_settings(head_dim: int, max_seq_len: int, base: float) -> None:
    if checks.integer(head_dim, "head_dim", low=2) % 2:
        raise ValueError(f"head_dim must be an even int >= 2 (features rotate in pairs), got {head_dim!r}")
    checks.integer(max_seq_len, "max_seq_len", low=1)
    checks.number(base, "base", low=1, low_open=True)


def check_rotate(x: Tensor, head_dim: int, offset: int, positions: Tensor | None) -> int:
    """The checks of a rotation's arguments; returns ``offset`` as a Python int (a numpy integer or
    a 0-d tensor is one too)."""
    checks.tensor(x, "x", ndim=4, floating=True, shape="(B, H, S, D)")
    if x.shape[-1] != head_dim:
        raise ValueError(f"x has head dim {x.shape[-1]}, the embedding was built for {head_dim}")
    offset = checks.integer(offset, "offset", low=0)
    if positions is not None:
        checks.tensor(positions, "positions", ndim=(1, 2), dtypes=(torch.int32, torch.int64),
                      shape="(S,) or (B, S)")
        batch_ok = positions.ndim == 1 or (positions.ndim == 2 and positions.shape[0] in (1, x.shape[0]))
        if not batch_ok or positions.dtype not in (torch.int32, torch.int64) or positions.shape[-1] != x.shape[2]:
            raise ValueError(f"positions must be int32/int64 of shape (S,) or (B, S) with S = {x.shape[2]}, "
                             f"got {positions.dtype} {tuple(positions.shape)}")
        if offset:
            raise ValueError("pass either offset or positions, not both")
        if positions.device != x.device:
            raise ValueError(f"positions are on {positions.device}, x on {x.device}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError("positions must be >= 0")
    return offset


class _Rotate(torch.autograd.Function):
    """y = R(angle) x per pair; dx = R(-angle) dy. cos/sin (S or B*S rows, D/2) in fp32. Under a
    torch.func transform or forward-mode AD the rotation is ``_rotate``'s torch ops instead
    (``_followed``): a Function with ``setup_context``, which transforms need, measured 7-13%
    slower forward and backward (a fixed ~0.1 ms at B8 H8 S512 D64)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the inverse rotation, itself differentiable
            return _Rotate.apply(grad, cos, -sin, ctx.interleaved), None, None, None
        return _rotate(grad, cos, sin, ctx.interleaved, inverse=True), None, None, None


class _RotatePaired(torch.autograd.Function):
    """y = P R(angle) x for half-split pairs, P moving pair i's two features to 2i, 2i + 1;
    dx = R(-angle) P^T dy (torch.func and forward-mode AD: as ``_Rotate``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _paired(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        gf = grad.to(cos.dtype)
        out = _turn(gf, cos, sin, x_pairs=True, out_pairs=False, inverse=True)
        if out is None:
            turned = _as_pairs(gf) * torch.complex(cos, -sin)
            out = torch.cat([turned.real, turned.imag], -1)
        return out.to(grad.dtype), None, None


def _followed(x: Tensor) -> bool:
    """Whether a torch.func transform or forward-mode AD may follow x (a transform active, or a dual
    with a tangent): it is rotated by torch ops, which both differentiate."""
    if torch.compiler.is_compiling():  # a traced graph records the Function (no forward-mode AD there)
        return False
    return torch._C._are_functorch_transforms_active() or fwAD.unpack_dual(x).tangent is not None


def _paired(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """P R(angle) x for half-split pairs (``RotaryEmbedding.paired``): one pass of kernels._rope
    where it applies, else one complex multiply of the halves."""
    xf = x.to(cos.dtype)
    out = _turn(xf, cos, sin, x_pairs=False, out_pairs=True)
    if out is None:
        h = x.shape[-1] // 2
        out = torch.view_as_real(torch.complex(xf[..., :h], xf[..., h:]) * torch.complex(cos, sin)).flatten(-2)
    return out.to(x.dtype)


def _c_rotates(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether kernels._rope rotates x (B, H, S, D) with these tables: built, a plain float32 CPU
    tensor with a unit-stride last dim and 4-byte alignment, no lazy negation or conjugation, no
    result autograd must differentiate (create_graph: the torch ops are), no graph being traced
    (torch.compile, torch.export: the torch ops trace)."""
    if _c is None or torch.compiler.is_compiling() or _followed(x) or not (
            type(x) is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided
            and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.ndim == 4 and x.numel()
            and x.stride(-1) == 1 and x.data_ptr() % 4 == 0
            and not (x.is_neg() or x.is_conj() or cos.is_neg() or sin.is_neg())):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad))


def c_built() -> bool:
    """Whether kernels._rope was built by the install (a C compiler was found)."""
    return _c is not None


def c_tables(cos: Tensor, sin: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """cos, sin (S, D/2) or (B or 1, 1, S, D/2) as the C pass takes them: (T, S, D/2), C-contiguous."""
    return tuple(t.detach().reshape(-1, s, t.shape[-1]).contiguous() for t in (cos, sin))


def rotate_into(x: Tensor, out: Tensor, cos: Tensor, sin: Tensor, *, x_pairs: bool, out_pairs: bool,
                inverse: bool = False) -> Tensor:
    """kernels._rope's one pass: x (B, H, S, D), where ``_c_rotates``, rotated into ``out`` (a
    float32 tensor of x's shape with a unit-stride last dim, overlapping neither x nor the tables:
    a fresh tensor or a view of one), pairs read and written in the layouts named
    (interleaved where ``*_pairs``, else half-split), by -angle where ``inverse``; cos, sin as
    ``c_tables`` returns them. Returns ``out``."""
    _c.turn(x.detach().numpy(), out.numpy(), cos.numpy(), sin.numpy(), x_pairs, out_pairs, inverse,
            c_team(x.numel(), _c.MAX_THREADS))
    return out


def _turn(x: Tensor, cos: Tensor, sin: Tensor, *, x_pairs: bool, out_pairs: bool,
          inverse: bool = False) -> Tensor | None:
    """The rotation of x (B, H, S, D) in one pass by kernels._rope into a new tensor (see
    ``rotate_into``); cos, sin (S, D/2) or (B or 1, 1, S, D/2). None where the C part does not
    apply (``_c_rotates``)."""
    if not _c_rotates(x, cos, sin):
        return None
    cos, sin = c_tables(cos, sin, x.shape[2])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return rotate_into(x, out, cos, sin, x_pairs=x_pairs, out_pairs=out_pairs, inverse=inverse)


def _as_pairs(x: Tensor) -> Tensor:
    """x (..., D) as complex (..., D/2), feature pairs (2i, 2i + 1) as real and imaginary parts: a
    view where x's layout allows one, else a copy's."""
    pairs = x.unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling():  # a traced graph reads no storage offset: a contiguous copy
        return torch.view_as_complex(pairs.contiguous())
    if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
        pairs = pairs.clone(memory_format=torch.contiguous_format)  # own storage: offset 0
    return torch.view_as_complex(pairs)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, *, inverse: bool = False) -> Tensor:
    """x (B, H, S, D) rotated, by -angle where ``inverse``; cos, sin broadcast to (B, H, S, D/2).
    float32 on the CPU: one pass of kernels._rope. Else interleaved pairs are the real and
    imaginary parts of complex numbers, turned by one complex multiply, a single pass over
    contiguous memory; half-split pairs are each half written once (x_a c - x_b s, x_b c + x_a s),
    four ops over half rows."""
    ct = cos.dtype
    xf = x if x.dtype == ct else x.to(ct)
    out = _turn(xf, cos, sin, x_pairs=interleaved, out_pairs=interleaved, inverse=inverse)
    if out is not None:
        return out if x.dtype == ct else out.to(x.dtype)
    sin = -sin if inverse else sin
    if interleaved:
        out = torch.view_as_real(_as_pairs(xf) * torch.complex(cos, sin)).flatten(-2)
        return out if x.dtype == ct else out.to(x.dtype)
    h = x.shape[-1] // 2
    a, b = xf[..., :h], xf[..., h:]
    if torch.compiler.is_compiling() or _followed(xf):  # no out= into halves in a traced graph (the
        # compiler fuses these), under a torch.func transform or forward-mode AD
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
        return out if x.dtype == ct else out.to(x.dtype)
    out = torch.empty(xf.shape, dtype=ct, device=x.device)
    oa, ob = out[..., :h], out[..., h:]
    torch.mul(a, cos, out=oa)
    oa.addcmul_(b, sin, value=-1.0)
    torch.mul(b, cos, out=ob)
    ob.addcmul_(a, sin)
    return out if x.dtype == ct else out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE for q or k of shape (B, H, S, D); call ``rope(x, offset=0, positions=None)``.

    ``positions``: int64 (S,) or (B, S) explicit position ids; ``offset``: positions start there.
    NaN or inf in x propagate to the output, as in any torch op (no host sync on the forward).
    """

    def __init__(self, head_dim: int, max_seq_len: int = 2048, base: float = 10000.0,
                 interleaved: bool = False, *, grow: bool = True, cache_limit: int = CACHE_LIMIT) -> None:
        super().__init__()
        check_settings(head_dim, max_seq_len, base)
        self.head_dim, self.base = head_dim, float(base)
        self.interleaved, self.grow = checks.flag(interleaved, "interleaved"), checks.flag(grow, "grow")
        # growth stops here: one large position id must not grow the cache (and memory) without bound
        self.cache_limit = max(checks.integer(cache_limit, "cache_limit", low=1), max_seq_len)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build(max_seq_len, torch.get_default_device())

    @property
    def max_seq_len(self) -> int:
        return self.cos.shape[0]

    def _build(self, length: int, device: torch.device) -> None:
        with torch.inference_mode(False):  # grown under inference_mode, the tables still serve training
            angles = rope_angles(self.head_dim, torch.arange(length, device=device), self.base)
            self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RotaryEmbedding:
        """Follow ``.to(device)`` with the tables as they were, whatever ``fn`` does to their values:
        a dtype cast would round them, ``to_empty`` leave them uninitialised (the buffers are not
        in the state dict, so no load would mend them). Tables on the meta device are computed anew."""
        cos, sin, length = self.cos, self.sin, self.max_seq_len
        super()._apply(fn, recurse)
        device = self.cos.device
        if cos.device.type == "meta" and device.type != "meta":
            self._build(length, device)
        else:
            self.cos, self.sin = cos.to(device), sin.to(device)
        return self

    def _ensure(self, needed: int) -> bool:
        """Whether the cache covers positions below ``needed``, growing it to the next power of two
        up to ``cache_limit``; False beyond it (the caller computes those tables per call)."""
        if needed <= self.max_seq_len:
            return True
        if not self.grow:
            raise ValueError(f"position {needed - 1} is beyond the cache of {self.max_seq_len} positions "
                             "(grow=False); build the embedding with a larger max_seq_len")
        if needed > self.cache_limit:
            return False
        self._build(min(1 << (needed - 1).bit_length(), self.cache_limit), self.cos.device)
        return True

    def _uncached(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Tables for positions past ``cache_limit``, rounded from fp64 angles as the cache's are."""
        angles = rope_angles(self.head_dim, positions, self.base)
        return angles.cos().float(), angles.sin().float()

    def tables(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin (S, D/2) or (B, 1, S, D/2) in the compute dtype for x (B, H, S, D)."""
        offset = check_rotate(x, self.head_dim, offset, positions)
        if self.cos.device.type == "meta" and x.device.type != "meta":  # built under meta and never moved
            self._build(self.max_seq_len, x.device)  # (load_state_dict(assign=True) leaves these alone)
        if self.cos.device != x.device:
            raise ValueError(f"x is on {x.device}, the embedding's cache on {self.cos.device}: move the "
                             "module with .to(device)")
        if compute_dtype(x) == torch.float64:  # the fp64 path (oracles) computes its table exactly
            pos = torch.arange(offset, offset + x.shape[2], device=x.device) if positions is None else positions
            if not self.grow:
                self._ensure(int(pos.max()) + 1 if pos.numel() else 0)
            angles = rope_angles(self.head_dim, pos, self.base)
            angles = angles if angles.ndim == 2 else angles[:, None]
            return angles.cos(), angles.sin()
        if positions is None:
            if not self._ensure(offset + x.shape[2] if x.shape[2] else 0):  # no position: none to cover
                return self._uncached(torch.arange(offset, offset + x.shape[2], device=x.device))
            return self.cos[offset : offset + x.shape[2]], self.sin[offset : offset + x.shape[2]]
        if self._ensure(int(positions.max()) + 1 if positions.numel() else 0):
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            cos, sin = self._uncached(positions)
        return (cos, sin) if positions.ndim == 1 else (cos[:, None], sin[:, None])

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        cos, sin = self.tables(x, offset, positions)
        if _followed(x):  # torch ops, which the transform or forward-mode AD follows
            return _rotate(x, cos, sin, self.interleaved)
        return _Rotate.apply(x, cos, sin, self.interleaved)

    def paired(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """P R(x): the rotation with each pair's two features made neighbours (2i, 2i + 1), for
        dot products between two tensors rotated alike (attention scores): one permutation P of
        both leaves every dot product unchanged, and adjacent pairs rotate in one complex multiply.
        The same as ``forward`` for interleaved pairs."""
        if self.interleaved:
            return self(x, offset=offset, positions=positions)
        cos, sin = self.tables(x, offset, positions)
        return _paired(x, cos, sin) if _followed(x) else _RotatePaired.apply(x, cos, sin)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base}, "
                f"interleaved={self.interleaved}, grow={self.grow}, cache_limit={self.cache_limit}")
