"""Attention with cached RoPE on ``scaled_dot_product_attention``, and the module around it.

``rope_attention`` rotates q and k with a ``RotaryEmbedding`` (cos/sin from the cache; each
pair's features made neighbours, ``RotaryEmbedding.paired``, which turns them in one complex
multiply and leaves every score q . k unchanged) and calls SDPA, which picks a fused kernel
(flash / memory-efficient on CUDA, the flash CPU kernel on CPU) instead of materializing the
(S, S) score matrix. Grouped-query attention (kv heads dividing q heads) goes to SDPA's
``enable_gqa``; causal plus a mask becomes one mask.

Except on CPU in fp32, without the causal mask, over at most ``CPU_MATH_MAX_SEQ`` = 128
positions, where one batched matmul, in-place scale and mask, softmax and a second matmul
measured faster than torch's flash CPU kernel (evidence/from-the-code.md): there grouped-query
heads become extra query rows of their kv head (no repeated k, v).

In float32 on the CPU (the causal mask: below), with nothing to differentiate (inference, or q, k,
v and the mask needing no gradient), up to ``CPU_FUSED_SEQ`` = 128 positions, or without a mask
longer on the CPUs where that measured faster (``CPU_FUSED_SEQ_TWO_THREADS``,
``CPU_FUSED_SEQ_ONE_THREAD``, by the vendor /proc/cpuinfo names): on AMD 512 at 2 threads
(grouped-query heads: not where kernels._softmax's AVX2 kernel runs) and 256 at 1 where its
AVX-512F kernel runs, on Intel 192 at 2 threads, the
rotation and the attention are fused a chunk of heads at a time: each chunk's q and k are rotated by
the C pass (kernels/_rope.c) into a buffer of their own, scored by one batched matmul (the scale its
alpha), masked, turned into probabilities in place (by kernels/_softmax.c's AVX-512F or AVX2 kernel
where the CPU runs one, else torch.softmax) and multiplied by v; a chunk's rotated q and k and
scores take at most ``FUSED_BYTES`` = 5 MiB (one kv head's where that is more). The rotated q and k
are read from the caches they were written to instead of from memory, and no (B, H, S, S) scores are
written whole. The lengths are where the fused path stops being faster than rotating first, and
a mask applied chunk by chunk slower than SDPA's own (evidence/fused-attention-*.txt and
evidence/fused_attention_parts.py have the measurements).
The causal mask without another takes the fused path where one of kernels._softmax's kernels
runs: each query row's softmax over its keys up to its own position, the later probabilities set
to 0 with no mask pass and no exp computed for them (its causal rows). It does the unmasked
path's matmuls and less of its softmax, while SDPA's causal call costs what its full one does
below the causal blocks' lengths, so it takes the unmasked path's lengths up to
``CPU_FUSED_CAUSAL_SEQ`` = 256; measured on the Zen 3, faster than rotating first and SDPA's
causal call up to 256 positions at 2 threads and up to 128 at 1 (where the unmasked path stops),
and slower than the causal blocks at 384 and 512 (evidence/fused-causal-zen3.txt). The causal mask with
another one is one mask, and SDPA's (masking each chunk measured slower there).
A training forward keeps the unfused paths, whose rotation is differentiable.

RopeSelfAttention in training (a gradient to build) on CPU in float32, without a mask (the causal
one only where a kernels._softmax kernel runs: its causal rows, as the fused path's), over at most
``CPU_MATH_MAX_SEQ`` positions, attends through ``_ProjectedAttention``: one
autograd node from the qkv projection's output to the output projection's input, instead of a
graph of the split, the rotations, the scores, their scale, the softmax and the products. Its
forward reads q and k from their strided views of the projection (the C rotation), its backward
writes the rotated-back dq and dk and dv straight into the projection's gradient, in its layout:
no cat of the heads' gradients and no transposed copy of it, no scale pass, and no rotation
backward in torch ops (k's gradient from torch's matmul is transposed, a layout the C pass does
not read). Measured faster at every shape it takes (evidence/attention_training.py).

And causal on CPU over 384 to 512 positions (``CPU_CAUSAL_SEQ``; fp32, bf16, fp16): torch's flash CPU
kernel scores each block of queries against a whole block of up to 512 keys and masks the ones past
the query afterwards, so up to 512 positions causal costs what full attention does. There one SDPA
call per 256 query rows, over the keys they may see, skips those scores. Shorter, the blocks
measured no faster; longer, torch's kernel skips whole key blocks itself and the blocks gained at
most 6% (640) or lost (768 on) (evidence/causal_blocks.py, without a mask; with one, each block
takes its slice of it).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import checks, cpu
from kernels._team import c_team
from kernels.rope import RotaryEmbedding, _c_rotates, _followed, c_built, c_tables, rotate_into

try:
    from kernels import _softmax as _c_softmax
except ImportError:  # not built (no C compiler at install): torch.softmax
    _c_softmax = None


def check_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> None:
    """The refusals shared with ``reference.attention``: shapes (B, H, S, D), heads, dtypes, mask."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(t, name, ndim=4, shape="(B, H, S, D)")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    if not q.is_floating_point():
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if b != bk or k.shape[:3] != v.shape[:3] or s != sk or d != dk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need the same B and S "
                         "(self-attention), q and k the same D, k and v the same heads")
    if hk < 1 or h % hk:
        raise ValueError(f"kv heads ({hk}) must divide q heads ({h}) for grouped-query attention")
    if attn_mask is not None:
        checks.tensor(attn_mask, "attn_mask", shape="broadcasting to (B, H, S, S)")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = attend) or floating (added), got {attn_mask.dtype}")
        try:
            if torch.broadcast_shapes(attn_mask.shape, (b, h, s, s)) != (b, h, s, s):
                raise RuntimeError
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, S, S) = "
                             f"{(b, h, s, s)}") from None
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")


