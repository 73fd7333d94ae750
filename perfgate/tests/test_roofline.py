"""perfgate.roofline: the work a call is counted to do, the machine's limits, and a row's place
under them; then the roofline section and JSON of a perf session."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from perfgate.roofline import COUNT_RULE, LIMITS_FILE, BadLimits, Limits, Work, count_work, read_limits, write_rate

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_a_matmul_reads_its_inputs_writes_its_output_and_counts_2mnk() -> None:
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    work = count_work(lambda: a @ b)
    assert work.bytes == 4 * (32 * 64 + 64 * 16 + 32 * 16) and work.written == 4 * 32 * 16
    assert work.flops == {"float32": 2 * 32 * 64 * 16}


def test_intermediates_are_not_counted_and_bf16_flops_are_bf16() -> None:
    a = torch.randn(8, 8, dtype=torch.bfloat16)
    work = count_work(lambda: ((a @ a) * 2 + 1).float())  # two temporaries, one fp32 output
    assert work.bytes == 2 * 64 + 4 * 64
    assert work.flops == {"bfloat16": 2 * 8**3}


def test_complex_flops_count_as_real_flops_of_the_matching_real_dtype() -> None:
    """torch's counter counts a complex matmul's 2mnk as a real one's; each complex multiply-add is
    4 real multiplies and 4 real adds, so it is 4 x 2mnk real FLOPs at the float32 (complex64) or
    float64 (complex128) peak."""
    for dtype, real in ((torch.complex64, "float32"), (torch.complex128, "float64")):
        a, b = torch.randn(8, 16, dtype=dtype), torch.randn(16, 4, dtype=dtype)
        assert count_work(lambda a=a, b=b: a @ b).flops == {real: 4 * 2 * 8 * 16 * 4}


def test_in_place_updates_count_read_and_written_once() -> None:
    p, g = torch.randn(1000), torch.randn(1000)
    work = count_work(lambda: (p.add_(g, alpha=-0.1), p.mul_(0.9)))  # p read and written once
    assert work.bytes == 4 * 1000 * 3 and work.written == 4 * 1000


def test_foreach_lists_and_out_buffers_are_seen() -> None:
    ps, gs = [torch.randn(100) for _ in range(3)], [torch.randn(100) for _ in range(3)]
    assert count_work(lambda: torch._foreach_add_(ps, gs)).bytes == 4 * 100 * 9  # read p, g; write p
    x, out = torch.randn(500), torch.empty(500)
    assert count_work(lambda: torch.mul(x, 2, out=out)).bytes == 4 * 500 * 2  # out= written, never read
    assert count_work(lambda: torch.mul(x, 2, out=out)).written == 4 * 500
    assert count_work(lambda: torch._foreach_add_(ps, gs)).written == 4 * 100 * 3
    assert count_work(lambda: out.copy_(x)).bytes == 4 * 500 * 2


def test_a_fused_optimizer_step_writes_its_grads_only_to_unscale_them() -> None:
    """torch's fused steps mark their grads as written; they write them only given a grad_scale."""
    n = 1000
    p, g, m, v = (torch.randn(n) for _ in range(4))
    sgd = dict(weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False, maximize=False,
               is_first_step=False)
    assert count_work(lambda: torch._fused_sgd_([p], [g], [m], **sgd)).bytes == 4 * n * 5  # read p g m, write p m
    scaled = count_work(lambda: torch._fused_sgd_([p], [g], [m], **sgd, grad_scale=torch.tensor(1.0)))
    assert scaled.bytes == 4 * n * 6 + 4  # g unscaled in place, and the scale read
    step = torch.tensor(1.0)
    adamw = count_work(lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                                   weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False))
    assert adamw.bytes == 4 * n * 7 + 4  # read p g m v, write p m v; the step read (torch.optim adds to it)


def test_what_numpy_reads_counts_and_an_input_returned_nothing() -> None:
    """A tensor handed to .numpy() (a C pass, a peer's numpy; np.asarray too) is read outside the
    dispatcher: its own elements count. A view returned as it is moved nothing."""
    import numpy as np

    x = torch.randn(10, 10)
    assert count_work(lambda: x).bytes == 0 and count_work(lambda: x.t()).bytes == 0  # no op ran
    assert count_work(lambda: x[2:4].numpy().sum()).bytes == 80  # the rows, not the base
    assert count_work(lambda: np.asarray(x.t()).sum()).bytes == 400
    out = torch.empty(10, 10)
    assert count_work(lambda: out.detach().numpy().__setitem__(slice(None), 1.0)).bytes == 400  # seen as read
    assert count_work(lambda: torch.empty(10, 10).numpy().fill(1.0)).bytes == 0  # the call's own, not returned
    # an array made only to look at its pages before an op writes all of it: the op's write counts, once
    a, b = torch.randn(10, 10), torch.randn(10, 10)
    assert count_work(lambda: (out.numpy().ctypes.data, torch.mul(a, b, out=out))).bytes == 3 * 400
    assert "numpy" not in vars(torch.Tensor)  # Tensor.numpy is torch's again


def test_a_c_pass_that_raises_its_outputs_version_wrote_it() -> None:
    """A C pass writing through ``.numpy()`` says so as torch's in-place ops do, by raising the
    tensor's version (``kernels.nontemporal.outer``): its output counts as written, not read. A
    version an op raised is the op's write, which leaves what ``.numpy()`` saw beside it read."""
    x, out = torch.randn(100), torch.empty(100)

    def c_pass() -> None:
        out.numpy()[:] = x.numpy() * 2
        torch.autograd.graph.increment_version(out)

    work = count_work(c_pass)
    assert work.bytes == 2 * 400 and work.written == 400
    assert count_work(lambda: out.numpy().__setitem__(slice(None), 1.0)).written == 0  # no version raised: read
    seen = count_work(lambda: (float(x.numpy().sum()), x[:50].mul_(2)))  # x read outside, half written by an op
    assert seen.bytes == 400 + 200 and seen.written == 200
    with torch.inference_mode():
        frozen = torch.randn(100)
    frozen_work = count_work(lambda: float(frozen.numpy().sum()))
    assert frozen_work.bytes == 400 and frozen_work.written == 0  # no version counter: read


def test_a_c_pass_beside_ops_on_one_storage_is_told_from_them_by_when_the_version_rose() -> None:
    """An op's own rise is seen at the next look and is the op's; a rise with no op in between is
    the C pass's, before an op writes the storage or after."""
    out = torch.empty(100)

    def c_pass() -> None:
        out.numpy()[:] = 1.0
        torch.autograd.graph.increment_version(out)

    c_then_op = count_work(lambda: (c_pass(), out[:50].mul_(2)))
    assert c_then_op.written == 400 and c_then_op.bytes == 400 + 200  # all of out written; the op read its half
    op_then_c = count_work(lambda: (out[:50].mul_(2), c_pass()))
    assert op_then_c.written == 400
    # handed out, an op writes half, then a C pass writes all of it: the pass's raise looks first,
    # so the op's rise is the op's and the pass's its own
    x = torch.randn(100)

    def op_then_pass() -> None:
        seen = x.numpy()
        x[:50].mul_(2)
        seen[:] = 1.0
        torch.autograd.graph.increment_version(x)

    after_op = count_work(op_then_pass)
    assert after_op.written == 400 and after_op.bytes == 200 + 400  # the op read its half
    # an op writing through another tensor of the storage (.data: its own version) raises none
    # of the one handed out: the pass's raise after it is still the pass's
    hidden = count_work(lambda: (x.numpy(), x.data[:50].mul_(2), x.numpy().fill(1.0),
                                 torch.autograd.graph.increment_version(x)))
    assert hidden.written == 400
    unraised = count_work(lambda: (float(x.numpy().sum()), x.data[:50].mul_(2)))  # no rise: x read, half written
    assert unraised.written == 200 and unraised.bytes == 400 + 200
    h = out[:50]
    two_ops = count_work(lambda: (float(out.numpy().sum()), h.mul_(2), h.add_(h)))
    assert two_ops.written == 200 and two_ops.bytes == 600  # both rises the ops': out read, its half written
    # a custom op's version is raised by torch before the op reaches the dispatch mode: the op's
    custom = count_work(lambda: (float(x.numpy().sum()), _filled(x[:50])))
    assert custom.written == 200 and custom.bytes == 400 + 200  # x read, its half written
    x = torch.randn(100)
    looked = count_work(lambda: (float(x.numpy().sum()), x[:50].mul_(2), x[:50].add_(x[:50])))
    assert looked.written == 200  # the ops' rises, one each, are theirs: what .numpy() saw stays read


