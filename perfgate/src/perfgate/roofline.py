"""The roofline: what one call must move and compute (``Work``), what this machine can move and
compute (``Limits``), and how close a row's time comes to the least the two allow (``Figure``).

A call's least time is ``max(bytes / stream, written / write rate, sum over dtypes of flops /
that dtype's GEMM peak)``: every input read once and every output written once at the streaming
bandwidth, the bytes written no faster than the machine has written, every FLOP at the GEMM
rate. A row's roofline percentage is that least time over its measured median.
docs/perfgate.md, "The roofline column", says how to read it and where the model is low.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import json
import math
import os
import statistics
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fingerprint import _cpuinfo_first
from .stats import PARTNER_IDLE_NS, fixed_width, roofline_cell
from .timing import available_memory, timer_for

LIMITS_FILE = "limits.json"  # in the fingerprint's storage folder, beside its sizes' baselines
LIMITS_VERSION = 1
# the counting rule's version, stored with every run's figures: raised whenever ``count_work``
# counts some call differently (the CHANGELOG says how), so a report can tell figures counted
# under an earlier rule from today's
COUNT_RULE = 7
# a limits file's rates (GB/s) and the threads' round trip (ns): each a positive number, or None
RATES = ("stream_gbps", "scale_gbps", "copy_gbps", "triad_gbps", "fill_gbps", "round_trip_ns")
# the sessions whose usual round trip a limits file keeps (``round_trip_sessions_ns``, newest last):
# their median is the placement the gate judges pairs against (docs/gate.md, "The threads' placement")
ROUND_TRIP_SESSIONS = 15
# and the histories kept so: that one, and the core's usual paces, whose median is a usual pace the
# gate judges pairs slowed against (docs/gate.md, "The core's pace")
SESSIONS = ("round_trip_sessions_ns", "pace_sessions_ns")
# bytes of an array of the stream passes at the least (2**25 float32): beyond most CPUs' last-level caches
STREAM_BYTES = 128 << 20
STREAM_RATES = ("stream_gbps", "scale_gbps", "copy_gbps", "triad_gbps", "fill_gbps")  # measured together


@dataclass(frozen=True)
class Work:
    """One call's least work: ``bytes`` (the elements it reads of tensors that existed before it,
    once; the elements it returns or writes in place, once), ``written`` (those it returns or
    writes in place, a part of ``bytes``) and ``flops`` by dtype name, as
    ``torch.utils.flop_counter`` counts them (matmuls, convolutions, attention); a complex op's
    count, which the counter makes as a real op's, is 4x that in its real dtype (complex64: float32)."""

    bytes: float
    flops: dict[str, float] = field(default_factory=dict)
    written: float = 0.0

    @property
    def total_flops(self) -> float:
        return float(sum(self.flops.values()))


def _storage(t: Any) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage, None for one without (a meta or sparse tensor)."""
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.data_ptr() else None
    except (RuntimeError, NotImplementedError):
        return None


@dataclass(frozen=True)
class _Span:
    """The bytes of its storage (keyed by ``_Traffic.key``) one tensor views: ``start`` to ``end``
    (its first and one past its last element), ``nbytes`` its elements' bytes (fewer than the span
    when strided, with gaps; more when elements repeat, as a broadcast's do), ``solid`` whether its
    elements leave no byte of the span out."""

    start: int
    end: int
    nbytes: int
    key: tuple  # offset, shape, strides and element size: one entry per distinct view
    solid: bool = True


def _fills(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a view's elements reach every element of its span: its dims by stride, smallest
    first (a broadcast's stride-0 dims and single ones reach nothing), each stepping at most one
    past what the dims before it reach together."""
    reach = 0  # the offsets reached so far: 0 to reach, every one
    for stride, n in sorted((stride, n) for n, stride in zip(shape, strides, strict=True) if n > 1 and stride > 0):
        if stride > reach + 1:
            return False
        reach += (n - 1) * stride
    return True


def _span(t: Any) -> _Span | None:
    """``t``'s span in its storage; None for an empty tensor or one without a storage."""
    where = _storage(t) if hasattr(t, "untyped_storage") else None
    if where is None or t.numel() == 0:
        return None
    size, shape, strides = t.element_size(), tuple(t.shape), tuple(t.stride())
    start = t.storage_offset() * size
    last = sum((n - 1) * stride for n, stride in zip(shape, strides, strict=True))  # strides >= 0
    key = (start, shape, strides, size)
    return _Span(start, start + (last + 1) * size, t.numel() * size, key, _fills(shape, strides))


class _Views:
    """The distinct views of one storage a call touched. Their bytes: the union of their spans, or
    the sum of their elements' bytes where that is less (strided views with gaps, broadcasts)."""

    def __init__(self) -> None:
        self.spans: dict[tuple, _Span] = {}

    def add(self, span: _Span) -> None:
        self.spans.setdefault(span.key, span)

    def _union(self, solid: bool = False) -> list[tuple[int, int]]:
        """The union of the views' spans, as (start, end) runs; ``solid``: of the views whose
        elements fill their span (not a strided view's, with gaps between its elements)."""
        merged: list[list[int]] = []
        spans = [s for s in self.spans.values() if not solid or s.solid]
        for s in sorted(spans, key=lambda s: s.start):
            if merged and s.start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], s.end)
            else:
                merged.append([s.start, s.end])
        return [(a, b) for a, b in merged]

    def covers(self, span: _Span) -> bool:
        """Whether these views hold every byte of ``span``: one is the same view, or views that fill
        their spans do."""
        return span.key in self.spans or any(a <= span.start and span.end <= b for a, b in self._union(solid=True))

    def outside(self, span: _Span) -> list[_Span]:
        """The pieces of ``span`` these views do not hold: a view that fills its span, less the
        runs of views that fill theirs; a strided one whole unless ``covers`` it."""
        if not span.solid:
            return [] if self.covers(span) else [span]
        pieces, at = [], span.start
        for a, b in self._union(solid=True):
            if a > at and at < span.end:
                pieces.append((at, min(a, span.end)))
            at = max(at, b)
        if at < span.end:
            pieces.append((at, span.end))
        return [_Span(a, b, b - a, (a, b, "piece")) for a, b in pieces]

    def bytes(self) -> int:
        return min(sum(b - a for a, b in self._union()), sum(s.nbytes for s in self.spans.values()))


