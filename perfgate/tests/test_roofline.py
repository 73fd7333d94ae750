"""perfgate.roofline: the work a call is counted to do, the machine's limits, and a row's place
under them; then the roofline section and JSON of a perf session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfgate.roofline import COUNT_RULE, LIMITS_FILE, BadLimits, Limits, Work, count_work, read_limits

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_a_matmul_reads_its_inputs_writes_its_output_and_counts_2mnk() -> None:
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    work = count_work(lambda: a @ b)
    assert work.bytes == 4 * (32 * 64 + 64 * 16 + 32 * 16)
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
    assert work.bytes == 4 * 1000 * 3


def test_foreach_lists_and_out_buffers_are_seen() -> None:
    ps, gs = [torch.randn(100) for _ in range(3)], [torch.randn(100) for _ in range(3)]
    assert count_work(lambda: torch._foreach_add_(ps, gs)).bytes == 4 * 100 * 9  # read p, g; write p
    x, out = torch.randn(500), torch.empty(500)
    assert count_work(lambda: torch.mul(x, 2, out=out)).bytes == 4 * 500 * 2  # out= written, never read
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


def _limits(stream: float = 10.0, peak: float = 100.0) -> Limits:
    lim = Limits("cpu", "cpu-x", None)
    lim.values.update(stream_gbps=stream, gemm_gflops={"float32": peak})
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


def test_a_limit_a_call_passed_is_measured_again_once_and_never_lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfgate.roofline as roofline

    lim = _limits(stream=10.0, peak=100.0)
    rates = {"scale": 20.0, "copy": 12.0, "triad": 11.0, "fill": 9.0}
    monkeypatch.setattr(roofline, "_stream", lambda device: dict(rates))
    monkeypatch.setattr(roofline, "_gemm", lambda device, dtype: (80.0, 512))  # lower than the stored peak
    assert lim.recheck([(Work(bytes=1e9), 0.2)]) == [] and not lim.dirty  # 50% of the limit: nothing measured
    assert lim.recheck([(Work(bytes=1e9), 0.05)]) == ["stream 10.0 -> 20.0 GB/s"]  # 20 GB/s passed 10
    assert lim.stream_gbps == 20.0 and lim.values["fill_gbps"] == 9.0 and lim.dirty
    assert lim.figure(Work(bytes=1e9), 0.05).fraction == pytest.approx(1.0)
    monkeypatch.setattr(roofline, "_stream", lambda device: pytest.fail("the stream measured twice in a session"))
    assert lim.recheck([(Work(bytes=4e9), 0.05)]) == []  # once a session; still over: caches, or counted high
    assert lim.recheck([(Work(bytes=1.0, flops={"float32": 1e10}), 0.05)]) == []  # 200 GFLOP/s passed 100
    assert lim.peak("float32") == 100.0 and lim.rechecked == {"stream", "float32"}  # measured 80: kept 100
    calls = []
    monkeypatch.setattr(roofline, "_stream", lambda device: calls.append(device) or dict(rates))
    fresh = Limits("cpu", "cpu-x", None)  # a limit this session measured is not measured again
    assert fresh.recheck([(Work(bytes=1e12), 1.0)]) == [] and fresh.stream_gbps == 20.0 and calls == ["cpu"]


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
               {"stream_gbps": True}, {"gemm_gflops": {"float32": float("nan")}}, {"round_trip_ns": 0}]
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
    result.stdout.re_match_lines([r"perfgate roofline at .*stream [\d.]+ GB/s \(writes alone [\d.]+\), "
                                  r"float32 GEMM [\d.]+ GFLOP/s",
                                  r"mm\s+optimized\s+256\^2\s+[\d.]+\s+0\.8\s+0\.034\s+.*\d+% flop"])
    section = json.loads((pytester.path / "out.json").read_text())["perfgate"]
    (entry,) = section["roofline"]["impls"]
    assert section["roofline"]["count_rule"] == COUNT_RULE
    assert entry["bytes"] == 3 * 4 * 256**2 and entry["flops"] == {"float32": 2 * 256**3}
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
    monkeypatch.setattr(roofline, "_stream", lambda device: dict(rates))
    st.recheck_limits([row])  # the own rounds' median (0.2 s, 50%) alone would not have measured it
    assert st.tally.limits_rose == ["stream 10.0 -> 12.5 GB/s"] and st.limits.stream_gbps == 12.5