def combined_mask(attn_mask: Tensor | None, causal: bool, s: int, device: torch.device,
                  dtype: torch.dtype) -> Tensor | None:
    """One mask for causal + attn_mask (a float mask in ``dtype``, e.g. bf16 under autocast); a mask
    that leaves a query row nothing to attend to is refused (softmax over nothing is NaN)."""
    if attn_mask is None:
        return None  # causal alone: SDPA's is_causal
    if attn_mask.ndim < 2:  # one value, or one per key: as (S, S), which SDPA's kernels all take
        attn_mask = attn_mask.expand(s, s)
    mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(dtype)
    if causal:
        tril = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, float("-inf"))
    # a float row of infinities alone (+inf too) has no finite score to normalize: NaN
    empty_row = ~mask.any(-1) if mask.dtype == torch.bool else mask.isinf().all(-1)
    if bool(empty_row.any()):
        raise ValueError("attn_mask (after the causal mask, if any) leaves some query with no key to attend to: "
                         "its softmax is undefined; let every query attend to at least one key")
    return mask


CPU_MATH_MAX_SEQ = 128  # measured crossover (module note)


def _takes_explicit(q: Tensor, causal: bool) -> bool:
    """Whether ``_math_attention`` measured faster than SDPA for q (B, H, S, D) (module note)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and not causal and q.shape[2] <= CPU_MATH_MAX_SEQ


def _mask_scores(scores: Tensor, mask: Tensor) -> None:
    """In place: -inf where a bool ``mask`` is False, or a float one added (combined_mask's, in
    the scores' shape)."""
    scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)


def _math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with the (S, S) scores written once and scaled and masked in
    place; q heads of one kv head become rows of one matmul. ``mask``: combined_mask's."""
    b, h, s, d = q.shape
    hk = k.shape[1]
    g = h // hk
    scores = torch.matmul(q.reshape(b, hk, g * s, d), k.transpose(-2, -1)).mul_(d**-0.5)
    grouped = scores.view(b, hk, g, s, s)
    if mask is not None:
        _mask_scores(grouped, mask.expand(b, h, s, s).reshape(b, hk, g, s, s))
    return torch.matmul(torch.softmax(scores, dim=-1), v).view(b, h, s, v.shape[-1])


CPU_CAUSAL_BLOCK = 256  # query rows per SDPA call of the blocked causal path (module note)
CPU_CAUSAL_SEQ = (384, 512)  # the lengths where the blocks measured faster than one causal call
CPU_CAUSAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # measured; fp64 stays one call (oracles)


def _causal_block(q: Tensor, causal: bool) -> int | None:
    """Query rows per SDPA call where the blocked causal path measured faster than one call, for q
    (B, H, S, D): CPU, causal, S in CPU_CAUSAL_SEQ, a dtype in CPU_CAUSAL_DTYPES (module note);
    else None."""
    lo, hi = CPU_CAUSAL_SEQ
    if q.device.type == "cpu" and q.dtype in CPU_CAUSAL_DTYPES and causal and lo <= q.shape[2] <= hi:
        return CPU_CAUSAL_BLOCK
    return None