def _extra_flops() -> dict[Any, Callable[..., float]]:
    """FLOP formulae for ops torch's flop counter lacks: the CPU flash attention forward and
    backward count as the CUDA ones do (``sdpa_flop_count``, every score, causal or not)."""
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    extra: dict[Any, Callable[..., float]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu] = (
            lambda q, k, v, *a, out_val=None, **kw: fc.sdpa_flop_count(q.shape, k.shape, v.shape))
        extra[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            lambda g, q, k, v, *a, out_val=None, **kw:
            fc.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
    return extra


def _written(func: Any, args: tuple, kwargs: dict) -> tuple[set[int], set[int]]:
    """The ids of the tensors an op writes, and of those it writes without reading them first
    (an ``out=`` argument, the first argument of copy_, fill_ or zero_). torch's fused optimizer
    steps (``_fused_sgd_``, ``_fused_adamw_``, ...) mark their grads as written but write them only
    to unscale them, given a ``grad_scale``: without one the grads count as read."""
    import torch

    overwrites = {torch.ops.aten.copy_, torch.ops.aten.fill_, torch.ops.aten.zero_}
    schema = func._schema.arguments

    def value_of(i: int) -> Any:
        return args[i] if i < len(args) else kwargs.get(schema[i].name)

    scale = next((value_of(i) for i, arg in enumerate(schema) if arg.name == "grad_scale"), None)
    unscales = not func._overloadpacket.__name__.startswith("_fused_") or scale is not None
    def tensors(i: int) -> list:
        value = value_of(i)
        return [t for t in (value if isinstance(value, (list, tuple)) else [value])  # a _foreach_ op's lists
                if isinstance(t, torch.Tensor)]

    writes, pure = set(), set()
    written = [i for i, arg in enumerate(schema) if arg.alias_info is not None and arg.alias_info.is_write
               and not (arg.name == "grads" and not unscales)]
    # an out= whose storage the op also reads (torch.add(a, b, out=a)) is read before it is written
    read = {_storage(t) for i in range(len(schema)) if i not in written for t in tensors(i)} - {None}
    for i in written:
        overwrite = schema[i].is_out or (i == 0 and func._overloadpacket in overwrites)
        for t in tensors(i):
            writes.add(id(t))
            if overwrite and _storage(t) not in read:
                pure.add(id(t))
    return writes, pure


def _version(t: Any) -> int | None:
    """A tensor's version counter (raised by each write in place), None for one without (an
    inference tensor)."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):
        return None


@dataclass
class _HandedOut:
    """A tensor handed to ``.numpy()`` during a count: its view, the version last seen, whether an
    op wrote its storage since, and whether its version rose with no op writing it."""

    tensor: Any
    span: _Span
    seen: int | None
    op_wrote: bool = False
    raised: bool = False


class _Traffic:
    """What one call's ops read, wrote and made, by storage, and their FLOPs by dtype. A storage is
    keyed by its address and how many storages the call saw there died before it (``key``): an
    allocation that reuses a freed one's address (numpy's, a C library's, made outside the
    dispatcher) is another storage, whatever the first one's bytes counted as."""

    Key = tuple[int, int]  # (address, generation)

    def __init__(self) -> None:
        self.read: dict[_Traffic.Key, _Views] = {}  # storages that existed before the call: the views read
        self.written: dict[_Traffic.Key, _Views] = {}  # of those, the views written in place
        self.made: dict[_Traffic.Key, _Views] = {}  # of those, the views overwritten (read after: the call's own)
        self.fresh: set[_Traffic.Key] = set()  # storages the call allocated
        self.outside: dict[_Traffic.Key, _Views] = {}  # of those, the views handed to .numpy()
        self.handed: dict[_Traffic.Key, list[_HandedOut]] = {}  # of those, each tensor handed to .numpy()
        self.flops: dict[str, float] = {}
        self.generation: dict[int, int] = {}  # address -> storages seen there that died
        self.alive: dict[_Traffic.Key, list[weakref.ref]] = {}  # the storage objects of each key still alive

    def key(self, t: Any) -> _Traffic.Key | None:
        """The key of a tensor's storage (or of a storage), None for one without (meta, sparse,
        empty). Its storage object is watched: when the last one at a key dies, the address's
        next storage takes the next generation. torch keeps one Python object per storage
        (``t.untyped_storage() is t.untyped_storage()``), which dies with the storage itself. The
        object's life is not always its memory's: a buffer no torch allocator owns (numpy's under
        ``from_numpy``) wrapped again after its first tensor died counts as another storage, and
        a storage resized in place (``resize_``: its memory freed, the object kept) keeps its
        address's key while the object lives."""
        try:
            storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        if not address:
            return None
        key = (address, self.generation.get(address, 0))
        refs = self.alive.setdefault(key, [])
        if not any(r() is storage for r in refs):
            refs.append(weakref.ref(storage, lambda ref, key=key: self._died(key, ref)))
        return key

    def spanned(self, t: Any) -> tuple[_Span | None, _Traffic.Key | None]:
        """``t``'s span and its storage's key; (None, None) for an empty tensor or one without storage."""
        span = _span(t)
        return (span, self.key(t)) if span is not None else (None, None)

    def _died(self, key: _Traffic.Key, ref: weakref.ref) -> None:
        refs = self.alive.get(key, [])
        if ref in refs:
            refs.remove(ref)
            if not refs and self.generation.get(key[0], 0) == key[1]:
                self.generation[key[0]] = key[1] + 1

    def note_inputs(self, tensors: list, writes: set[int], pure: set[int]) -> None:
        for t in tensors:
            span, key = self.spanned(t)
            if key is None or key in self.fresh:
                continue
            made = self.made.get(key)
            if made is not None and made.covers(span):  # the call's own data by now
                continue
            if id(t) in pure:  # overwritten: the call's own data from here on (what was read before stays read)
                self.made.setdefault(key, _Views()).add(span)
            else:  # read: what of it the call has not overwritten yet
                for piece in made.outside(span) if made is not None else [span]:
                    self.read.setdefault(key, _Views()).add(piece)
            if id(t) in writes:
                self.written.setdefault(key, _Views()).add(span)

    def note_outside(self, t: Any) -> None:
        """``t`` handed to code outside the dispatcher (``Tensor.numpy()``: a C pass, a peer's
        numpy), which reads it or writes it (``read_outside`` counts it at the call's end)."""
        span, key = self.spanned(t)
        if key is not None and key not in self.fresh:
            self.outside.setdefault(key, _Views()).add(span)
            handed = self.handed.setdefault(key, [])
            if not any(h.tensor is t and h.span.key == span.key for h in handed):  # handed again: one record
                handed.append(_HandedOut(t, span, _version(t)))

    def check_versions(self) -> None:
        """Before each op, each ``increment_version`` outside torch and at the call's end: a
        tensor handed out whose version rose since the last look, with no op writing its storage
        in between, was written outside the dispatcher (a C pass raises it to say so,
        ``torch.autograd.graph.increment_version``; torch raises it after an op returns, so an
        op's own rise is seen at the next look, at the latest at the pass's own raise)."""
        for handed in self.handed.values():
            for h in handed:
                now = _version(h.tensor)
                if h.seen is not None and now is not None and now > h.seen and not h.op_wrote:
                    h.raised = True
                h.seen, h.op_wrote = now, False

    def note_written(self, keys: list[_Traffic.Key | None]) -> None:
        """An op wrote these storages (their keys taken before it ran: ``set_`` and ``resize_``
        move a tensor to other memory): a rise in their tensors' versions is the op's."""
        for key in keys:
            for h in self.handed.get(key, []):
                h.op_wrote = True

    def read_outside(self) -> None:
        """Count what was handed to ``.numpy()`` as read, beside whatever ops read of the same
        storage (a C pass over all of x, an op on its first row: x once), unless ops wrote all of
        it: then the array was a C pass's output, or a look at its pages before an op wrote it,
        and the op's write counts. A view whose tensor's version a C pass raised
        (``check_versions``) counts as written instead: the C pass's output. The views of one
        storage share a version, so one a C pass read beside another it wrote counts as written
        too; an inference tensor has no version, and counts as read."""
        self.check_versions()
        for key, views in self.outside.items():
            wrote = _Views()
            for done in (self.written.get(key), self.made.get(key)):
                wrote.spans.update(done.spans if done is not None else {})
            raised = {h.span.key for h in self.handed.get(key, []) if h.raised}
            for span in views.spans.values():
                if not wrote.covers(span):
                    (self.written if span.key in raised else self.read).setdefault(key, _Views()).add(span)

    def note_cloned(self, storage: Any) -> None:
        """``storage``, a copy a storage's ``clone`` (a ``copy.deepcopy``'s) allocated outside the
        dispatcher, is the call's own: the copy into it that the clone's ops showed as a write
        into existing storage is forgotten (the source's read stays)."""
        key = self.key(storage)
        if key is not None:
            for seen in (self.read, self.written, self.made):
                seen.pop(key, None)
            self.fresh.add(key)

    def note_outputs(self, values: list, given: set[int]) -> None:
        """Note the storages an op made: its outputs' storages other than ``given``, the storages
        its inputs had before it ran and those it took as objects (an in-place op returns its
        input, even an empty view of it; ``set_`` hands its tensor a storage it did not make:
        existing storage, or a clone's, which ``note_cloned`` makes the call's own)."""
        for t in values:
            where = _storage(t) if hasattr(t, "untyped_storage") else None
            key = None if where is None or where[0] in given else self.key(t)
            if key is not None and not any(key in seen for seen in (self.read, self.written, self.made)):
                self.fresh.add(key)


