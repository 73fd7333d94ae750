"""kernels.nontemporal: the streamed outer products are torch.mul's bits, written by the C part
only where it pays (a result larger than the last-level cache, float32, pages all mapped), and
torch.mul everywhere else; the C part refuses buffers of the wrong type or size."""

from __future__ import annotations

import math
import mmap
import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import nontemporal
from kernels.models import MLP

C = nontemporal._nontemporal
needs_c = pytest.mark.skipif(C is None, reason="kernels._nontemporal is not built (no C compiler at install)")
X86 = platform.machine().lower() in ("x86_64", "amd64")


@needs_c
def test_the_c_part_streams_on_x86_64() -> None:
    assert C.NONTEMPORAL == X86  # SSE2's streaming stores on x86-64; elsewhere the module never streams


def _outer_args(b: int, o: int, i: int, offset: int, special: bool) -> tuple[torch.Tensor, ...]:
    g, a = torch.randn(b, o, 1), torch.randn(b, 1, i)
    if special:  # infinities, signed zeros, subnormals: each product is still one IEEE multiply
        flat, values = a.view(-1), torch.tensor([float("inf"), -0.0, 1e-40, -float("inf")])
        flat[::3] = values.repeat(flat.numel())[: (flat.numel() + 2) // 3]
    out = torch.empty(offset + b * o * i)[offset:].view(b, o, i)  # offset: rows start off a 16-byte line
    return g, a, out


@needs_c
@settings(max_examples=60, deadline=None, derandomize=True)
@given(b=st.integers(1, 4), o=st.integers(1, 9), i=st.integers(1, 70), offset=st.integers(0, 15),
       threads=st.integers(1, 5), special=st.booleans())
def test_the_c_products_are_torch_muls_bits(b: int, o: int, i: int, offset: int, threads: int,
                                            special: bool) -> None:
    g, a, out = _outer_args(b, o, i, offset, special)
    C.outer(g.numpy(), a.numpy(), out.numpy(), (b, o, i), threads)
    want = torch.mul(g, a)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@needs_c
@settings(max_examples=40, deadline=None, derandomize=True)
@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9), st.integers(0, 70), st.integers(0, 15)),
                       min_size=1, max_size=4),
       threads=st.integers(1, 7), special=st.booleans())
def test_the_c_parts_written_together_are_torch_muls_bits(shapes: list, threads: int, special: bool) -> None:
    """outer_all's threads split the parts' elements, a row to exactly one thread: every product
    written once, whatever the parts' sizes (an empty row length too) and the thread count."""
    parts = [_outer_args(b, o, i, offset, special) for b, o, i, offset in shapes]
    for _, _, out in parts:
        out.fill_(float("nan"))  # a row no thread wrote stays NaN
    reads = C.outer_all([(g.numpy(), a.numpy(), out.numpy(), tuple(out.shape)) for g, a, out in parts], threads)
    for (g, a, out), read in zip(parts, reads, strict=True):
        assert torch.equal(out.view(torch.int32), torch.mul(g, a).view(torch.int32))
        # each part's largest |g| and |a| the pass read: all of both, or none where the out is empty
        want = (g.abs().max().item(), a.abs().max().item()) if out.numel() else (0.0, 0.0)
        assert read == pytest.approx(want, rel=0, abs=0)


@needs_c
@settings(max_examples=40, deadline=None, derandomize=True)
@given(b=st.integers(1, 4), o=st.integers(1, 9), i=st.integers(1, 40), threads=st.integers(1, 5),
       where=st.sampled_from(["g", "a"]), at=st.integers(0, 10**6), value=st.sampled_from(["nan", "inf", "-inf"]))
def test_the_c_pass_reads_nan_and_inf_wherever_they_are(b: int, o: int, i: int, threads: int, where: str,
                                                        at: int, value: str) -> None:
    """One NaN or inf anywhere in g or a, on any thread's share: its read is NaN or inf, the other's
    finite; a caller checking the terms finite from the reads sees it (kernels.per_sample)."""
    g, a, out = torch.randn(b, o), torch.randn(b, i), torch.empty(b, o, i)
    bad = g if where == "g" else a
    bad.view(-1)[at % bad.numel()] = float(value)
    (big_g, big_a), = C.outer_all([(g.numpy(), a.numpy(), out.numpy(), (b, o, i))], threads)
    hit, other = (big_g, big_a) if where == "g" else (big_a, big_g)
    assert (math.isnan(hit) if value == "nan" else hit == math.inf) and math.isfinite(other)