@torch.library.custom_op("perfgate_tests::filled", mutates_args=("t",))
def _filled(t: torch.Tensor) -> None:
    """A custom op writing all of ``t`` in place."""
    t.fill_(1.0)


def test_page_blocks_cover_the_range_once_each_thread_whole_pages() -> None:
    from perfgate.roofline import page_blocks

    for start, end, threads in [(4096 * 3 + 100, 4096 * 40 + 7, 2), (0, 4096 * 8, 3), (4096, 4096 * 2, 4)]:
        spans = page_blocks(start, end, threads)
        assert spans[0][0] == start and spans[-1][1] == end and len(spans) <= threads
        assert all(a < b for a, b in spans)
        assert all(b == c for (_, b), (c, _) in zip(spans[:-1], spans[1:], strict=True))  # no gap, no overlap
        assert all(b % 4096 == 0 for _, b in spans[:-1])  # cut at page boundaries: no page shared


def test_libcs_memset_is_called_as_c_declares_it() -> None:
    import perfgate.roofline as roofline

    memset = roofline._libc_memset()
    if memset is None:
        pytest.skip("no C library found by ctypes.util.find_library('c')")
    buffer = torch.zeros(64, dtype=torch.uint8)
    memset(buffer.data_ptr() + 8, 0x3F, 16)
    assert buffer.tolist() == [0] * 8 + [0x3F] * 16 + [0] * 40


def test_a_read_outside_counts_whatever_ops_read_beside_it() -> None:
    """A C pass over all of x through .numpy(), beside an op that reads one row of x (the
    Standardizer's shift, taken from its first sample): x is read whole, once."""
    x = torch.randn(1000)
    assert count_work(lambda: float(x.detach().numpy().sum())).bytes == 4000
    assert count_work(lambda: (x[0].clone(), float(x.detach().numpy().sum()))).bytes == 4000 + 4  # the row's copy
    assert count_work(lambda: x.view(2, -1)[0].clone()).bytes == 2 * 2000  # the half read, its copy written


def test_a_slice_counts_its_own_elements_not_its_base() -> None:
    x = torch.randn(100, 100)
    assert count_work(lambda: x[0].clone()).bytes == 4 * 100 * 2  # one row read, one written
    assert count_work(lambda: x[:, 0] * 2).bytes == 4 * 100 * 2  # a strided column: its elements, not its span
    bias = torch.randn(64)
    assert count_work(lambda: bias.expand(8, 64).clone()).bytes == 4 * 64 * 9  # a broadcast reads its source once


def test_views_of_one_storage_count_as_their_union() -> None:
    a = torch.randn(1000)
    halves = a[:500], a[500:]
    assert count_work(lambda: torch.cat(halves)).bytes == 4 * 1000 * 2  # both halves read: all of a
    assert count_work(lambda: a[:600] + a[400:]).bytes == 4 * (1000 + 600)  # overlapping: a once, the sum
    out = torch.empty(1000)
    assert count_work(lambda: (out[:500].copy_(halves[0]), out[500:].copy_(halves[1]))).bytes == 4 * 1000 * 2
    qkv = torch.randn(4, 16, 3 * 32)
    q, k, v = qkv.split(32, -1)  # strided thirds, interleaved row by row
    assert count_work(lambda: q.contiguous()).bytes == 2 * q.nbytes
    assert count_work(lambda: (q.contiguous(), k.contiguous(), v.contiguous())).bytes == 2 * qkv.nbytes


def test_a_view_inside_another_counts_once_and_an_empty_one_spans_nothing() -> None:
    x = torch.randn(1000)
    assert count_work(lambda: (x.sum(), x[100:200].sum())).bytes == 4000 + 2 * 4  # x once, two sums written
    # y[:, :0] holds no element: it overlaps no later copy into y, whose rows are then the call's own
    y = torch.randn(10, 10)
    assert count_work(lambda: (y[:, :0].sum(), y[5:].copy_(x[:50].view(5, 10)), y[5:].sum())).bytes == 408
    assert count_work(lambda: torch.ops.aten._unsafe_view(y, (100,))).bytes == 0  # a view its schema does not mark
    meta = torch.randn(32, 64, device="meta")  # no storage: its tensors are not one storage at address 0
    assert count_work(lambda: meta @ meta.T) == Work(bytes=0.0, flops={"float32": 2 * 32 * 64 * 32})


def test_an_empty_view_written_in_place_leaves_its_storage_not_made() -> None:
    """copy_ into an empty slice returns a view of a storage the call never read: that storage is
    not the call's own, so reading all of it later counts."""
    x, out = torch.randn(10), torch.randn(10)
    assert count_work(lambda: (out[10:].copy_(x[10:]), out.sum())).bytes == 40 + 4  # out read, a sum written
    assert count_work(lambda: (torch.add(x[:0], 1, out=out[:0]), out.sum())).bytes == 40 + 4
    assert count_work(lambda: (x[10:].clone(), out.sum())).bytes == 40 + 4  # a fresh empty tensor moves nothing


def test_a_deepcopy_reads_its_source_and_a_storage_set_into_a_tensor_is_not_made() -> None:
    """deepcopy clones a storage (allocated outside the dispatcher) and set_s it into a tensor: the
    source is read, the clone is the call's own. A storage that existed before, set_ into a tensor,
    is read or written as it is used, whole or in part."""
    w, buffer = torch.randn(256), torch.randn(256)
    assert count_work(lambda: copy.deepcopy(w).sum()).bytes == 1024 + 4  # w read, a sum written
    assert count_work(lambda: copy.deepcopy(w)).bytes == 1024 * 2  # w read, its copy returned
    t = torch.empty(0)
    assert count_work(lambda: (t.set_(w.untyped_storage()), t.sum())[1]).bytes == 1024 + 4
    t = torch.empty(0)  # wholly overwritten: written in place, as buffer.copy_(w) is
    assert count_work(lambda: (t.set_(buffer.untyped_storage()), t.copy_(w), t.sum())[2]).bytes == 2 * 1024 + 4
    assert count_work(lambda: buffer.untyped_storage().copy_(w.untyped_storage())).bytes == 2 * 1024
    t = torch.empty(0)
    assert count_work(lambda: (t.set_(buffer.untyped_storage()), t[:128].copy_(w[:128]))[1]).bytes == 512 + 512
    t, rows = torch.empty(0), torch.randn(4, 256)  # a strided write from its first to its last byte: not all of it
    zeroed = lambda: (t.set_(rows.untyped_storage()), t.view(4, 256)[:, ::255].zero_(), t.sum())[2]
    assert count_work(zeroed).bytes == 4096 + 8 * 4 + 4  # all of rows read, 8 elements written, a sum

def test_memory_made_outside_the_dispatcher_at_a_freed_storages_address_is_another_storage() -> None:
    """A storage the call made and freed, then memory no op made (``torch.tensor`` of Python data,
    numpy's, a C library's) at the same address: the new storage was not the call's, so what the
    call reads of it counts. The allocator decides whether the address comes back: each attempt
    notes it, and glibc's gives a freed block to the next request of its size most times."""
    from torch.utils._python_dispatch import _disable_current_modes

    reused = []

    def call() -> Any:
        made = torch.ones(256)  # the call's own storage, freed at once
        address = made.data_ptr()
        del made
        with _disable_current_modes():  # made where no dispatch mode sees it
            outside = torch.full((256,), 2.0)
        reused.append(outside.data_ptr() == address)
        return outside * 2

    counts = {count_work(call).bytes for _ in range(50)}
    assert counts == {1024 + 1024}  # outside read, the product written: the same whether the address came back
    assert any(reused), "the allocator never handed the freed address back: the case was not exercised"