def _blocked_causal(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, block: int) -> Tensor:
    """Causal attention as one SDPA call per ``block`` query rows, each over the keys it may see:
    q (B, H, S, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv), ``mask`` combined_mask's (..., S, S)
    or None -> (B, H, S, Dv).

    Rows [i, i + block) attend keys [0, i + block) only: the keys after them, which one call would
    score and then mask, are never computed. The first block is SDPA's own causal square; a later
    one takes the causal mask aligned to its last row (key n visible to row r when n <= r), or the
    slice of ``mask`` (causal already in it). The blocks are concatenated as SDPA returns them, so
    the output's dtype is SDPA's (bf16 under CPU autocast), as one call's would be."""
    s = q.shape[2]
    gqa = bool(k.shape[1] != q.shape[1])  # a bool while jit-traced too
    parts = []
    for start in range(0, s, block):
        stop = min(start + block, s)
        rows, keys, vals = q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop]
        if mask is not None:
            part = mask[..., start:stop, :stop]
        elif start:
            part = torch.ones(stop - start, stop, dtype=torch.bool, device=q.device).tril_(start)
        else:
            part = None
        parts.append(F.scaled_dot_product_attention(rows, keys, vals, attn_mask=part, is_causal=part is None,
                                                    enable_gqa=gqa))
    return torch.cat(parts, dim=2)


CPU_FUSED_SEQ = 128  # the longest S of the fused path (module note)
# ... without a mask, by the CPU's vendor as measured (module note; any other: CPU_FUSED_SEQ): at 2 threads,
CPU_FUSED_SEQ_TWO_THREADS = {"AuthenticAMD": 512, "GenuineIntel": 192}
# ... and at 1 thread where kernels._softmax's AVX-512F kernel runs
CPU_FUSED_SEQ_ONE_THREAD = {"AuthenticAMD": 256}
CPU_FUSED_CAUSAL_SEQ = 256  # causal: the longest S measured faster fused, short of the causal blocks'
FUSED_BYTES = 5 << 20  # a chunk's rotated q and k and its scores, at most one kv head's over it