@needs_c
def test_the_c_part_refuses_buffers_of_another_type_or_size() -> None:
    g, a, out = torch.ones(2, 3), torch.ones(2, 4), torch.zeros(2, 3, 4)
    with pytest.raises(TypeError, match="g must hold float32"):
        C.outer(g.double().numpy(), a.numpy(), out.numpy(), (2, 3, 4), 1)
    with pytest.raises(ValueError, match="a must hold 8 float32 elements, got 4"):
        C.outer(g.numpy(), a[:1].numpy(), out.numpy(), (2, 3, 4), 1)
    with pytest.raises(ValueError, match="out must hold 24 float32 elements"):
        C.outer(g.numpy(), a.numpy(), out[:1].numpy(), (2, 3, 4), 1)
    with pytest.raises(ValueError, match="threads must be 1..256, got 0"):
        C.outer(g.numpy(), a.numpy(), out.numpy(), (2, 3, 4), 0)
    with pytest.raises(ValueError, match=r"shape must be \(B, O, I\) >= 0"):
        C.outer(g.numpy(), a.numpy(), out.numpy(), (2, -3, 4), 1)
    with pytest.raises(ValueError, match="too large for a float32 buffer"):  # B*O*I*4 past Py_ssize_t
        C.outer(g[:1, :1].numpy(), a[:1, :1].numpy(), out[:1, :1, :1].numpy(), (1, 1, 2**62 + 1), 1)
    read_only = out.numpy()
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError), match="read-only|not writable"):
        C.outer(g.numpy(), a.numpy(), read_only, (2, 3, 4), 1)
    assert torch.equal(out, torch.zeros(2, 3, 4))  # nothing written by a refused call
    good = (g.numpy(), a.numpy(), out.numpy(), (2, 3, 4))
    with pytest.raises(ValueError, match="a must hold 8 float32 elements, got 4"):
        C.outer_all([good, (g.numpy(), a[:1].numpy(), out.numpy(), (2, 3, 4))], 1)
    with pytest.raises(TypeError, match="parts must be a sequence"):
        C.outer_all(None, 1)
    with pytest.raises(TypeError, match=r"parts\[0\] must be a tuple \(g, a, out, \(B, O, I\)\), got list"):
        C.outer_all([list(good)], 1)
    with pytest.raises(ValueError, match="threads must be 1..256, got 0"):
        C.outer_all([good], 0)
    assert torch.equal(out, torch.zeros(2, 3, 4))  # a refused part: none written
    C.outer_all([], 1)