def test_what_the_call_wrote_before_reading_it_is_not_read() -> None:
    """Storage the call overwrote is its own data by then: reading it back moves nothing more, after
    one copy, two copies that adjoin, or a copy that adjoins (and does not overlap) a view it read."""
    x, out = torch.randn(10, 10), torch.empty(10, 10)
    assert count_work(lambda: (out.copy_(x), out.sum())).bytes == 2 * 400 + 4  # x read, out written, a sum
    assert count_work(lambda: (out[:5].copy_(x[:5]), out[5:].copy_(x[5:]), out.sum())).bytes == 2 * 400 + 4
    beside = lambda: (out[:5].sum(), out[5:].copy_(x[5:]), out[5:].sum())
    assert count_work(beside).bytes == 200 + 2 * 200 + 2 * 4  # out[:5] and x[5:] read, out[5:] written


def test_a_read_counts_only_what_the_call_has_not_overwritten_yet() -> None:
    """What was read stays read; an overwrite makes its bytes the call's own even after a read of
    them; a later read counts only the bytes no overwrite has made the call's (runs, not gaps)."""
    x, out = torch.randn(10, 10), torch.empty(10, 10)
    after = lambda: (out[:5].sum(), out.copy_(x), out.sum())
    assert count_work(after).bytes == 200 + 400 + 400 + 2 * 4  # out[:5] read, x read, out written
    half = lambda: (out[:5].copy_(x[:5]), out.sum())
    assert count_work(half).bytes == 200 + 200 + 200 + 4  # x[:5] read, out[:5] written, out[5:] read
    middle = lambda: (out[3:6].copy_(x[3:6]), out.sum())
    assert count_work(middle).bytes == 2 * 120 + 280 + 4  # out read around the rows written
    # a strided read is counted whole unless written before (out[::2]'s row 4 too)
    assert count_work(lambda: (out[3:6].copy_(x[3:6]), out[::2].sum())).bytes == 2 * 120 + 200 + 4
    # a strided column written: its span has gaps, so a read of all of out is not lessened by it,
    # while a read of the same view is
    column = out[:, :5]
    assert count_work(lambda: (column.copy_(x[:, :5]), out.sum())).bytes == 2 * 200 + 400 + 4
    assert count_work(lambda: (column.copy_(x[:, :5]), column.sum())).bytes == 2 * 200 + 4


def test_an_out_that_is_also_an_input_is_read_too() -> None:
    a, b = torch.randn(1000), torch.randn(1000)
    assert count_work(lambda: torch.add(a, b, out=a)).bytes == 4 * 1000 * 3  # read a and b, write a


def test_inference_mode_counts_the_ops_a_composite_is_made_of() -> None:
    """Under inference_mode linear, einsum, matmul and SDPA reach the dispatch mode whole; they
    count as their mm, bmm and attention would, as under grad mode."""
    x, w = torch.randn(64, 128), torch.randn(256, 128)
    q = torch.randn(1, 2, 16, 8)
    calls = (lambda: F.linear(x, w), lambda: torch.einsum("ij,kj->ik", x, w), lambda: x @ w.T,
             lambda: F.scaled_dot_product_attention(q, q, q))
    grad = [count_work(c) for c in calls]
    with torch.inference_mode():
        assert [count_work(c) for c in calls] == grad
    assert grad[0].flops == {"float32": 2 * 64 * 256 * 128}
    ints = torch.randint(0, 9, (16, 16))
    assert count_work(lambda: ints @ ints).flops == {}  # no GEMM peak holds an integer matmul


def test_setup_is_not_counted_and_cpu_attention_has_flops() -> None:
    q = torch.randn(1, 2, 16, 8)
    work = count_work(lambda t: F.scaled_dot_product_attention(t, t, t), setup=lambda: q.clone())
    assert work.bytes == 2 * q.nbytes  # the clone is setup's; q read once, the output written once
    assert work.flops == {"float32": 4 * 2 * 16 * 16 * 8}  # QK^T and PV: 2 * 2 * B*H*S*S*D


def _limits(stream: float = 10.0, peak: float = 100.0, fill: float | None = None) -> Limits:
    lim = Limits("cpu", "cpu-x", None)
    lim.values.update(stream_gbps=stream, fill_gbps=fill, gemm_gflops={"float32": peak})
    return lim


def test_a_figure_is_the_least_time_over_the_measured() -> None:
    lim = _limits()
    memory = lim.figure(Work(bytes=1e9), seconds=0.2)  # least 0.1 s at 10 GB/s
    assert memory.fraction == pytest.approx(0.5) and memory.bound == "memory" and memory.gbps == pytest.approx(5.0)
    compute = lim.figure(Work(bytes=1e6, flops={"float32": 5e10}), seconds=1.0)  # least 0.5 s at 100 GFLOP/s
    assert compute.fraction == pytest.approx(0.5) and compute.bound == "compute"
    assert compute.gflops == pytest.approx(50.0)
    assert memory.gflops is None  # no FLOP counted: no rate, not 0.0
    assert lim.figure(Work(bytes=0.0), seconds=1.0) is None  # nothing counted: no figure
    assert lim.figure(Work(bytes=0.0, flops={"float32": 0.0}), seconds=1.0) is None  # an empty matmul's
    assert count_work(lambda: torch.randn(0, 4) @ torch.randn(4, 4)).total_flops == 0


def test_the_bytes_written_are_held_to_the_writes_alone_rate() -> None:
    """A call that writes more than it reads is bound by the fill's rate, which no write passes
    however few bytes are read beside it; the stream bounds it when its reads make up the rest."""
    lim = _limits(stream=10.0, fill=4.0)
    writer = lim.figure(Work(bytes=1e9, written=8e8), seconds=0.4)  # least: 0.2 s writing, 0.1 s streaming
    assert writer.bound == "write" and writer.fraction == pytest.approx(0.5) and writer.gbps == pytest.approx(2.5)
    mixed = lim.figure(Work(bytes=1e9, written=3e8), seconds=0.4)  # 0.075 s writing: the stream's 0.1 s binds
    assert mixed.bound == "memory" and mixed.fraction == pytest.approx(0.25)
    tie = lim.figure(Work(bytes=1e9, written=4e8), seconds=0.2)  # 0.1 s each way: the stream's, as it was
    assert tie.bound == "memory"
    scale = _limits(stream=41.0, fill=18.9)  # an in-place scale writes 20.5 GB/s beside its reads
    scale.values["scale_gbps"] = 41.0
    at_stream = scale.figure(Work(bytes=4.1e9, written=2.05e9), seconds=0.1)  # a pass of its shape, at its rate
    assert at_stream.fraction == pytest.approx(1.0) and at_stream.bound == "memory"
    # a streamed fill faster than the stream (writes 42.4 GB/s, an in-place scale 36.3): bytes moved at the
    # fill's rate at the least, a call of writes alone at 100% there
    streamed = _limits(stream=36.3, fill=42.4)
    writes_only = streamed.figure(Work(bytes=4.24e9, written=4.24e9), seconds=0.1)
    assert writes_only.fraction == pytest.approx(1.0) and writes_only.bound == "memory"
    mostly = streamed.figure(Work(bytes=70.2e6, written=68.9e6), seconds=70.2e6 / 42.4e9 / 0.5)
    assert mostly.fraction == pytest.approx(0.5) and mostly.bound == "memory"  # not 70.2 MB over the stream's 36.3