def _fuses(q: Tensor, k: Tensor, v: Tensor, rope: nn.Module, causal: bool, mask: Tensor | None,
           positions: object) -> bool:
    """Whether the fused CPU path takes this call (module note): float32 on the CPU, S at most
    CPU_FUSED_SEQ (without a mask, this CPU vendor's CPU_FUSED_SEQ_TWO_THREADS at 2 threads, for
    grouped-query heads not where kernels._softmax's AVX2 kernel runs, and its
    CPU_FUSED_SEQ_ONE_THREAD at 1 where its AVX-512F kernel runs; causal: without another mask,
    where a kernels._softmax kernel runs, and at most CPU_FUSED_CAUSAL_SEQ), a RotaryEmbedding whose
    rotation is ours, one table for every batch row, plain tensors, nothing to differentiate (no
    gradient to build, no forward-mode tangent, no torch.func transform) and no autocast, not while
    a graph is traced (torch.compile, torch.export, torch.jit.trace: none records the C parts). The
    C pass must also rotate q and k (``_c_rotates``, checked with the tables)."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or q.device.type != "cpu"
            or q.dtype != torch.float32 or not _rotates_ours(rope)):
        return False
    threads, isa, vendor = torch.get_num_threads(), _softmax_in_c(), cpu.vendor()
    if causal and (mask is not None or not isa):  # causal: by the C softmax's causal rows, no other mask
        return False
    # grouped-query heads past 128 positions at 2 threads with the AVX2 softmax: slower fused (module note)
    grouped_avx2 = isa == "avx2" and k.shape[1] != q.shape[1]
    limit = (CPU_FUSED_SEQ_TWO_THREADS.get(vendor, CPU_FUSED_SEQ) if threads == 2 and not grouped_avx2 else
             CPU_FUSED_SEQ_ONE_THREAD.get(vendor, CPU_FUSED_SEQ) if threads == 1 and isa == "avx512f" else
             CPU_FUSED_SEQ)
    if causal:  # the unmasked lengths, up to the longest measured causal (module note)
        limit = min(limit, CPU_FUSED_CAUSAL_SEQ)
    one_table = positions is None or (isinstance(positions, Tensor) and positions.ndim == 1)
    if q.shape[2] > (limit if mask is None else CPU_FUSED_SEQ) or not one_table:  # a mask: up to 128 only
        return False
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _plain(tensors)


def _rotates_ours(rope: nn.Module) -> bool:
    """Whether ``rope`` is a RotaryEmbedding rotating as ours does: a subclass rotating its own way
    rotates through its own methods."""
    return isinstance(rope, RotaryEmbedding) and all(
        getattr(type(rope), f) is getattr(RotaryEmbedding, f) for f in ("forward", "paired", "tables"))


def _plain(tensors: tuple[Tensor, ...]) -> bool:
    """Whether a path of C passes and out= ops may take these: plain tensors, no autocast, no
    forward-mode tangent and no torch.func transform (the C passes and the out= ops record nothing
    either could follow: those take the differentiable torch ops)."""
    if (any(type(t) is not torch.Tensor for t in tensors) or torch.is_autocast_enabled("cpu")
            or torch._C._are_functorch_transforms_active()):  # a transform of other inputs
        return False
    # a transform's tensor first: vmap's batched tensors have no dual to unpack
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(t) or fwAD.unpack_dual(t).tangent is not None
                   for t in tensors)


def _softmax_in_c() -> str:
    """The kernel of kernels._softmax that runs here ("avx512f" or "avx2"), "" where none does (not
    built, or a CPU with neither)."""
    return "" if _c_softmax is None else _c_softmax.ISA


def _softmax_(scores: Tensor, causal: bool = False) -> Tensor:
    """softmax over the last dim of ``scores`` (a C-contiguous float32 CPU tensor needing no
    gradient), in place: by kernels._softmax where it runs (``_softmax_in_c``), else by
    torch.softmax. ``causal``: scores are stacked (S, S) squares, (..., S) with a multiple of S
    rows, and each row's softmax is over the keys up to its own position, the later ones 0.
    Returns ``scores``."""
    isa = _softmax_in_c()
    if not scores.numel():  # nothing to normalize (rows of no keys, or no rows)
        return scores
    if not isa:
        if causal:
            s = scores.shape[-1]
            above = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu_(1)
            scores.view(-1, s, s).masked_fill_(above, float("-inf"))
        return torch.softmax(scores, -1, out=scores)  # in place: each row is read before it is written
    _c_softmax.softmax_(scores.numpy(), c_team(scores.numel(), _c_softmax.MAX_THREADS), isa, causal)
    return scores


def _units(b: int, hk: int, per: int):
    """(batch rows, kv heads) slices of the B * H_kv units of attention, ``per`` units a chunk at
    most: whole batch rows where ``per`` covers one, else one row's heads in equal shares (7 of 8
    would leave a chunk of one)."""
    if per >= hk:
        rows = per // hk
        for r in range(0, b, rows):
            yield slice(r, min(r + rows, b)), slice(0, hk)
    else:
        share = -(-hk // -(-hk // per))  # ceil(hk / the number of shares)
        for r in range(b):
            for j in range(0, hk, share):
                yield slice(r, r + 1), slice(j, min(j + share, hk))


def _fused_attention(q: Tensor, k: Tensor, v: Tensor, tables: tuple, interleaved: bool,
                     mask: Tensor | None, causal: bool = False) -> Tensor:
    """softmax(R(q) R(k)^T / sqrt(D) + mask) v, a chunk of heads at a time: q (B, H, S, D), k
    (B, H_kv, S, D), v (B, H_kv, S, Dv), cos and sin (S, D/2), ``mask`` combined_mask's or None
    -> (B, H, S, Dv). ``causal`` (with no mask): each query over the keys up to its position, by
    the softmax's causal rows.

    Each chunk's q and k are rotated by the C pass into buffers of their own (pairs made
    neighbours, as ``RotaryEmbedding.paired`` does) and read by the scores' matmul from the
    caches; the scores are scaled by the matmul, masked, turned into probabilities in place and
    multiplied by v into the output. A chunk's rotated q and k and scores take FUSED_BYTES at most,
    or one kv head's where that is more. q heads of one kv head are rows of
    one matmul (grouped-query attention)."""
    b, h, s, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    g = h // hk
    cos, sin = c_tables(*tables, s)
    per = max(1, FUSED_BYTES // ((g * s * d + s * d + g * s * s) * q.element_size()))  # units a chunk
    out = torch.empty(b, h, s, dv, dtype=q.dtype, device=q.device)  # q's device, whatever the default
    # one allocation a call for every chunk's rotated q and k and its scores, each chunk a view
    most = min(per, b * hk)
    work = torch.empty(most * (g + 1) * s * d + most * g * s * s, dtype=q.dtype, device=q.device)
    scores = work[most * (g + 1) * s * d :].view(most, g * s, s)
    full = None if mask is None else mask.expand(b, h, s, s)
    for rows, heads in _units(b, hk, per):
        qh = slice(heads.start * g, heads.stop * g)  # the q heads of these kv heads
        xq, xk = q[rows, qh], k[rows, heads]
        n = xk.shape[0] * xk.shape[1]  # units in this chunk
        rq = rotate_into(xq, work[: n * g * s * d].view(xq.shape), cos, sin, x_pairs=interleaved, out_pairs=True)
        rk = rotate_into(xk, work[most * g * s * d :][: n * s * d].view(xk.shape), cos, sin, x_pairs=interleaved,
                         out_pairs=True)
        sc = scores[:n]
        torch.baddbmm(sc, rq.view(n, g * s, d), rk.view(n, s, d).transpose(1, 2), beta=0, alpha=d**-0.5, out=sc)
        if full is not None:
            _mask_scores(sc, full[rows, qh].reshape(n, g * s, s))
        _softmax_(sc, causal)
        torch.bmm(sc, v[rows, heads].reshape(n, s, dv), out=out[rows, qh].view(n, g * s, dv))
    return out


def rope_attention(q: Tensor, k: Tensor, v: Tensor, rope: RotaryEmbedding, *, causal: bool = False,
                   attn_mask: Tensor | None = None, offset: int = 0, positions: Tensor | None = None) -> Tensor:
    """softmax(R(q) R(k)^T / sqrt(D) + mask) v: q (B, H, S, D), k and v (B, H_kv, S, D) -> (B, H, S, D).

    NaN or inf in q, k or v propagate to the output as in any torch op (a check would cost a host
    sync on every forward); the training engine refuses the non-finite loss they make."""
    check_attention(q, k, v, attn_mask)
    if not (isinstance(rope, nn.Module) and hasattr(rope, "head_dim")):  # kernels' or reference's RotaryEmbedding
        raise TypeError(f"rope must be a RotaryEmbedding (kernels.RotaryEmbedding(head_dim)), "
                        f"got {type(rope).__name__}")
    if q.shape[-1] != rope.head_dim:
        raise ValueError(f"q has head dim {q.shape[-1]}, rope was built for {rope.head_dim}; "
                         f"pass RotaryEmbedding({q.shape[-1]})")
    checks.flag(causal, "causal")
    mask = combined_mask(attn_mask, causal, q.shape[2], q.device, q.dtype)
    # q and k rotated with their pairs made neighbours (the same permutation of both: the scores
    # are unchanged), which rotates in one complex multiply; a module with a forward of its own
    # (the reference's, a subclass's) rotates through it
    ours = isinstance(rope, RotaryEmbedding) and type(rope).forward is RotaryEmbedding.forward
    if _fuses(q, k, v, rope, causal, mask, positions):
        tables = rope.tables(q, offset, positions)  # checks q; k has q's B, S and D (check_attention)
        if _c_rotates(q, *tables) and _c_rotates(k, *tables):
            return _fused_attention(q, k, v, tables, rope.interleaved, mask, causal)
    if (not torch.compiler.is_compiling() and v.is_inference() and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad)):
        v = v.clone()  # a value cache made under inference_mode: autograd cannot save it for q's and k's backward
    turn = rope.paired if ours else rope
    q, k = turn(q, offset=offset, positions=positions), turn(k, offset=offset, positions=positions)
    if _takes_explicit(q, causal):
        return _math_attention(q, k, v, mask)
    if any(_followed(t) for t in (q, k, v)):
        # SDPA's CPU flash kernel has no forward-mode formula: its math backend, torch ops, has
        with sdpa_kernel(SDPBackend.MATH):
            return _sdpa(q, k, v, mask, causal)
    return _sdpa(q, k, v, mask, causal)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """SDPA on rotated q (B, H, S, D), k and v (B, H_kv, S, D): in blocks of query rows where
    those measured faster (``_causal_block``), else one call."""
    block = _causal_block(q, causal)
    if block is not None:
        return _blocked_causal(q, k, v, mask, block)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=bool(k.shape[1] != q.shape[1]))  # a bool while jit-traced too


def _trains_fused(module: RopeSelfAttention, qkv: Tensor, attn_mask: Tensor | None) -> bool:
    """Whether RopeSelfAttention's forward takes ``_ProjectedAttention`` (module note): a gradient to
    build, float32 on the CPU, no mask, S at most CPU_MATH_MAX_SEQ (where the explicit attention
    measured faster than SDPA), causal only where a C softmax kernel runs (its causal rows), the
    module's own attention and a RotaryEmbedding rotating as ours, kernels._rope built, and nothing
    traced (torch.compile, torch.export, torch.jit.trace) or transformed (torch.func, forward-mode
    AD): those take the differentiable torch ops."""
    s = qkv.shape[1]
    if (not (torch.is_grad_enabled() and qkv.requires_grad) or torch.compiler.is_compiling()
            or torch.jit.is_tracing() or (module.causal and not _softmax_in_c()) or attn_mask is not None
            or not 0 < s <= CPU_MATH_MAX_SEQ or qkv.device.type != "cpu" or qkv.dtype != torch.float32
            or not qkv.numel()):
        return False
    ours = module.attend is rope_attention and _rotates_ours(module.rope)  # not a subclass's or instance's own
    return ours and c_built() and _plain((qkv,))


def _heads(qkv: Tensor, h: int, hk: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, S, D), k and v (B, H_kv, S, D): strided views of the projection qkv (B, S, (H + 2 H_kv) D)."""
    b, s = qkv.shape[:2]
    return qkv.view(b, s, h + 2 * hk, d).transpose(1, 2).split([h, hk, hk], dim=1)