def _counter() -> Any:
    """A ``TorchDispatchMode`` that sees every op one call makes (made here: torch loads on use)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    formulae = {**flop_registry, **_extra_flops()}
    unsafe_views = {torch.ops.aten._unsafe_view.default}  # a view whose schema does not say so

    class Counter(TorchDispatchMode, _Traffic):
        def __init__(self) -> None:
            TorchDispatchMode.__init__(self)
            _Traffic.__init__(self)

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            formula = formulae.get(func._overloadpacket)
            if formula is None:
                # a composite op (under inference_mode matmul, linear, einsum and SDPA arrive whole,
                # not as their mm and bmm): counted as the ops it is made of, as FlopCounterMode does
                with self:
                    decomposed = func.decompose(*args, **kwargs)
                if decomposed is not NotImplemented:
                    return decomposed
            if func.is_view or func in unsafe_views:  # a view moves nothing: what reads it counts
                return func(*args, **kwargs)
            leaves = tree_flatten((args, kwargs))[0]
            flat = [t for t in leaves if isinstance(t, torch.Tensor)]
            # the storages the op's inputs hold before it runs, and those it takes as objects (set_'s)
            given = {s.data_ptr() for s in leaves if isinstance(s, torch.UntypedStorage) and s.data_ptr()}
            given |= {where[0] for t in flat if (where := _storage(t)) is not None}
            if self.handed:  # a rise since the last op that no op made: a C pass wrote
                self.check_versions()
            writes, pure = _written(func, args, kwargs)
            self.note_inputs(flat, writes, pure)
            wrote = [self.key(t) for t in flat if id(t) in writes] if self.handed else []
            out = func(*args, **kwargs)
            self.note_written(wrote)
            kind = None if formula is None else next(
                (t.dtype for t in flat if t.is_floating_point() or t.is_complex()), None)
            if kind is not None:  # a counted op in floating point: an integer matmul has no GEMM peak
                flops = float(formula(*args, **kwargs, out_val=out))
                if kind.is_complex:  # counted as a real op's; a complex multiply-add is 4 real ones
                    kind, flops = kind.to_real(), 4 * flops
                dtype = str(kind).removeprefix("torch.")
                self.flops[dtype] = self.flops.get(dtype, 0.0) + flops
            self.note_outputs(tree_flatten(out)[0], given)
            return out

    return Counter()


def count_work(fn: Callable[..., Any], setup: Callable[[], Any] | None = None) -> Work:
    """``Work`` of one call of ``fn()`` (or ``fn(setup())``, the setup not counted): the call runs
    once under a dispatch mode that sees each op's tensors. Per storage, the views an op reads or
    writes count once each, as the union of their spans (a slice of a cache: the slice; two
    halves: the whole). A tensor handed to ``.numpy()`` during the call (a C pass, a peer's numpy)
    counts as read, its own elements, unless ops wrote all of it, or its version rose with no op
    writing it in between (a C pass's output: written; ``_Traffic.read_outside``). What
    it returns that it made counts as written; an input returned as is does not; a storage's clone
    (``copy.deepcopy``'s) is made. A ``torch.compile``'d function is counted by the ops its Python
    runs (compiled code is skipped)."""
    import torch
    from torch.utils._pytree import tree_flatten

    args = () if setup is None else (setup(),)
    counter = _counter()
    # a C pass or a peer reads a tensor through .numpy() (np.asarray calls it too), which no
    # dispatch mode sees: each such tensor is noted while the call runs
    numpy, own = torch.Tensor.numpy, "numpy" in vars(torch.Tensor)

    def noted(t: Any, *a: Any, **kw: Any) -> Any:
        counter.note_outside(t)
        return numpy(t, *a, **kw)

    # a storage's clone (a copy.deepcopy's) allocates its copy outside the dispatcher, then fills
    # it with ops that show a write into storage that existed before: the copy is noted as made
    storage_base, clone = torch.storage._StorageBase, torch.storage._StorageBase.clone

    def cloned(storage: Any) -> Any:
        made = clone(storage)
        counter.note_cloned(made)
        return made

    # a C pass says it wrote a tensor by raising its version: what rose before (an op's write of
    # the same storage just before the pass) is looked at first, so that the pass's rise is its own;
    # torch's own raise (a custom op's, before its kernel runs) is the op's, noted as an op's write
    graph, bump = torch.autograd.graph, torch.autograd.graph.increment_version

    def bumped(tensor: Any) -> None:
        if not counter.handed:
            return bump(tensor)
        tensors = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
        torch_own = sys._getframe(1).f_globals.get("__name__", "").startswith("torch.")
        if not torch_own:
            counter.check_versions()
        bump(tensors)
        if torch_own:
            counter.note_written([counter.key(t) for t in tensors])

    torch.Tensor.numpy, storage_base.clone, graph.increment_version = noted, cloned, bumped
    try:
        # a torch.compile'd call runs its Python eagerly for the count: inductor's kernels are no
        # ops a dispatch mode sees, and the least work is the function's, however it is compiled
        # (torch before 2.6 has no stance: a compiled optimizer step there counts nothing)
        stance = getattr(torch.compiler, "set_stance", None)
        with counter, stance("force_eager") if stance else contextlib.nullcontext():
            result = fn(*args)
        counter.read_outside()
        outputs: dict[_Traffic.Key, _Views] = {}
        for t in tree_flatten(result)[0]:
            span, key = counter.spanned(t)
            if key is not None and key in counter.fresh:
                outputs.setdefault(key, _Views()).add(span)
    finally:
        counter.alive.clear()  # its watches end with the count, failed or not (each calls back into the counter)
        counter.handed.clear()  # and the tensors handed out, which it held
        storage_base.clone, graph.increment_version = clone, bump
        if own:
            torch.Tensor.numpy = numpy
        else:
            del torch.Tensor.numpy
    written = sum(v.bytes() for views in (counter.written, outputs) for v in views.values())
    moved = written + sum(v.bytes() for v in counter.read.values())
    return Work(bytes=float(moved), flops=dict(counter.flops), written=float(written))


@dataclass(frozen=True)
class Figure:
    """A row's place under the roofline: ``fraction`` of the least time it could take,
    ``bound`` (the largest term: "memory", the bytes at the stream bandwidth; "write", the bytes
    written at the write rate; "compute"), and what it achieved."""

    fraction: float
    bound: str
    gbps: float
    gflops: float | None  # None: no FLOP counted (a kernel the model places by its bytes)


class BadLimits(ValueError):
    """A stored limits file that is not one perfgate wrote for this fingerprint."""


class Limits:
    """This machine's streaming bandwidth and GEMM peaks at the session's threads, each measured
    the first time a row needs it and kept in ``path`` (JSON; re-measured with ``remeasure``).
    A limit is the best this machine has shown: measured again when a call passes it
    (``recheck``), it keeps the higher value."""

    def __init__(self, device: str, slug: str, path: Path | None, remeasure: bool = False) -> None:
        self.device, self.slug, self.path = device, slug, path
        self.values: dict[str, Any] = {"version": LIMITS_VERSION, "slug": slug, "device": device,
                                       "stream_gbps": None, "scale_gbps": None, "copy_gbps": None,
                                       "triad_gbps": None, "fill_gbps": None, "gemm_gflops": {}, "gemm_n": {},
                                       "measured": {}}
        self.dirty = False
        self.rechecked: set[str] = set()  # the limits measured this session ("stream", a dtype)
        # this session's own reading of the stream and write rates, GB/s (``read_now``), or None
        self.now: dict[str, Any] | None = None
        # the stream passes' array size, decided once a session (the memory cap moves with the minute)
        self.stream_bytes = stream_bytes(device)
        if path is not None and path.is_file() and not remeasure:
            self.values = read_limits(path, slug)
            if 2 * self.values.get("stream_bytes", STREAM_BYTES) <= self.stream_bytes:
                # measured over arrays no larger than half this session's (128 MiB where a 300 MiB
                # last-level cache wants 600): the cache could serve them in part, measured again
                self.values.update(dict.fromkeys(STREAM_RATES))

    @property
    def stream_gbps(self) -> float:
        """The best of an in-place scale, a copy and a triad over arrays past the last-level cache
        (``stream_bytes``), GB/s, each array counted once read and once written, as STREAM counts them.
        A write to another array also reads its lines in first (write-allocate), traffic STREAM
        does not count: the in-place scale, which has none, is the one that reaches the memory's
        limit."""
        if self.values["stream_gbps"] is None:
            self._measure_stream()
        return float(self.values["stream_gbps"])

    @property
    def write_gbps(self) -> float:
        """The write rate, GB/s: the fastest this machine has written, alone or beside reads
        (``write_rate``)."""
        if self.values["fill_gbps"] is None:
            self._measure_stream()
        return float(write_rate(self.values))

    def peak(self, dtype: str) -> float:
        """The best GEMM rate in ``dtype``, GFLOP/s (square matrices, grown until one product
        takes 50 ms)."""
        if dtype not in self.values["gemm_gflops"]:
            self._measure_gemm(dtype)
        return float(self.values["gemm_gflops"][dtype])

    def _measure_stream(self, reading: bool = False) -> list[str]:
        """Measure the stream rates, each kept where it beats the stored one, and keep what they
        read as this session's (``now``). A ``reading`` (``read_now``) changes the limits (and the
        file) only where the stream or the write rate rose. Returns the limits that rose, in words."""
        before = _two_rates(self.values)
        nbytes = self.stream_bytes
        rates = _stream(self.device, nbytes)
        rates["stream"] = max(v for k, v in rates.items() if k != "fill")  # fill writes only: shown beside it
        read = {f"{kind}_gbps": rate for kind, rate in rates.items()}
        self.now = {"stream_gbps": read["stream_gbps"], "write_gbps": write_rate(read), "measured": _now()}
        best = {**self.values, **{key: rate if self.values.get(key) is None else max(self.values[key], rate)
                                  for key, rate in read.items()}}
        after = _two_rates(best)
        rose = [f"{name} {was:.1f} -> {after[name]:.1f} GB/s" for name, was in before.items()
                if was is not None and after[name] > was]
        if rose or not reading or None in before.values():
            self.values.update(best, stream_bytes=nbytes)
            self.values["measured"]["stream"] = self.now["measured"]
            self.dirty = True
        self.rechecked.add("stream")  # measured this session: nothing for recheck to do
        return rose

    def read_now(self) -> list[str]:
        """This session's reading of the stream and write rates (``now``), taken once after its rows
        unless the session measured them already: the stored limits are the best this machine has
        shown, and on a host whose neighbours share its memory the rate of the minute can sit far
        under them. A reading past a stored limit raises it. Returns the limits that rose, in words."""
        return [] if "stream" in self.rechecked else self._measure_stream(reading=True)

    def _measure_gemm(self, dtype: str) -> None:
        """Measure ``dtype``'s GEMM peak, kept where it beats the stored one."""
        gflops, n = _gemm(self.device, dtype)
        if gflops > self.values["gemm_gflops"].get(dtype, 0.0):
            self.values["gemm_gflops"][dtype], self.values["gemm_n"][dtype] = gflops, n
        self.values["measured"][f"gemm {dtype}"] = _now()
        self.rechecked.add(dtype)
        self.dirty = True

    def recheck(self, calls: list[tuple[Work, float]]) -> list[str]:
        """Measure again each stored limit one of ``calls`` (work, seconds a call) passed, unless
        this session measured it already:
        a figure over 100% says the limit was measured while the host was busier (neighbours
        share a VM host's memory bandwidth and cores). Returns each limit that rose, in words; a
        call still over 100% after it is served from caches or counted high (docs/perfgate.md)."""
        rose = []
        for work, seconds in calls:
            figure = self.figure(work, seconds)
            if figure is None or figure.fraction <= 1.0:
                continue
            if figure.bound in ("memory", "write") and "stream" not in self.rechecked:
                rose += self._measure_stream()  # the stream and the write rate are measured together
            for dtype in [d for d, f in work.flops.items() if f > 0] if figure.bound == "compute" else []:
                if dtype not in self.rechecked:
                    self.rechecked.add(dtype)
                    before = self.peak(dtype)
                    self._measure_gemm(dtype)
                    if self.peak(dtype) > before:
                        rose.append(f"{dtype} GEMM {before:.1f} -> {self.peak(dtype):.1f} GFLOP/s")
        return rose

    @property
    def round_trip_ns(self) -> float | None:
        """The nearest placement of torch's threads this machine has shown: the least cache-line
        round trip between them (``timing.RoundTrip``), ns; None where never read."""
        return self.values.get("round_trip_ns")

    @property
    def round_trip_history(self) -> list[float]:
        """The stored sessions' usual round trips, ns (``note_usual_round_trip``), oldest first; the
        nearest alone where a file from before them stores only that; [] where none is stored."""
        return self.values.get("round_trip_sessions_ns") or (
            [self.round_trip_ns] if self.round_trip_ns is not None else [])

    def note_usual_round_trip(self, readings: list[float]) -> None:
        """Add this session's usual reading (the lower quartile of its ``readings``) to the stored
        sessions', the last ``ROUND_TRIP_SESSIONS`` kept; like ``note_round_trip``, it joins a
        limits file and makes none on its own."""
        self._note_session("round_trip_sessions_ns", session_round_trip(readings))

    @property
    def pace_history(self) -> list[float]:
        """The stored sessions' usual paces of the core, ns (``note_usual_pace``), oldest first."""
        return self.values.get("pace_sessions_ns") or []

    def note_usual_pace(self, readings: list[float]) -> None:
        """Add this session's usual pace (the lower quartile of ``readings``: its scans of the
        fastest CPU, else its pairs' readings; ``timing.Pace``) to the stored sessions', as
        ``note_usual_round_trip`` does."""
        self._note_session("pace_sessions_ns", session_pace(readings))

    def _note_session(self, key: str, usual: float | None) -> None:
        """Append ``usual`` to the history ``key``, its last ``ROUND_TRIP_SESSIONS`` kept."""
        if usual is None:
            return
        history = self.values.get(key) or []
        self.values[key] = [*history, usual][-ROUND_TRIP_SESSIONS:]
        self.dirty = self.dirty or (self.path is not None and self.path.is_file())

    def note_round_trip(self, ns: float) -> None:
        """Keep ``ns``, a session's least round trip, where it is nearer than the stored one. It
        joins a limits file that is stored or written this session, and makes none on its own (a
        session whose rows count no work leaves the storage as it was)."""
        if math.isfinite(ns) and ns > 0 and (self.round_trip_ns is None or ns < self.round_trip_ns):
            self.values["round_trip_ns"] = ns
            self.values["measured"]["round trip"] = _now()
            self.dirty = self.dirty or (self.path is not None and self.path.is_file())

    def figure(self, work: Work, seconds: float) -> Figure | None:
        """Where a call of ``work`` taking ``seconds`` sits under this machine's roofline."""
        if seconds <= 0 or (work.bytes <= 0 and work.total_flops <= 0):
            return None
        # the write rate first (measured here where a file has none), then the bytes at the best rate
        # the machine has moved them: the stream's, or a streamed fill's where writes alone went
        # faster than an in-place scale's reads and writes (a call that writes nothing needs no
        # write rate measured: the stream's then)
        written = work.written / (self.write_gbps * 1e9) if work.written > 0 else 0.0
        moved = max(self.stream_gbps, write_rate(self.values) or 0.0)
        terms = {"memory": work.bytes / (moved * 1e9),
                 "write": written,
                 "compute": sum(f / (self.peak(d) * 1e9) for d, f in work.flops.items() if f > 0)}
        bound = max(terms, key=terms.__getitem__)  # the first of equal terms: memory before write before compute
        return Figure(fraction=terms[bound] / seconds, bound=bound,
                      gbps=work.bytes / seconds / 1e9,
                      gflops=work.total_flops / seconds / 1e9 if work.total_flops > 0 else None)

    def save(self) -> None:
        """Write what was measured this session (nothing when nothing new was)."""
        if self.dirty and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # written beside it, then renamed over it: a session killed mid-write, or two of one
            # fingerprint at once, never leave a half-written file the next session refuses
            part = self.path.with_name(f"{self.path.name}.{os.getpid()}.part")
            part.write_text(json.dumps(self.values, indent=1, sort_keys=True) + "\n", encoding="utf8")
            os.replace(part, self.path)
            self.dirty = False

    def line(self) -> str:
        """The limits measured so far, in words."""
        return limits_line(self.values)


def _placed(readings: list[float]) -> list[float]:
    """The round-trip readings that are placements: positive, at most ``stats.PARTNER_IDLE_NS``."""
    return [r for r in readings if 0 < r <= PARTNER_IDLE_NS]


def usual_round_trip(history: list[float], readings: list[float]) -> float | None:
    """The usual placement's round trip, ns: the median of the machine's stored sessions
    (``history``), else the least of this session's ``readings``, the cautious guess (a pair judged
    apart is left unresolved, never failed); None where neither has one."""
    if history:
        return float(statistics.median(history))
    return min(_placed(readings), default=None)


def session_round_trip(readings: list[float]) -> float | None:
    """A session's usual placement, ns: the lower quartile of its round-trip readings that are
    placements (finite, at most ``stats.PARTNER_IDLE_NS``); None where there are none."""
    return _lower_quartile(_placed(readings))


def usual_pace(history: list[float], scans: list[float], readings: list[float]) -> float | None:
    """The core's usual pace, ns (``timing.Pace``): the fastest of the median of the machine's
    stored sessions (``history``), the fastest CPU this session found (``scans``, ``Pace.scan``)
    and this session's own pairs' (``session_pace``), so a session whose pairs all ran on a slowed
    core is told by the others; None where none has one."""
    known = ([float(statistics.median(history))] if history else []) + [s for s in scans if 0 < s < math.inf]
    own = session_pace(readings)
    return min([*known, *([own] if own is not None else [])], default=None)


def session_pace(readings: list[float]) -> float | None:
    """A session's usual pace, ns: the lower quartile of its finite, positive pace readings (a
    host that slows a core for a minority of the session's pairs leaves its pace as usual);
    None where there are none."""
    return _lower_quartile([r for r in readings if 0 < r < math.inf])


def _lower_quartile(values: list[float]) -> float | None:
    if len(values) < 2:  # quantiles need two points
        return values[0] if values else None
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def write_rate(values: dict[str, Any]) -> float | None:
    """The fastest a limits file shows this machine writing, GB/s: a fill's rate (writes alone),
    or the written share of a stream pass (half an in-place scale's or a copy's, a third of a
    triad's), which reads beside it and may be measured at a quieter time; None before any."""
    shares = {"fill_gbps": 1, "scale_gbps": 2, "copy_gbps": 2, "triad_gbps": 3}
    rates = [values[k] / n for k, n in shares.items() if values.get(k) is not None]
    return max(rates) if values.get("fill_gbps") is not None else None


def limits_line(values: dict[str, Any]) -> str:
    """A limits file's figures in words: "stream 34.1 GB/s, float32 GEMM 134.4 GFLOP/s"."""
    if values.get("stream_gbps") is None:
        return "no limits measured"
    peaks = ", ".join(f"{d} GEMM {g:.1f} GFLOP/s" for d, g in sorted(values.get("gemm_gflops", {}).items()))
    fill = f" (writes {write_rate(values):.1f})" if values.get("fill_gbps") else ""
    usual = values.get("round_trip_sessions_ns")
    usual = f" (usual {statistics.median(usual):.0f})" if usual else ""
    near = f", threads' round trip {values['round_trip_ns']:.0f} ns{usual}" if values.get("round_trip_ns") else ""
    return f"stream {values['stream_gbps']:.1f} GB/s{fill}" + (f", {peaks}" if peaks else "") + near


def _two_rates(values: dict[str, Any]) -> dict[str, float | None]:
    """The two rates a figure reads of a limits file: the stream and the write rate, GB/s."""
    return {"stream": values["stream_gbps"], "write rate": write_rate(values)}


def _positive(v: Any) -> bool:
    """Whether ``v`` is a rate: a finite positive number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def now_line(values: dict[str, Any], now: dict[str, Any] | None) -> str | None:
    """A session's own reading (``Limits.now``) against the limits ``values``, in words, where it
    read under them: "this session's host, read after its rows: stream 41.0 GB/s (writes 24.9),
    69% and 57% of the limits"; None where there is none or it reached them."""
    if not (isinstance(now, dict) and _positive(now.get("stream_gbps")) and _positive(values.get("stream_gbps"))):
        return None
    shares = [now["stream_gbps"] / values["stream_gbps"]]
    wrote = _positive(now.get("write_gbps")) and _positive(write_rate(values))
    shares += [now["write_gbps"] / write_rate(values)] if wrote else []
    if min(shares) >= 1.0:
        return None
    writes = f" (writes {now['write_gbps']:.1f})" if wrote else ""
    of = " and ".join(f"{math.floor(100 * share)}%" for share in shares)  # under the limit: never "100%"
    return (f"this session's host, read after its rows: stream {now['stream_gbps']:.1f} GB/s{writes}, {of} of "
            f"the limit{'s' if wrote else ''}")


def read_limits(path: Path, slug: str) -> dict[str, Any]:
    """A stored limits file, checked: JSON perfgate wrote, for the fingerprint ``slug``."""
    try:
        values = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError) as exc:
        raise BadLimits(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(values, dict) or values.get("version") != LIMITS_VERSION or values.get("slug") != slug:
        raise BadLimits(f"{path}: not perfgate's limits (version {LIMITS_VERSION}) of fingerprint {slug}")
    for key in ("gemm_gflops", "gemm_n", "measured"):  # a table by dtype (or limit): missing is none measured
        if not isinstance(values.setdefault(key, {}), dict):
            raise BadLimits(f"{path}: {key} is not a table: {values[key]!r}")
    nbytes = values.get("stream_bytes", STREAM_BYTES)  # missing: an older file, measured over 128 MiB arrays
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise BadLimits(f"{path}: stream_bytes is not a positive whole number of bytes: {nbytes!r}")
    rates = {key: values.setdefault(key, None) for key in RATES}  # missing: measured when a row needs it
    rates.update({f"{dtype} GEMM": v for dtype, v in values["gemm_gflops"].items()})
    bad = {}
    for key in SESSIONS:  # missing: no session stored yet; each one stored is a reading (never null)
        sessions = values.setdefault(key, [])
        if not isinstance(sessions, list):
            raise BadLimits(f"{path}: {key} is not a list: {sessions!r}")
        bad.update({f"{key}[{i}]": v for i, v in enumerate(sessions) if not _positive(v)})
    bad.update({k: v for k, v in rates.items() if v is not None and not _positive(v)})
    if bad:
        raise BadLimits(f"{path}: a limit is not a positive number: {bad}")
    return values


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _best(fn: Callable[[], Any], device: str, calls: int = 5) -> float:
    """The fastest of ``calls`` timed calls after a warming one, with the session's timer."""
    return min(timer_for(device).block((fn, None), calls))


@functools.cache
def last_level_cache() -> int:
    """Bytes of the cache /proc/cpuinfo names for its first processor (``cache size``): the
    last-level cache on Intel, the per-core L2 on AMD (whose 32 MiB L3 a core complex the 128 MiB
    arrays pass anyway); 0 where it names none (another OS)."""
    size = _cpuinfo_first().get("cache size", "").split()
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    if len(size) == 2 and size[0].isdigit() and size[1] in units:
        return int(size[0]) * units[size[1]]
    return 0


def stream_bytes(device: str) -> int:
    """Bytes of an array of the stream passes: STREAM_BYTES, or on a CPU twice its last-level cache
    (``last_level_cache``) where that is larger (a VM guest may report its host socket's whole L3,
    300-480 MiB, which serves 128 MiB arrays in part), at most a sixth of the available memory (a
    triad's three arrays in half of it); whole MiB."""
    if device != "cpu":
        return STREAM_BYTES
    nbytes = max(STREAM_BYTES, 2 * last_level_cache())
    available = available_memory()
    if available is not None:
        nbytes = max(STREAM_BYTES, min(nbytes, available // 6))
    return nbytes >> 20 << 20


def _stream(device: str, nbytes: int = STREAM_BYTES) -> dict[str, float]:
    """GB/s of an in-place scale (a *= s), a copy (a = b) and a triad (a = b + s c) of arrays of
    ``nbytes`` (float32), and of a fill (a = s): the write bandwidth a kernel whose output
    dominates (a B x P per-sample gradient) is held to. On a CPU the fill is the fastest of
    torch's, libc's ``memset`` (which streams a large block past the cache on some CPUs) and
    streaming stores (``perfgate._streamfill``, where built), as a kernel writing a result past the
    cache does, each of a non-zero byte: a zero fill measured 1.7x faster on an AMD Zen 3 guest, a
    rate no kernel's output reaches."""
    import torch

    n = nbytes // 4
    a, b, c = (torch.ones(n, device=device) for _ in range(3))
    seconds = {"scale": (2, lambda: a.mul_(1.0)), "copy": (2, lambda: a.copy_(b)),
               "triad": (3, lambda: torch.add(b, c, alpha=1.5, out=a)), "fill": (1, lambda: a.fill_(1.0))}
    rates = {name: arrays * 4 * n / _best(fn, device) / 1e9 for name, (arrays, fn) in seconds.items()}
    memset = _libc_memset() if device == "cpu" else None
    threads = max(1, torch.get_num_threads())
    if memset is not None:  # on the session's threads, a block each (ctypes lets go of the GIL)
        spans = page_blocks(a.data_ptr(), a.data_ptr() + 4 * n, threads)
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            def fill() -> None:
                list(pool.map(lambda span: memset(span[0], 0x3F, span[1] - span[0]), spans))

            rates["fill"] = max(rates["fill"], 4 * n / _best(fill, device) / 1e9)
    streamed = _streamed_fill() if device == "cpu" and a.data_ptr() % 64 == 0 and (4 * n) % 64 == 0 else None
    if streamed is not None:  # torch's threads, a block each
        rates["fill"] = max(rates["fill"], 4 * n / _best(lambda: streamed(a.data_ptr(), 4 * n, 0x3F, threads),
                                                         device) / 1e9)
    return rates


def _streamed_fill() -> Callable[[int, int, int, int], None] | None:
    """``perfgate._streamfill.fill(address, nbytes, byte, threads)``: streaming stores; None where
    it is not built or this build has none."""
    try:
        from . import _streamfill
    except ImportError:
        return None
    return _streamfill.fill if _streamfill.STREAMING else None


def page_blocks(start: int, end: int, threads: int, page: int = 4096) -> list[tuple[int, int]]:
    """The addresses [start, end) cut into ``threads`` blocks of whole pages, (first, one past last)
    each: no two threads write one page."""
    block = -(-(end - start) // threads // page) * page  # whole pages a thread
    edges = [start, *range(-(-start // page) * page + block, end, block), end]
    return list(zip(edges, edges[1:], strict=False))


def _libc_memset() -> Callable[[int, int, int], Any] | None:
    """libc's ``memset(address, byte, bytes)`` through ctypes, or None where no C library is found."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        memset = ctypes.CDLL(name).memset
    except (OSError, AttributeError):
        return None
    memset.argtypes, memset.restype = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t), ctypes.c_void_p
    return memset


def _gemm(device: str, dtype: str) -> tuple[float, int]:
    """The best GFLOP/s of ``n x n`` products in ``dtype``, n doubling from 256 until one product
    takes 50 ms (or n reaches 4096 on a CPU, 16384 on a GPU); with that largest n."""
    import torch

    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype) or not kind.is_floating_point:
        raise ValueError(f"dtype {dtype!r}: a GEMM peak needs a floating-point torch dtype, e.g. 'float32'")
    best, n, largest = 0.0, 256, 4096 if device == "cpu" else 16384
    while True:
        x, y = (torch.randn(n, n, device=device).to(kind) for _ in range(2))
        seconds = _best(lambda x=x, y=y: x @ y, device, calls=3)
        best = max(best, 2 * n**3 / seconds / 1e9)
        if seconds >= 0.05 or n >= largest:
            return best, n
        n *= 2


PLACED_HEADER = ("kernel", "impl", "size", "ms", "MB moved (written)", "GFLOP", "GB/s", "GFLOP/s", "roofline")


def placed_header(entries: list[dict]) -> tuple[str, ...]:
    """``PLACED_HEADER``, its bytes column without "(written)" for a run that counted none (rule 5
    and before)."""
    if any(e.get("written") is not None for e in entries):
        return PLACED_HEADER
    return tuple("MB moved" if h == "MB moved (written)" else h for h in PLACED_HEADER)


def placed_cells(entries: list[dict]) -> list[tuple[str, ...]]:
    """``GateState.placed`` entries as the cells of ``PLACED_HEADER``: what each impl moves and
    computes a call, what it achieves, and its share of the machine's limit (or why it has none)."""
    def num(v: float | None, scale: float = 1.0, fmt: str = ".1f") -> str:
        return "-" if v is None else format(v / scale, fmt)

    body = []
    for e in entries:
        flops = sum(e["flops"].values()) if e["flops"] else None
        share = roofline_cell(e["fraction"], e["bound"])
        if e["note"]:
            share = f"- (not counted: {e['note']})"
        elif e["bytes"] == 0 and not flops:  # e.g. a CUDA graph's replay, which no dispatch mode sees
            share = "- (no torch op seen)"
        moved = num(e["bytes"], 1e6)
        if e["bytes"] is not None and e.get("written") is not None:  # a run before COUNT_RULE 6 has none
            moved += f" ({num(e['written'], 1e6)})"
        body.append((e["kernel"], e["impl"], e["label"], f"{e['ms']:.3f}", moved,
                     num(flops, 1e9, ".3f"), num(e["gbps"]), num(e["gflops"]), share))
    return body


def format_placed(entries: list[dict]) -> list[str]:
    """``placed_cells`` as fixed-width lines."""
    return fixed_width(placed_header(entries), placed_cells(entries))