def test_a_writing_call_reads_the_write_rate_before_holding_bytes_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file with a stream but no write rate: the first figure of a call that writes measures the
    rates, and its bytes are held to the fill's 30 GB/s it read, not to the stored stream's 10."""
    import perfgate.roofline as roofline

    monkeypatch.setattr(roofline, "_stream", lambda *_: {"scale": 10.0, "copy": 8.0, "triad": 8.0, "fill": 30.0})
    figure = _limits(stream=10.0).figure(Work(bytes=3e9, written=3e9), seconds=0.1)
    assert figure.fraction == pytest.approx(1.0)
    out, column, row = torch.empty(256, 256), torch.ones(256, 1), torch.ones(1, 256)
    counted = count_work(lambda: torch.mul(column, row, out=out))  # an outer product: reads 2 x 256, writes 256^2
    assert counted.written == out.nbytes and counted.bytes == out.nbytes + 2 * 4 * 256


def test_a_call_that_writes_nothing_needs_no_write_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfgate.roofline as roofline

    monkeypatch.setattr(roofline, "_stream", lambda *_: pytest.fail("the write rate measured"))
    assert _limits(stream=10.0).figure(Work(bytes=1e9), 0.2).bound == "memory"  # no fill stored: none needed


def test_a_side_not_measured_reads_a_dash_not_zero() -> None:
    """The speedup table's GB/s cell: a reference with no declared or counted bytes has no rate."""
    from perfgate.stats import TABLE_HEADER, table_cells

    row = {"kernel": "k", "impl": "optimized", "label": "", "size": "smoke", "device": "cpu", "reference_ms": 1.0,
           "optimized_ms": 0.5, "speedup": 2.0, "low": 1.9, "high": 2.1, "floor": None, "baseline": None,
           "reference_peak_bytes": None, "optimized_peak_bytes": None, "reference_gbps": None,
           "optimized_gbps": 4.6, "optimized_gflops": None, "roofline": 0.1, "roofline_bound": "memory",
           "failures": []}
    cells = dict(zip(TABLE_HEADER, table_cells([row])[0], strict=True))
    assert cells["GB/s ref/opt"] == "-/4.6" and cells["GFLOP/s opt"] == "-"


def test_the_roofline_sections_cells_and_why_an_impl_has_no_share() -> None:
    from perfgate.roofline import PLACED_HEADER, placed_cells, placed_header

    placed = {"kernel": "k", "impl": "optimized", "label": "B=8", "ms": 2.0, "bytes": 3e6,
              "flops": {"float32": 4e9, "bfloat16": 1e9}, "gbps": 1.5, "gflops": 2500.0, "fraction": 0.42,
              "bound": "compute", "note": ""}
    compute_only = {**placed, "bytes": 0.0, "gbps": 0.0}
    unseen = {**placed, "bytes": 0.0, "flops": {}, "gbps": 0.0, "gflops": None, "fraction": None, "bound": None}
    uncounted = {**unseen, "bytes": None, "written": None, "flops": None, "gbps": None,
                 "note": "count_work raised"}
    writer = {**placed, "bytes": 5e6, "written": 4.5e6, "flops": {}, "gflops": None, "fraction": 0.61,
              "bound": "write"}
    rows = [dict(zip(PLACED_HEADER, cells, strict=True))
            for cells in placed_cells([placed, compute_only, unseen, uncounted, writer])]
    assert rows[0] == {"kernel": "k", "impl": "optimized", "size": "B=8", "ms": "2.000",
                       "MB moved (written)": "3.0", "GFLOP": "5.000", "GB/s": "1.5", "GFLOP/s": "2500.0",
                       "roofline": "42% flop"}
    assert rows[1]["roofline"] == "42% flop"  # FLOPs and no byte: placed by its FLOPs
    assert rows[2]["roofline"] == "- (no torch op seen)" and rows[2]["GFLOP"] == "-"
    assert rows[3]["roofline"] == "- (not counted: count_work raised)" and rows[3]["MB moved (written)"] == "-"
    assert rows[4]["MB moved (written)"] == "5.0 (4.5)" and rows[4]["roofline"] == "61% write"
    assert placed_header([placed, writer]) == PLACED_HEADER
    assert placed_header([placed])[4] == "MB moved"  # a run before rule 6 counted no written bytes


def test_a_limit_a_call_passed_is_measured_again_once_and_never_lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfgate.roofline as roofline

    lim = _limits(stream=10.0, peak=100.0)
    rates = {"scale": 20.0, "copy": 12.0, "triad": 11.0, "fill": 9.0}
    monkeypatch.setattr(roofline, "_stream", lambda *_: dict(rates))
    monkeypatch.setattr(roofline, "_gemm", lambda device, dtype: (80.0, 512))  # lower than the stored peak
    assert lim.recheck([(Work(bytes=1e9), 0.2)]) == [] and not lim.dirty  # 50% of the limit: nothing measured
    assert lim.recheck([(Work(bytes=1e9), 0.05)]) == ["stream 10.0 -> 20.0 GB/s"]  # 20 GB/s passed 10
    assert lim.stream_gbps == 20.0 and lim.values["fill_gbps"] == 9.0 and lim.dirty
    assert lim.figure(Work(bytes=1e9), 0.05).fraction == pytest.approx(1.0)
    monkeypatch.setattr(roofline, "_stream", lambda *_: pytest.fail("the stream measured twice in a session"))
    assert lim.recheck([(Work(bytes=4e9), 0.05)]) == []  # once a session; still over: caches, or counted high
    assert lim.recheck([(Work(bytes=1.0, flops={"float32": 1e10}), 0.05)]) == []  # 200 GFLOP/s passed 100
    assert lim.peak("float32") == 100.0 and lim.rechecked == {"stream", "float32"}  # measured 80: kept 100
    calls = []
    monkeypatch.setattr(roofline, "_stream", lambda device, _: calls.append(device) or dict(rates))
    fresh = Limits("cpu", "cpu-x", None)  # a limit this session measured is not measured again
    assert fresh.recheck([(Work(bytes=1e12), 1.0)]) == [] and fresh.stream_gbps == 20.0 and calls == ["cpu"]


def test_a_write_bound_call_past_the_fill_measures_the_stream_and_says_which_rose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import perfgate.roofline as roofline

    monkeypatch.setattr(roofline, "_stream", lambda *_: {"scale": 9.0, "copy": 8.0, "triad": 8.0, "fill": 6.0})
    lim = _limits(stream=10.0, fill=4.0)
    assert lim.recheck([(Work(bytes=1e9, written=1e9), 0.2)]) == ["write rate 4.0 -> 6.0 GB/s"]  # 5 GB/s written
    assert lim.stream_gbps == 10.0 and lim.write_gbps == 6.0  # each kept at its best
    assert lim.figure(Work(bytes=1e9, written=1e9), 0.2).fraction == pytest.approx(5.0 / 6.0)