def _rotated(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """R(q) (B, H, S, D) and R(k) (B, H_kv, S, D), each pair's features made neighbours, rotated by
    the C pass from their strided views of the projection into tensors of their own; cos, sin as
    c_tables returns them."""
    return tuple(rotate_into(x, x.new_empty(x.shape), cos, sin, x_pairs=interleaved, out_pairs=True)  # contiguous
                 for x in (q, k))


class _ProjectedAttention(torch.autograd.Function):
    """softmax(R(q) R(k)^T / sqrt(D)) v over the heads of one projection, for RopeSelfAttention's
    training forward (module note): qkv (B, S, (H + 2 H_kv) D) -> (B, S, H D), the layout the
    output projection takes; the backward returns qkv's gradient in qkv's own layout. ``causal``:
    the softmax in causal rows (kernels._softmax), each query over its keys up to its position.

    Forward: q and k rotated by the C pass (pairs made neighbours) from their strided views into
    tensors of their own, scored by one batched matmul (the scale its alpha), turned into
    probabilities P in place, multiplied by v. Saved: qkv and P, what the unfused path keeps (its
    rotated q and k and v are qkv's size). Backward: q and k rotated again, dv = P^T do, dP = do
    v^T, dS = P (dP - rowsum(dP P)) (torch's softmax backward), dq = dS k / sqrt(D) and dk = dS^T
    q / sqrt(D) (the scale their alpha), rotated back by the C pass straight into their heads of
    qkv's gradient; autocast off, as in the forward. Differentiated again (create_graph), the
    backward recomputes the attention with the differentiable torch ops."""

    @staticmethod
    def forward(ctx, qkv: Tensor, rope: RotaryEmbedding, h: int, hk: int, causal: bool) -> Tensor:
        b, s, _ = qkv.shape
        d, g = rope.head_dim, h // hk
        n = b * hk  # kv heads; the g q heads of one are rows of one matmul (grouped-query attention)
        q, k, v = _heads(qkv, h, hk, d)
        cos, sin = c_tables(*rope.tables(q), s)
        rq, rk = _rotated(q, k, cos, sin, rope.interleaved)
        p = torch.baddbmm(qkv.new_empty(n, g * s, s), rq.view(n, g * s, d), rk.view(n, s, d).mT, beta=0,
                          alpha=d**-0.5)
        _softmax_(p, causal)
        out = torch.bmm(p, v.reshape(n, s, d))
        ctx.save_for_backward(qkv, p, cos, sin)
        ctx.rope, ctx.h, ctx.hk, ctx.causal = rope, h, hk, causal
        return out.view(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)

    @staticmethod
    def backward(ctx, grad: Tensor):
        qkv, p, cos, sin = ctx.saved_tensors
        rope, h, hk, causal = ctx.rope, ctx.h, ctx.hk, ctx.causal
        with torch.autocast("cpu", enabled=False):  # a backward run under autocast: the forward's dtypes
            if torch.is_grad_enabled():  # create_graph: the attention again, in differentiable torch ops
                # (SDPA's math backend where causal takes SDPA: its flash CPU backward has no derivative)
                with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
                    q, k, v = _heads(qkv, h, hk, rope.head_dim)
                    out = rope_attention(q, k, v, rope, causal=causal).transpose(1, 2).reshape(grad.shape)
                return torch.autograd.grad(out, qkv, grad, create_graph=True)[0], None, None, None, None
            b, s, _ = qkv.shape
            d, g, n = rope.head_dim, h // hk, b * hk
            q, k, v = _heads(qkv, h, hk, d)
            rq, rk = _rotated(q, k, cos, sin, rope.interleaved)
            do = grad.reshape(b, s, h, d).transpose(1, 2).reshape(n, g * s, d)
            dqkv = torch.empty_like(qkv)
            dq, dk, dv = _heads(dqkv, h, hk, d)  # views of the gradient, written in place
            dv.copy_(torch.bmm(p.mT, do).view(b, hk, s, d))
            dp = torch.bmm(do, v.reshape(n, s, d).mT)
            ds = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)
            scale = d**-0.5
            dq_ = torch.baddbmm(qkv.new_empty(n, g * s, d), ds, rk.view(n, s, d), beta=0, alpha=scale)
            dk_ = torch.baddbmm(qkv.new_empty(n, s, d), ds.mT, rq.view(n, g * s, d), beta=0, alpha=scale)
            for x, out in ((dq_, dq), (dk_, dk)):  # rotated back, into their heads of the gradient
                rotate_into(x.view(out.shape), out, cos, sin, x_pairs=True, out_pairs=rope.interleaved,
                            inverse=True)
        return dqkv, None, None, None, None