@needs_c
def test_resident_means_every_page_is_mapped() -> None:
    pages = 64
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as fresh:  # anonymous: mapped on the first write
        assert not C.resident(fresh)
        for p in range(pages - 1):
            fresh[p * mmap.PAGESIZE] = 1
        assert not C.resident(fresh)  # one page left
        fresh[(pages - 1) * mmap.PAGESIZE] = 1
        assert C.resident(fresh)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes kernels.nontemporal streamed (the C part's calls), recorded; an LLC of 1 byte,
    so every result pays."""
    if C is None or not C.NONTEMPORAL:
        pytest.skip("no streaming stores in this build")
    seen: list[tuple[int, ...]] = []

    class Recorded:
        NONTEMPORAL, MAX_THREADS = True, C.MAX_THREADS
        resident = staticmethod(C.resident)

        @staticmethod
        def outer_all(parts, threads):
            seen.extend(part[3] for part in parts)
            return C.outer_all(parts, threads)

    monkeypatch.setattr(nontemporal, "_nontemporal", Recorded)
    monkeypatch.setattr(nontemporal, "last_level_cache", lambda: 1)
    return seen


def test_outer_streams_only_where_it_pays(calls: list) -> None:
    g, a = torch.randn(3, 5, 1), torch.randn(3, 1, 7)
    want = torch.mul(g, a)
    out = torch.zeros(3, 5, 7)  # mapped: written once
    assert nontemporal.outer(g, a, out, stream=True) is out and calls == [(3, 5, 7)]
    assert torch.equal(out, want)
    # not streamed: stream=False, float64, a strided out
    assert torch.equal(nontemporal.outer(g, a, torch.zeros(3, 5, 7), stream=False), want)
    wide = torch.zeros(3, 5, 7, dtype=torch.float64)
    assert torch.equal(nontemporal.outer(g.double(), a.double(), wide, stream=True), g.double() * a.double())
    assert torch.equal(nontemporal.outer(g, a, torch.zeros(3, 7, 5).transpose(1, 2), stream=True), want)
    assert len(calls) == 1
    with mmap.mmap(-1, 3 * 5 * 7 * 4) as fresh:  # pages not mapped yet: a streaming store would fault
        out = torch.frombuffer(fresh, dtype=torch.float32).view(3, 5, 7)
        assert torch.equal(nontemporal.outer(g, a, out, stream=True), want)
        del out
    assert len(calls) == 1


def test_outer_streams_nothing_torch_mul_would_treat_otherwise(calls: list) -> None:
    """Memory shared with an input, inputs that ask for a gradient, a negative view: torch.mul's
    own result or error; a streamed out counts the write in its version, as torch.mul's out= does."""
    g, a = torch.randn(2, 3, 1), torch.randn(2, 1, 4)
    out = torch.zeros(2, 3, 4)
    version = out._version
    nontemporal.outer(g, a, out, stream=True)
    assert calls and out._version > version
    calls.clear()
    shared = torch.zeros(2 * 3 * 4 + 2 * 3)
    g_in, out_in = shared[:6].view(2, 3, 1), shared[6:].view(2, 3, 4)
    g_in.copy_(g)
    assert torch.equal(nontemporal.outer(g_in, a, out_in, stream=True), g * a)
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        nontemporal.outer(g.requires_grad_(), a, torch.zeros(2, 3, 4), stream=True)
    negative = torch._neg_view(a.detach())
    assert torch.equal(nontemporal.outer(g.detach(), negative, torch.zeros(2, 3, 4), stream=True), g.detach() * -a)
    assert calls == []


def test_outer_all_streams_its_parts_in_one_call_unless_one_writes_what_another_reads(calls: list) -> None:
    """The layers' parts go to the C part together; where an out shares memory with another part's
    input or out (its threads would write it while another reads or writes it), each part is
    written alone, in order, as outer writes it."""
    g, a, g2, a2 = torch.randn(2, 3, 1), torch.randn(2, 1, 4), torch.randn(2, 5, 1), torch.randn(2, 1, 3)
    outs = [torch.zeros(2, 3, 4), torch.zeros(2, 5, 3)]
    written, reads = nontemporal.outer_all([(g, a, outs[0]), (g2, a2, outs[1])], stream=True)
    assert written == outs and reads is not None
    assert calls == [(2, 3, 4), (2, 5, 3)]
    assert torch.equal(outs[0], g * a) and torch.equal(outs[1], g2 * a2)
    calls.clear()
    shared = torch.zeros(2 * 5 * 3)
    a_shared = shared[:8].view(2, 1, 4)
    a_shared.copy_(a)
    got, reads = nontemporal.outer_all([(g, a_shared, torch.zeros(2, 3, 4)), (g2, a2, shared.view(2, 5, 3))],
                                       stream=True)
    assert calls == [(2, 3, 4), (2, 5, 3)] and reads is None  # each alone, in order: a_shared is read first
    assert torch.equal(got[0], g * a) and torch.equal(got[1], g2 * a2)
    calls.clear()
    # two outs over one buffer, overlapping by half (their storages start apart): written one after the other
    buffer = np.zeros(2 * 3 * 4 + 12, dtype=np.float32)
    first, second = torch.from_numpy(buffer[:24]).view(2, 3, 4), torch.from_numpy(buffer[12:]).view(2, 3, 4)
    got, _ = nontemporal.outer_all([(g, a, first), (g, -a, second)], stream=True)
    assert calls == [(2, 3, 4), (2, 3, 4)] and torch.equal(second, g * -a)
    assert torch.equal(first.reshape(-1)[:12], (g * a).reshape(-1)[:12])


def test_outer_computes_misaligned_float32_as_torch_mul(calls: list) -> None:
    """float32 memory not 4-byte aligned (frombuffer at an odd offset) is torch.mul's: the C part's
    buffer check refused numpy's '=f' for it, and outer raised where torch.mul computes."""
    g, a = torch.randn(2, 3, 1), torch.randn(2, 1, 4)
    raw = bytearray(4 * 24 + 1)
    out = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=24).view(2, 3, 4)
    assert out.data_ptr() % 4 != 0
    assert torch.equal(nontemporal.outer(g, a, out, stream=True), g * a)
    assert calls == []


def test_outer_takes_at_most_the_c_parts_threads(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = []
    monkeypatch.setattr(nontemporal, "THREAD_BYTES", 4)
    real = nontemporal._nontemporal.outer_all
    monkeypatch.setattr(nontemporal._nontemporal, "outer_all",
                        lambda *args: threads.append(args[-1]) or real(*args))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 10_000)
    nontemporal.outer(torch.randn(2, 300, 1), torch.randn(2, 1, 5), torch.zeros(2, 300, 5), stream=True)
    assert threads == [C.MAX_THREADS]