def test_the_stream_limit_is_the_best_read_and_write_rate_and_a_lower_one_is_no_rise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill writes only: shown beside the stream limit, never taken as it. A call exactly at the
    limit is no reason to measure it again; one past it, measured lower, leaves the limit as it was."""
    import perfgate.roofline as roofline

    rates = {"scale": 20.0, "copy": 12.0, "triad": 11.0, "fill": 40.0}
    monkeypatch.setattr(roofline, "_stream", lambda *_: pytest.fail("a call at 100% measured the stream"))
    lim = _limits(stream=30.0)
    assert lim.recheck([(Work(bytes=3e9), 0.1)]) == [] and lim.rechecked == set()  # 30 GB/s: at the limit
    monkeypatch.setattr(roofline, "_stream", lambda *_: dict(rates))
    assert lim.recheck([(Work(bytes=4e9), 0.1)]) == []  # 40 GB/s passed it; measured 20: not a rise
    assert lim.stream_gbps == 30.0 and lim.values["fill_gbps"] == 40.0
    assert Limits("cpu", "cpu-x", None).stream_gbps == 20.0  # measured afresh: the best that reads, not the fill


def test_a_compute_bound_call_past_the_roofline_measures_its_dtypes_peaks_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import perfgate.roofline as roofline

    monkeypatch.setattr(roofline, "_stream", lambda *_: pytest.fail("the stream measured"))
    measured: list[str] = []
    monkeypatch.setattr(roofline, "_gemm", lambda device, dtype: measured.append(dtype) or (150.0, 1024))
    work = Work(bytes=1.0, flops={"float32": 1e10, "bfloat16": 0.0})  # 200 GFLOP/s; no bf16 FLOP counted
    assert _limits(peak=100.0).recheck([(work, 0.05)]) == ["float32 GEMM 100.0 -> 150.0 GFLOP/s"]
    assert measured == ["float32"]


def test_a_figure_needs_time_and_a_tie_is_memory_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfgate.roofline as roofline

    monkeypatch.setattr(roofline, "_gemm", lambda device, dtype: pytest.fail(f"{dtype}'s peak measured"))
    lim = _limits()  # 10 GB/s, 100 GFLOP/s
    assert lim.figure(Work(bytes=1e9), seconds=0.0) is None
    tie = lim.figure(Work(bytes=1e9, flops={"float32": 1e10}), seconds=0.2)  # least 0.1 s either way
    assert tie.bound == "memory" and tie.fraction == pytest.approx(0.5)
    compute = lim.figure(Work(bytes=1e9, flops={"float32": 5e10, "bfloat16": 0.0}), seconds=1.0)  # no bf16 peak
    assert compute.bound == "compute" and compute.fraction == pytest.approx(0.5)


def test_the_round_trip_kept_is_the_nearest_read_and_makes_no_limits_file(tmp_path: Path) -> None:
    path = tmp_path / LIMITS_FILE
    lim = Limits("cpu", "cpu-x", path)
    for ns, kept in ((80.0, 80.0), (0.0, 80.0), (float("inf"), 80.0), (120.0, 80.0), (60.0, 60.0)):
        lim.note_round_trip(ns)
        assert lim.round_trip_ns == kept, ns
    lim.save()
    assert not lim.dirty and not path.exists()  # nothing measured: no file of a round trip alone
    lim.values["stream_gbps"], lim.dirty = 10.0, True
    lim.save()
    assert not lim.dirty  # written: nothing left to write
    stored = Limits("cpu", "cpu-x", path)
    stored.note_round_trip(50.0)  # joins the stored file
    assert stored.dirty and read_limits(path, "cpu-x")["round_trip_ns"] == 60.0
    stored.save()
    assert read_limits(path, "cpu-x")["round_trip_ns"] == 50.0


def test_the_limits_line_names_each_limit_measured() -> None:
    from perfgate.roofline import limits_line

    assert limits_line({"stream_gbps": None, "gemm_gflops": {"float32": 1.0}}) == "no limits measured"
    assert limits_line({"stream_gbps": 10.0}) == "stream 10.0 GB/s"
    values = {"stream_gbps": 34.06, "fill_gbps": 20.0, "gemm_gflops": {"float32": 134.4, "bfloat16": 500.0},
              "round_trip_ns": 85.4}
    assert limits_line(values) == ("stream 34.1 GB/s (writes 20.0), bfloat16 GEMM 500.0 GFLOP/s, "
                                   "float32 GEMM 134.4 GFLOP/s, threads' round trip 85 ns")
    # the write rate: a fill's, or the written share of a stream pass measured faster
    assert write_rate({**values, "scale_gbps": 41.0, "copy_gbps": 30.0, "triad_gbps": 66.0}) == 22.0
    assert write_rate({**values, "scale_gbps": 30.0}) == 20.0 and write_rate({"scale_gbps": 30.0}) is None
    copy_best = {**values, "scale_gbps": 30.0, "copy_gbps": 50.0, "triad_gbps": 60.0}
    assert write_rate(copy_best) == 25.0  # a copy's half


def test_the_measured_rates_count_what_each_pass_moves_at_its_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream passes move 2, 2, 3 and 1 arrays of 2**25 float32 a call; a GEMM of n x n 2n^3
    FLOPs, n doubling from 256 until a product takes 50 ms or n reaches 4096 on a CPU."""
    import perfgate.roofline as roofline

    class Timer:
        def block(self, timed: tuple, calls: int) -> list[float]:
            return [0.3, 0.1, 0.2][:calls]

    monkeypatch.setattr(roofline, "timer_for", lambda device: Timer())
    assert roofline._best(lambda: None, "cpu") == 0.1
    monkeypatch.setattr(roofline, "_best", lambda fn, device, calls=5: 0.1)
    n = 4 * 2**25 / 0.1 / 1e9  # GB/s of one array read or written a call
    monkeypatch.setattr(roofline, "_streamed_fill", lambda: None)  # not built: torch's fill and memset
    assert roofline._stream("cpu") == pytest.approx({"scale": 2 * n, "copy": 2 * n, "triad": 3 * n, "fill": n})
    # the fill is the faster of torch's and libc's memset, of a non-zero byte over the whole array
    # on the session's threads, a block each, cut at page boundaries, covering the array
    memsets: list[tuple[int, int, int]] = []
    monkeypatch.setattr(roofline, "_libc_memset", lambda: lambda at, byte, size: memsets.append((at, byte, size)))
    monkeypatch.setattr(roofline, "_best", lambda fn, device, calls=5: 0.05 if fn() is None else 0.1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert roofline._stream("cpu")["fill"] == pytest.approx(2 * n)
    blocks = sorted(memsets)
    assert len(blocks) == 3 and {byte for _, byte, _ in blocks} == {0x3F}
    ends = [at + size for at, _, size in blocks]
    assert ends[:-1] == [at for at, _, _ in blocks[1:]]  # each block starts where the last ended
    assert sum(size for _, _, size in blocks) == 4 * 2**25 and all(at % 4096 == 0 for at in ends[:-1])
    assert roofline._stream("meta")["fill"] == pytest.approx(n) and len(memsets) == 3  # a device: torch's only
    # streaming stores over the whole array on torch's threads, where built: the fastest of the three here
    streamed: list[tuple[int, int, int, int]] = []
    monkeypatch.setattr(roofline, "_streamed_fill", lambda: lambda *call: streamed.append(call))
    monkeypatch.setattr(roofline, "_best", lambda fn, device, calls=5: 0.025 if fn() is None and streamed else 0.1)
    assert roofline._stream("cpu", 64 << 20)["fill"] == pytest.approx(2 * n)  # half the bytes, a quarter the time
    ((address, nbytes, byte, threads),) = set(streamed)
    assert address % 64 == 0 and nbytes == 64 << 20 and byte == 0x3F and threads == 3
    sizes: list[int] = []

    def best(fn: Any, device: str, calls: int = 5) -> float:
        sizes.append(fn.__defaults__[0].shape[0])  # the product's x
        return seconds

    monkeypatch.setattr(roofline, "_best", best)
    monkeypatch.setattr(torch, "randn", lambda *shape, device: torch.empty(*shape, device=device))
    seconds = 0.05  # the first product takes 50 ms: n stays 256
    assert roofline._gemm("cpu", "float32") == (pytest.approx(2 * 256**3 / 0.05 / 1e9), 256) and sizes == [256]
    sizes.clear()
    seconds = 1e-3
    assert roofline._gemm("cpu", "float32") == (pytest.approx(2 * 4096**3 / 1e-3 / 1e9), 4096)
    assert sizes == [256, 512, 1024, 2048, 4096]


def test_limits_are_stored_read_back_and_checked(tmp_path: Path) -> None:
    path = tmp_path / LIMITS_FILE
    lim = _limits()
    lim.path, lim.dirty = path, True
    lim.save()
    again = Limits("cpu", "cpu-x", path)
    assert again.stream_gbps == 10.0 and again.peak("float32") == 100.0 and not again.dirty  # nothing re-measured
    with pytest.raises(BadLimits, match="of fingerprint cpu-y"):
        Limits("cpu", "cpu-y", path)  # another machine's
    damaged = [{"stream_gbps": -1.0}, {"gemm_gflops": None}, {"gemm_gflops": [1]}, {"fill_gbps": "fast"},
               {"stream_gbps": True}, {"gemm_gflops": {"float32": float("nan")}}, {"round_trip_ns": 0},
               {"stream_gbps": float("inf")}, {"version": 0}]
    for damage in ("{", json.dumps([1]), *(json.dumps({**again.values, **d}) for d in damaged)):
        path.write_text(damage)
        with pytest.raises(BadLimits, match=str(path)):
            read_limits(path, "cpu-x")
    assert Limits("cpu", "cpu-x", path, remeasure=True).values["stream_gbps"] is None  # the file is not read
    path.write_text(json.dumps({"version": again.values["version"], "slug": "cpu-x"}))  # nothing measured yet
    bare = read_limits(path, "cpu-x")
    assert bare["stream_gbps"] is None and bare["gemm_gflops"] == {}


def test_a_gemm_peak_is_measured_once_and_needs_a_float_dtype() -> None:
    lim = Limits("cpu", "cpu-x", None)
    peak = lim.peak("float32")
    assert peak > 0 and lim.values["gemm_n"]["float32"] >= 256 and lim.dirty
    assert lim.peak("float32") == peak
    with pytest.raises(ValueError, match="dtype 'int32'"):
        lim.peak("int32")


SUITE = """
import pytest, torch

A, B = torch.randn(256, 256), torch.randn(256, 256)

@pytest.mark.speedup(cpu=0.01)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_mm(perf, impl):
    perf((lambda: A @ B) if impl == "optimized" else (lambda: (A.double() @ B.double()).float()), label="256^2")
"""


@pytest.mark.timed
def test_a_session_prints_and_stores_each_impls_place(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mm=SUITE)
    args = ["--perf-device", "cpu", "--benchmark-max-time=0.05", "-p", "no:cacheprovider", "--perf-contended=inf"]
    result = pytester.runpytest(*args, "--benchmark-json=out.json")
    assert result.ret == 0, result.stdout.str()
    result.stdout.re_match_lines([r"perfgate roofline at .*stream [\d.]+ GB/s \(writes [\d.]+\), "
                                  r"float32 GEMM [\d.]+ GFLOP/s",
                                  r"mm\s+optimized\s+256\^2\s+[\d.]+\s+0\.8 \(0\.3\)\s+0\.034\s+.*\d+% flop"])
    section = json.loads((pytester.path / "out.json").read_text())["perfgate"]
    (entry,) = section["roofline"]["impls"]
    assert section["roofline"]["count_rule"] == COUNT_RULE
    assert entry["bytes"] == 3 * 4 * 256**2 and entry["flops"] == {"float32": 2 * 256**3}
    assert entry["written"] == 4 * 256**2
    least = 2 * 256**3 / (section["roofline"]["limits"]["gemm_gflops"]["float32"] * 1e9)
    assert entry["fraction"] == pytest.approx(least / (entry["ms"] / 1e3))
    (row,) = section["speedups"]
    assert row["roofline_bound"] == "compute" and row["roofline"] > 0
    # the limits are kept with the fingerprint; a damaged file is named, and replaced on request
    (stored,) = (pytester.path / ".benchmarks").glob(f"*/{LIMITS_FILE}")
    stored.write_text("{}")
    refused = pytester.runpytest(*args)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines([f"*{stored}: not perfgate's limits*--perf-remeasure-limits*"])
    again = pytester.runpytest(*args, "--perf-remeasure-limits")
    assert again.ret == 0, again.stdout.str()
    remeasured = read_limits(stored, section["slug"])
    assert remeasured["gemm_gflops"]["float32"] > 0 and 0 < remeasured["fill_gbps"], again.stdout.str()
    # a session that reads the stored limits reads the stream once more after its rows, into its JSON
    read = pytester.runpytest(*args, "--benchmark-json=read.json")
    assert read.ret == 0, read.stdout.str()
    now = json.loads((pytester.path / "read.json").read_text())["perfgate"]["roofline"]["now"]
    assert now["stream_gbps"] > 0 and now["write_gbps"] > 0 and now["measured"], now


def test_a_limit_the_tables_median_passes_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's figure is at the row's interleaved pairs' median, the section's at the impl's
    own rounds': a limit either passes is measured again before any figure is made."""
    import perfgate.roofline as roofline
    from perfgate.state import GateState, Measurement, Probes, Settings

    settings = Settings(device="cpu", size="smoke", threads=2, tolerance=0.2, fingerprint={}, slug="s")
    st = GateState(settings, Probes(None, None, 2), limits=_limits(stream=10.0))
    work = Work(bytes=1e9)  # 0.1 s at the stored 10 GB/s
    pairs = [(0.4, 0.08)] * 10  # the pairs' median call: 0.08 s, past the limit
    st.results["k"] = {"reference": Measurement([0.4] * 10, "smoke", "", None),
                       "optimized": Measurement([0.2] * 10, "smoke", "", None, paired=pairs, work=work)}
    row = st._row("k", "optimized")
    assert row.optimized_ms == pytest.approx(80.0)
    rates = {"scale": 12.5, "copy": 11.0, "triad": 11.0, "fill": 8.0}
    monkeypatch.setattr(roofline, "_stream", lambda *_: dict(rates))
    st.recheck_limits([row])  # the own rounds' median (0.2 s, 50%) alone would not have measured it
    assert st.tally.limits_rose == ["stream 10.0 -> 12.5 GB/s"] and st.limits.stream_gbps == 12.5


def test_a_session_reads_the_stream_once_after_its_rows_and_says_how_far_under_its_limits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The limits are the best the machine has shown; the session reads the stream again after its
    rows, once, where a figure is placed by bytes, and says what share of the limits it read. A
    reading under them changes no limit (nor the file); one past them raises them."""
    import perfgate.roofline as roofline
    from perfgate.report import _roofline_markdown
    from perfgate.state import GateState, Measurement, Probes, Settings

    def session(limits: Limits, work: Work) -> tuple[GateState, list]:
        settings = Settings(device="cpu", size="smoke", threads=2, tolerance=0.2, fingerprint={}, slug="s")
        st = GateState(settings, Probes(None, None, 2), limits=limits)
        st.results["k"] = {"reference": Measurement([0.4] * 10, "smoke", "", None),
                           "optimized": Measurement([0.2] * 10, "smoke", "", None, paired=[(0.4, 0.2)] * 10,
                                                    work=work)}
        return st, [st._row("k", "optimized")]

    calls: list[str] = []
    rates = {"scale": 20.0, "copy": 18.0, "triad": 15.0, "fill": 12.0}
    monkeypatch.setattr(roofline, "_stream", lambda device, _: calls.append(device) or dict(rates))
    stored = _limits(stream=40.0, fill=30.0)
    stored.values.update(scale_gbps=40.0, copy_gbps=35.0, triad_gbps=30.0)  # each pass's best, as a file keeps
    st, rows = session(stored, Work(bytes=1e9, written=5e8))  # 5 GB/s: 12% of the stream
    st.recheck_limits(rows)
    assert calls == ["cpu"] and st.tally.limits_rose == [] and not st.limits.dirty
    assert st.limits.now["stream_gbps"] == 20.0 and st.limits.now["write_gbps"] == 12.0  # the fill's: writes alone
    assert st.limits.stream_gbps == 40.0 and st.limits.write_gbps == 30.0  # the limits keep their best
    line = "this session's host, read after its rows: stream 20.0 GB/s (writes 12.0), 50% and 40% of the limits"
    assert roofline.now_line(st.limits.values, st.limits.now) == line
    st.recheck_limits(rows)
    assert calls == ["cpu"]  # once a session
    # the report says it under the run's roofline heading; a run stored without one says nothing of it
    placed = {"kernel": "k", "impl": "optimized", "label": "", "ms": 200.0, "bytes": 1e9, "written": 5e8,
              "flops": {}, "fraction": 0.125, "bound": "memory", "gbps": 5.0, "gflops": None, "note": None}
    section = {"limits": st.limits.values, "impls": [placed], "count_rule": COUNT_RULE}
    said = _roofline_markdown({**section, "now": st.limits.now})
    assert f"Read against the best this machine has shown: {line}." in said
    assert not any("this session's host" in cell for cell in _roofline_markdown(section))
    assert st.limits.values["measured"] == {}  # no time stamped: the file stays as it was
    # a reading past the stored limits raises them: said apart from a recheck's, and written to the file
    st, rows = session(_limits(stream=10.0, fill=5.0), Work(bytes=1e9))
    st.recheck_limits(rows)
    assert st.tally.limits_read == ["stream 10.0 -> 20.0 GB/s", "write rate 5.0 -> 12.0 GB/s"] and st.limits.dirty
    assert st.tally.limits_rose == [] and st.limits.values["measured"]["stream"] == st.limits.now["measured"]
    assert roofline.now_line(st.limits.values, st.limits.now) is None  # it reached them
    # one pass's best rising (a copy) moves neither limit a figure reads: the file stays as it was
    stored = _limits(stream=40.0, fill=30.0)
    stored.values.update(scale_gbps=40.0, copy_gbps=10.0, triad_gbps=30.0)
    st, rows = session(stored, Work(bytes=1e9))
    st.recheck_limits(rows)
    assert st.tally.limits_read == [] and not st.limits.dirty and st.limits.values["copy_gbps"] == 10.0
    # a session whose recheck measured the stream takes no second reading; one of FLOPs alone takes none
    calls.clear()
    st, rows = session(_limits(stream=1.0, fill=0.5), Work(bytes=1e9))  # 5 GB/s passed 1: measured again
    st.recheck_limits(rows)
    assert calls == ["cpu"] and st.limits.now["stream_gbps"] == 20.0
    st, rows = session(_limits(), Work(bytes=0.0, flops={"float32": 1e9}))
    st.recheck_limits(rows)
    assert calls == ["cpu"] and st.limits.now is None
    # a reading the limits lack, or one not a rate (a damaged run file), says nothing
    assert roofline.now_line({"stream_gbps": None}, {"stream_gbps": 5.0}) is None
    assert roofline.now_line(st.limits.values, {"stream_gbps": "fast"}) is None
    assert roofline.now_line({"stream_gbps": 10.0}, {"stream_gbps": 5.0, "write_gbps": 2.0}) == (
        "this session's host, read after its rows: stream 5.0 GB/s, 50% of the limit")  # no write rate stored
    assert "99% of the limit" in roofline.now_line({"stream_gbps": 10.0}, {"stream_gbps": 9.999})  # not "100%"


@pytest.mark.timed
def test_a_session_says_what_its_reading_after_the_rows_read_and_raised(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading after the rows, in the terminal: under the stored limits, its share of them;
    past them, the limits it raised, said apart from an impl's recheck; into the run's JSON."""
    import perfgate.roofline as roofline

    pytester.makepyfile(test_mm=SUITE)
    args = ["--perf-device", "cpu", "--benchmark-max-time=0.05", "-p", "no:cacheprovider", "--perf-contended=inf"]
    monkeypatch.setattr(roofline, "_gemm", lambda device, dtype: (1e6, 256))  # no matmul passes it
    for rates, lines in [({"scale": 100.0, "copy": 90.0, "triad": 90.0, "fill": 50.0}, []),  # measured first
                         ({"scale": 200.0, "copy": 90.0, "triad": 90.0, "fill": 120.0},
                          ["perfgate roofline: the session's reading after its rows passed a stored limit, kept "
                           "as the best this machine has shown: stream 100.0 -> 200.0 GB/s, write rate 50.0 -> "
                           "120.0 GB/s"]),
                         ({"scale": 50.0, "copy": 40.0, "triad": 30.0, "fill": 30.0},
                          ["perfgate roofline: this session's host, read after its rows: stream 50.0 GB/s (writes "
                           "30.0), 25% and 25% of the limits (a figure reads against the best this machine has "
                           "shown; the host gave this share of it when read)"])]:
        monkeypatch.setattr(roofline, "_stream", lambda device, nbytes, rates=rates: dict(rates))
        result = pytester.runpytest(*args, "--benchmark-json=out.json")
        assert result.ret == 0, result.stdout.str()
        said = [line for line in result.stdout.lines if line.startswith("perfgate roofline: ")]
        assert said == lines, result.stdout.str()
        now = json.loads((pytester.path / "out.json").read_text())["perfgate"]["roofline"]["now"]
        assert now["stream_gbps"] == rates["scale"]


def test_a_compiled_optimizer_step_counts_the_ops_its_python_runs() -> None:
    """A compiled optimizer step runs inductor's kernels, which no dispatch mode sees, even under
    one: it is counted as its Python runs eagerly (the function's least work: read p, g and the
    momentum, write p and the momentum, as the fused step), and runs compiled again after the count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ps = [torch.randn(100, requires_grad=True) for _ in range(2)]
    for p in ps:
        p.grad = torch.randn(100)
    step = torch.compile(torch.optim.SGD(ps, lr=0.1, momentum=0.9).step)
    step(), step()  # compiled for steps with a momentum buffer
    seen: list = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.append(func)
            return func(*args, **(kwargs or {}))

    assert count_work(step).bytes == 4 * 100 * 5 * 2
    with Seen():
        step()
    assert seen == []  # inductor's kernels again: the count's stance is its own


def test_an_empty_view_with_rows_spans_nothing() -> None:
    """y[:, :0] holds no element, though its strides reach from y's first row to its last: it
    widens no union of the views read beside it."""
    y = torch.randn(10, 10)
    rows = lambda: (y[:, :0].sum(), y[5:].sum(), y[5:].flatten().sum())
    assert count_work(rows).bytes == 200 + 3 * 4  # y[5:] read once (two views, one span), three sums


def test_views_with_one_start_and_shape_but_other_strides_are_two_views() -> None:
    x = torch.randn(100)
    rows, cols = x[:50].view(10, 5), x.view(10, 10)[:, :5]  # both (10, 5) from x's first byte
    # rows span [0, 200), cols (strided) [0, 380): their union, 380, is less than their elements' 400
    assert count_work(lambda: (rows.sum(), cols.sum())).bytes == 380 + 2 * 4


def test_an_array_of_storage_the_call_wrote_whole_reads_nothing_more() -> None:
    """Arrays of out from the first written byte, to the last, and over two adjoining copies: the
    copies' writes count, nothing is read again."""
    x, out = torch.randn(10, 10), torch.empty(10, 10)
    after = lambda: (out[:5].copy_(x[:5]), out[5:].copy_(x[5:]), out[:2].numpy(), out[8:].numpy(), out.numpy())
    assert count_work(after).bytes == 400 + 400  # x read, out written
    call = lambda: (out[:5].copy_(x[:5]), out.mul_(2), out.numpy().sum())  # out written whole, in place
    assert count_work(call).bytes == 200 + 200 + 400  # x[:5] read, out[5:] read, out written


def test_a_read_beside_rows_written_counts_its_own_rows_only() -> None:
    x, out = torch.randn(10, 10), torch.empty(10, 10)
    assert count_work(lambda: (out[8:].copy_(x[8:]), out[:5].sum())).bytes == 2 * 80 + 200 + 4  # written after it
    assert count_work(lambda: (out[:1].copy_(x[:1]), out[5:].sum())).bytes == 2 * 40 + 200 + 4  # written before it
    # runs written across the end of the read and past it: only out[10:15] is read
    x, out = torch.randn(100), torch.empty(100)
    runs = lambda: (out[15:50].copy_(x[15:50]), out[75:].copy_(x[75:]), out[10:40].sum())
    assert count_work(runs).bytes == 2 * 4 * (35 + 25) + 4 * 5 + 4  # x read, out written, out[10:15] read, a sum


def test_what_a_read_adds_beside_a_strided_one_is_its_bytes_not_yet_written() -> None:
    x, out = torch.randn(10, 10), torch.empty(10, 10)
    call = lambda: (out[:, 0].sum(), out[:5].copy_(x[:5]), out.sum())
    # out read: the column's 40 and rows 5-9's 200 (less than their union, 400); x[:5] read,
    # out[:5] written; two sums
    assert count_work(call).bytes == (40 + 200) + 200 + 200 + 2 * 4
    # rows written, then written again through another view: no more written (beside a strided column, whose
    # elements count, not its span)
    call = lambda: (out[:, 0].copy_(x[:, 0]), out[9:].copy_(x[9:]), out[9:].view(2, 5).mul_(2))
    assert count_work(call).bytes == 2 * (40 + 40)  # x read and out written: the column's 40 and row 9's 40


def test_a_broadcast_fills_its_span_and_a_view_that_repeats_and_skips_does_not() -> None:
    """A broadcast's elements repeat and reach every byte of its span: after out[:32] is written,
    out.expand(8, 64) reads out[32:] only. A view whose elements repeat and leave gaps (offsets 0,
    2, 0, 2) is read whole unless written whole."""
    out, b = torch.empty(64), torch.randn(64)
    call = lambda: (out[:32].copy_(b[:32]), out.expand(8, 64).sum())
    assert count_work(call).bytes == 128 + 128 + 128 + 4  # b[:32] read, out[:32] written, out[32:] read, a sum
    gaps = out[:3].as_strided((2, 2), (0, 2))  # elements 0, 2, 0, 2 of out: a span of 3, element 1 not read
    call = lambda: (out[:1].copy_(b[:1]), gaps.sum())
    assert count_work(call).bytes == 4 + 4 + 12 + 4  # b[0] read, out[0] written, the span of gaps read, a sum


def test_fill_and_zero_overwrite_without_reading() -> None:
    out = torch.empty(10, 10)
    assert count_work(lambda: (out.fill_(1.0), out.sum())).bytes == 400 + 4  # out written, a sum
    assert count_work(lambda: (out.zero_(), out.sum())).bytes == 400 + 4


def test_a_storage_two_tensors_share_is_one_until_both_die() -> None:
    """Two tensors over one numpy array are two storages at one address: the first one's death
    leaves the address's storage alive, so the second is read once however often."""
    import numpy as np

    def call() -> Any:
        array = np.ones(256, dtype=np.float32)  # memory no op made
        a, b = torch.from_numpy(array), torch.from_numpy(array)
        s = a.sum() + b.sum()
        del a
        return s, b * 2

    assert count_work(call).bytes == 1024 + 4 + 1024  # the array read once, the sum and the product written


@pytest.mark.usefixtures("real_last_level_cache")
def test_the_stream_arrays_are_twice_the_last_level_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """128 MiB an array, or on a CPU twice its last-level cache where larger (a 300 MiB L3: 600 MiB),
    at most a sixth of the available memory; a stored file measured over smaller arrays than this
    host needs has its stream rates measured again (its GEMM peaks kept), one measured over large
    enough arrays not."""
    import perfgate.roofline as roofline
    import perfgate.timing as timing

    read = {"cache size": "307200 KB"}  # /proc/cpuinfo's first processor, as the Xeon 207's
    monkeypatch.setattr(roofline, "_cpuinfo_first", lambda: read)
    assert roofline.last_level_cache() == 300 << 20
    for field, size in (("512 KB", 512 << 10), ("32 MB", 32 << 20), ("unknown", 0), ("", 0)):
        roofline.last_level_cache.cache_clear()
        monkeypatch.setitem(read, "cache size", field)
        assert roofline.last_level_cache() == size, field
    roofline.last_level_cache.cache_clear()
    monkeypatch.setitem(read, "cache size", "307200 KB")
    monkeypatch.setattr(timing, "MEMINFO", tmp_path / "meminfo")
    assert roofline.stream_bytes("cpu") == 600 << 20 and roofline.stream_bytes("cuda") == 128 << 20  # no meminfo
    (tmp_path / "meminfo").write_text("MemTotal: 25000000 kB\nMemAvailable:    1536000 kB\n")
    assert roofline.stream_bytes("cpu") == 250 << 20  # a sixth of 1.5 GB, whole MiB
    (tmp_path / "meminfo").write_text("MemAvailable: 600000 kB\n")
    assert roofline.stream_bytes("cpu") == 128 << 20  # never under 128 MiB
    roofline.last_level_cache.cache_clear()
    monkeypatch.setattr(roofline, "_cpuinfo_first", lambda: {})  # another OS: none named
    assert roofline.last_level_cache() == 0 and roofline.stream_bytes("cpu") == 128 << 20

    lim = _limits()
    lim.path, lim.dirty = tmp_path / LIMITS_FILE, True
    lim.save()  # no stream_bytes: measured over 128 MiB arrays
    monkeypatch.setattr(roofline, "stream_bytes", lambda device: 600 << 20)
    sizes: list[int] = []
    rates = {"scale": 30.0, "copy": 20.0, "triad": 21.0, "fill": 15.0}
    monkeypatch.setattr(roofline, "_stream", lambda device, nbytes: sizes.append(nbytes) or dict(rates))
    again = Limits("cpu", "cpu-x", lim.path)
    assert again.peak("float32") == 100.0 and sizes == []  # the GEMM peak kept
    assert again.stream_gbps == 30.0 and sizes == [600 << 20]  # the stored 10.0 dropped: measured anew
    again.save()
    assert json.loads(lim.path.read_text())["stream_bytes"] == 600 << 20
    assert Limits("cpu", "cpu-x", lim.path).stream_gbps == 30.0 and sizes == [600 << 20]  # large enough: kept
    # the memory cap moves with the minute: arrays over half this session's size are kept, and the size
    # a session measures over is the one it decided at its start
    values = json.loads(lim.path.read_text())
    lim.path.write_text(json.dumps({**values, "stream_bytes": 301 << 20}))
    assert Limits("cpu", "cpu-x", lim.path).stream_gbps == 30.0 and sizes == [600 << 20]
    lim.path.write_text(json.dumps({**values, "stream_bytes": 300 << 20}))
    half = Limits("cpu", "cpu-x", lim.path)
    monkeypatch.setattr(roofline, "stream_bytes", lambda device: 500 << 20)
    assert half.stream_gbps == 30.0 and sizes == [600 << 20, 600 << 20]
    values = json.loads(lim.path.read_text())
    for bad in (0, -1, 1.5, "600", True):
        lim.path.write_text(json.dumps({**values, "stream_bytes": bad}))
        with pytest.raises(BadLimits, match="stream_bytes"):
            Limits("cpu", "cpu-x", lim.path)


def test_the_streamed_fill_writes_every_byte_and_refuses_what_it_cannot() -> None:
    """perfgate._streamfill (where built with streaming stores): the byte over the whole range on
    any number of threads; an address or size off a 64-byte line, a byte past 255 or no thread
    refused, naming what would work."""
    import torch

    import perfgate.roofline as roofline

    fill = roofline._streamed_fill()
    if fill is None:
        pytest.skip("perfgate._streamfill not built here, or built without streaming stores")
    t = torch.zeros(3 << 20, dtype=torch.uint8)
    start = -(-t.data_ptr() // 64) * 64
    for threads, byte in ((1, 0x3F), (2, 0x01), (7, 0xFF)):
        fill(start, (2 << 20) + 64 * 3, byte, threads)
        written = t[start - t.data_ptr():][: (2 << 20) + 64 * 3]
        assert bool((written == byte).all()) and int(t[start - t.data_ptr() + (2 << 20) + 64 * 3]) == 0
    for bad in ((start + 1, 64, 1, 1), (start, 65, 1, 1), (start, 64, 256, 1), (start, 64, 1, 0)):
        with pytest.raises(ValueError, match="multiples of 64, byte 0-255, threads 1-"):
            fill(*bad)