def check_module(dim: int, n_heads: int, n_kv_heads: int | None, causal: bool, bias: bool) -> int:
    """Refuse settings no RopeSelfAttention can have; returns n_kv_heads (default n_heads)."""
    checks.integer(dim, "dim", low=1)
    checks.integer(n_heads, "n_heads", low=1)
    n_kv_heads = n_heads if n_kv_heads is None else checks.integer(n_kv_heads, "n_kv_heads", low=1)
    checks.flag(causal, "causal")
    checks.flag(bias, "bias")
    if dim % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must divide dim ({dim}) and n_kv_heads ({n_kv_heads}) "
                         "must divide n_heads")
    return n_kv_heads


def check_module_input(x: Tensor, dim: int, weight: Tensor) -> None:
    """x must be (B, S, dim), floating, on the module's device."""
    checks.tensor(x, "x", ndim=3, floating=True, shape=f"(B, S, dim={dim})")
    if x.shape[-1] != dim:
        raise ValueError(f"x has {x.shape[-1]} features, the module was built for dim={dim}")
    checks.same_device({"x": x, "the module's weights": weight})


class RopeSelfAttention(nn.Module):
    """x (B, S, dim) -> (B, S, dim): qkv projection, RoPE attention over heads, output projection.

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention. S = 0 gives an empty output; NaN or
    inf in x propagate to the output, as in ``rope_attention``.
    """

    attend = staticmethod(rope_attention)
    rope_cls = RotaryEmbedding

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, max_seq_len: int = 2048,
                 base: float = 10000.0, interleaved: bool = False, causal: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        n_kv_heads = check_module(dim, n_heads, n_kv_heads, causal, bias)
        self.n_heads, self.n_kv_heads, self.head_dim, self.causal = n_heads, n_kv_heads, dim // n_heads, causal
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.rope = self.rope_cls(self.head_dim, max_seq_len, base, interleaved)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        check_module_input(x, self.proj.in_features, self.qkv.weight)
        b, s, dim = x.shape
        qkv = self.qkv(x)
        if _trains_fused(self, qkv, attn_mask):
            return self.proj(_ProjectedAttention.apply(qkv, self.rope, self.n_heads, self.n_kv_heads, self.causal))
        q, k, v = _heads(qkv, self.n_heads, self.n_kv_heads, self.head_dim)
        out = self.attend(q, k, v, self.rope, causal=self.causal, attn_mask=attn_mask)
        return self.proj(out.transpose(1, 2).reshape(b, s, dim))