def test_pays_past_the_last_level_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    if C is None or not C.NONTEMPORAL:
        assert not nontemporal.pays(1 << 40)
        return
    monkeypatch.setattr(nontemporal, "last_level_cache", lambda: 32 << 20)
    assert nontemporal.pays((32 << 20) + 1) and not nontemporal.pays(32 << 20)
    monkeypatch.setattr(nontemporal, "last_level_cache", lambda: 8 << 20)
    assert nontemporal.pays((8 << 20) + 1) and not nontemporal.pays(8 << 20)
    # a guest's sysfs reports its host socket's whole L3: no more than CACHE_CAP of it counts
    monkeypatch.setattr(nontemporal, "last_level_cache", lambda: 480 << 20)
    assert nontemporal.pays(nontemporal.CACHE_CAP + 1) and not nontemporal.pays(nontemporal.CACHE_CAP)
    monkeypatch.setattr(nontemporal, "last_level_cache", lambda: 0)  # size unknown: never
    assert not nontemporal.pays(1 << 40)


def test_last_level_cache_is_sysfs_largest_data_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for index, (kind, size) in enumerate([("Data", "32K"), ("Instruction", "64K"), ("Unified", "512K"),
                                          ("Unified", "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(nontemporal, "CACHES", tmp_path)
    nontemporal.last_level_cache.cache_clear()
    try:
        assert nontemporal.last_level_cache() == 32 << 20
        monkeypatch.setattr(nontemporal, "CACHES", tmp_path / "absent")
        nontemporal.last_level_cache.cache_clear()
        assert nontemporal.last_level_cache() == 0
    finally:
        monkeypatch.undo()
        nontemporal.last_level_cache.cache_clear()


def test_per_sample_grads_streams_its_outer_products(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x, y = MLP((20, 16, 3)), torch.randn(5, 20), torch.randint(0, 3, (5,))
    into = kernels.per_sample_grads(model, F.cross_entropy, x, y)  # mapped: the previous call's result
    calls.clear()
    got = kernels.per_sample_grads(model, F.cross_entropy, x, y, out=into)
    assert calls == [(5, 16, 20), (5, 3, 16)]
    monkeypatch.setattr(nontemporal, "_nontemporal", None)
    want = kernels.per_sample_grads(model, F.cross_entropy, x, y)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_forward_mode_tangent_is_never_dropped_by_the_c_part() -> None:
    """A dual input is torch.mul's to differentiate or refuse; the C part would return no tangent."""
    import torch.autograd.forward_ad as fwAD

    g, a = torch.randn(2, 3, 1), torch.randn(2, 1, 5)
    with fwAD.dual_level():
        dual = fwAD.make_dual(g, torch.ones_like(g))
        assert not nontemporal._streamable(dual, a, torch.zeros(2, 3, 5))
        with pytest.raises(RuntimeError, match="forward AD"):
            nontemporal.outer(dual, a, torch.zeros(2, 3, 5), stream=True)


def test_outer_broadcasts_a_batch_of_one_as_torch_mul(calls: list) -> None:
    """g or a with one sample, broadcast over the batch: torch.mul computes it, the C part (which
    reads B samples of each) is not asked to."""
    g, a = torch.randn(3, 5, 1), torch.randn(3, 1, 7)
    for g_, a_ in [(g, a[:1]), (g[:1], a)]:
        assert torch.equal(nontemporal.outer(g_, a_, torch.zeros(3, 5, 7), stream=True), g_ * a_)
    assert calls == []


@needs_c
def test_the_c_part_refuses_buffers_larger_than_the_shape() -> None:
    """g, a and out must hold exactly the shape's elements: a larger buffer (a wrong shape passed
    with it) is refused, not read or written in part."""
    g, a, out = torch.ones(2, 3), torch.ones(2, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="out must hold 24 float32 elements, got 25"):
        C.outer(g.numpy(), a.numpy(), torch.zeros(25).numpy(), (2, 3, 4), 1)
    with pytest.raises(ValueError, match="g must hold 6 float32 elements, got 7"):
        C.outer(torch.ones(7).numpy(), a.numpy(), out.numpy(), (2, 3, 4), 1)
    with pytest.raises(ValueError, match="a must hold 8 float32 elements, got 9"):
        C.outer(g.numpy(), torch.ones(9).numpy(), out.numpy(), (2, 3, 4), 1)
    assert torch.equal(out, torch.zeros(2, 3, 4))  # nothing written by a refused call
