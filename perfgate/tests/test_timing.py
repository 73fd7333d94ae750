"""The timing harness (perfgate.timing) without a GPU: its block arithmetic driven by a simulated
asynchronous device whose clock is injected, the GPU facts parsed from canned nvidia-smi output,
and the fingerprint's keys. The CUDA clock itself is checked where CUDA exists."""

from __future__ import annotations

import gc
import os

import pytest

from perfgate.fingerprint import SMI_FIELDS, fingerprint, slug, smi_facts
from perfgate.timing import HostClock, Timer, interleaved

pytestmark = pytest.mark.timed  # perf sessions and clocks: run alone (make correctness)

US = 1e-6


class AsyncDevice:
    """A host that queues work on a device, as CUDA does: a launch costs the host ``launch_s`` and
    the kernel runs once the device is free; an event takes its time when the device reaches it;
    a synchronize waits for the device and costs ``sync_s`` more."""

    def __init__(self, launch_s: float, sync_s: float) -> None:
        self.launch_s, self.sync_s = launch_s, sync_s
        self.host = 0.0  # the host's clock
        self.free = 0.0  # when the device has run everything queued
        self.syncs = 0

    def launch(self, kernel_s: float) -> None:
        self.host += self.launch_s
        self.free = max(self.free, self.host) + kernel_s

    def synchronize(self) -> None:
        self.host = max(self.host, self.free) + self.sync_s
        self.syncs += 1


class EventClock:
    """``CudaEventClock``'s contract on the simulated device: a mark is an event in the queue."""

    name = "simulated events"

    def __init__(self, device: AsyncDevice) -> None:
        self.device = device

    def ready(self, marks: int) -> None:
        pass

    def mark(self) -> float:
        d = self.device
        d.free = max(d.free, d.host)  # the event is reached after the work queued before it
        return d.free

    def wait(self) -> None:
        self.device.synchronize()

    def seconds(self, start: float, end: float) -> float:
        return end - start


def kernel(device: AsyncDevice, seconds: float):
    return lambda *args: device.launch(seconds)


def synced_on_host(device: AsyncDevice, seconds: float) -> list[float]:
    """What a host clock around each call with a synchronize after it reads (the old design)."""
    run = kernel(device, seconds)

    def call() -> None:
        run()
        device.synchronize()

    return Timer(HostClock(lambda: device.host)).block((call, None), calls=8)


def test_events_read_the_kernel_where_a_synchronize_per_call_adds_its_overheads() -> None:
    """GPU-bound (a kernel longer than its launch): each event pair reads the kernel's time, so a
    2x faster kernel reads 2.00x; a host clock with a synchronize per call adds the launch and
    the synchronize to both sides and reads the same pair 1.67x."""
    dev = AsyncDevice(launch_s=5 * US, sync_s=20 * US)
    timer = Timer(EventClock(dev))
    slow, fast = timer.block((kernel(dev, 100 * US), None), 8), timer.block((kernel(dev, 50 * US), None), 8)
    assert slow == pytest.approx([100 * US] * 8) and fast == pytest.approx([50 * US] * 8)
    old_slow, old_fast = synced_on_host(dev, 100 * US), synced_on_host(dev, 50 * US)
    assert old_slow == pytest.approx([125 * US] * 8) and old_fast == pytest.approx([75 * US] * 8)
    assert slow[0] / fast[0] == pytest.approx(2.0) and old_slow[0] / old_fast[0] == pytest.approx(125 / 75)


def test_a_block_waits_for_the_device_once() -> None:
    dev = AsyncDevice(launch_s=5 * US, sync_s=20 * US)
    timer = Timer(EventClock(dev))
    for calls in (1, 8, 100):
        before = dev.syncs
        assert len(timer.block((kernel(dev, 10 * US), None), calls, warm=2)) == calls
        assert dev.syncs - before == 1


def test_setup_and_the_l2_flush_are_outside_the_reading() -> None:
    """A setup and a flush each queue long work before the call: neither is in its reading."""
    dev = AsyncDevice(launch_s=5 * US, sync_s=20 * US)
    flushes = []
    timer = Timer(EventClock(dev), flush=lambda: (flushes.append(1), dev.launch(2000 * US)))
    setup = lambda: dev.launch(1000 * US)
    times = timer.block((kernel(dev, 100 * US), setup), calls=4, warm=1)
    assert times == pytest.approx([100 * US] * 4) and len(flushes) == 5  # the warming call flushes too


def test_launch_bound_reads_the_launch_interval_and_a_flush_leaves_the_kernel() -> None:
    """A kernel shorter than its launch: back to back, each start event is reached as the call
    before ends and each kernel waits for its launch, so a call reads the launch interval, what
    a loop of such calls costs per call (the warming call takes the first, idle start). With the
    flush keeping the device busy while the host queues the call, only the kernel is read, as
    triton.testing.do_bench reads it. The gap is launch cost, which CUDA graphs remove (the perf
    suite's ``+cudagraphs`` rows)."""
    dev = AsyncDevice(launch_s=10 * US, sync_s=20 * US)
    assert Timer(EventClock(dev)).block((kernel(dev, 2 * US), None), 4) == pytest.approx([10 * US] * 4)
    assert Timer(EventClock(dev)).block((kernel(dev, 2 * US), None), 4, warm=0)[0] == pytest.approx(12 * US)
    flushed = Timer(EventClock(dev), flush=lambda: dev.launch(80 * US))
    assert flushed.block((kernel(dev, 2 * US), None), 4) == pytest.approx([2 * US] * 4)


def test_host_clock_reads_each_call_and_not_its_setup() -> None:
    """CPU: a host clock read before and after each call; the warming calls and setups unread."""
    now = [0.0]
    calls = []

    def fn(x: int) -> int:
        now[0] += 0.001 * x
        calls.append(x)
        return x

    xs = iter(range(1, 10))
    setup = lambda: (now.__setitem__(0, now[0] + 5.0), next(xs))[1]  # a 5 s setup, unread
    times, last = Timer(HostClock(lambda: now[0])).rounds((fn, setup), calls=3, warm=2)
    assert times == pytest.approx([0.003, 0.004, 0.005]) and calls == [1, 2, 3, 4, 5] and last == 5


def test_garbage_collection_is_off_during_a_block_when_asked() -> None:
    """--benchmark-disable-gc, as pedantic honoured it: off inside the block, back on after."""
    seen = []
    timed = (lambda: seen.append(gc.isenabled()), None)
    Timer(HostClock(), disable_gc=True).block(timed, 3)
    Timer(HostClock()).block(timed, 3)
    assert seen == [False] * 4 + [True] * 4 and gc.isenabled()


def test_interleaved_pairs_alternate_abba_on_the_timer() -> None:
    order = []
    clock = HostClock(lambda: float(len(order)))
    ref = (lambda: order.append("r"), None)
    opt = (lambda: (order.append("o"), order.append("o")), None)  # two ticks a call: read 2x slower
    pairs = interleaved(Timer(clock), ref, opt, rounds=2, calls=(1, 1))
    assert "".join(order) == "rroooo" + "oooorr"  # warming + timed call a side; impl first in round 1
    assert pairs == [(1.0, 2.0), (1.0, 2.0)]


SMI = "GPU-aaaa, 570.86.15, Disabled, 1755, 700.00\nGPU-bbbb, 570.86.15, Enabled, [N/A], 350.00\n"


def test_an_nvidia_smi_that_fails_is_an_error_one_that_is_absent_is_none(monkeypatch) -> None:
    """No nvidia-smi: its facts read None on every run alike. One that is installed but fails or
    hangs: an error, not None this time only (the fingerprint's folder would change, the stored
    baseline go unfound, and the session pass ungated); a failure once is retried."""
    import subprocess

    from perfgate.fingerprint import _run_smi

    def absent(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", absent)
    assert _run_smi(["-L"]) is None
    calls = []

    def hangs_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise subprocess.TimeoutExpired("nvidia-smi", 30)
        return subprocess.CompletedProcess(args, 0, stdout="GPU 0\n", stderr="")

    monkeypatch.setattr(subprocess, "run", hangs_once)
    assert _run_smi(["-L"]) == "GPU 0\n" and len(calls) == 2

    def fails(*args, **kwargs):
        return subprocess.CompletedProcess(args, 9, stdout="", stderr="Unable to determine the device handle")

    monkeypatch.setattr(subprocess, "run", fails)
    with pytest.raises(RuntimeError, match=r"nvidia-smi is installed but failed 2 times \(exit 9: Unable"):
        _run_smi(["-L"])


def test_smi_facts_are_the_gpu_torch_names() -> None:
    run = lambda args: SMI
    assert smi_facts("aaaa", run) == {"driver": "570.86.15", "mig": "Disabled", "app_clock_mhz": "1755",
                                      "power_limit_w": "700.00"}
    assert smi_facts("bbbb", run) == {"driver": "570.86.15", "mig": "Enabled", "app_clock_mhz": None,
                                      "power_limit_w": "350.00"}
    # a uuid nvidia-smi does not list (a MIG slice) on a host with two GPUs: not guessed
    assert smi_facts("MIG-cccc", run) == dict.fromkeys(SMI_FIELDS)
    # ... with one GPU: the slice's parent
    assert smi_facts("MIG-cccc", lambda args: SMI.splitlines()[1])["mig"] == "Enabled"
    assert smi_facts("aaaa", lambda args: None) == dict.fromkeys(SMI_FIELDS)  # no nvidia-smi
    assert smi_facts("aaaa", lambda args: "garbage\n") == dict.fromkeys(SMI_FIELDS)


GPU = {"driver": "570.86.15", "mig": "Disabled", "app_clock_mhz": "1755", "power_limit_w": "700.00",
       "max_clock_mhz": 1980, "sms": 132, "fp32_matmul": "highest"}


def test_the_gpu_fingerprint_names_what_its_timings_depend_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fp = fingerprint("cuda", 16, "n/a", gpu=GPU)
    assert fp["gpu"] == GPU and fp["l2_flush"] is False
    assert "-drv570.86.15-" in slug(fp) and "l2flush" not in slug(fp)
    # a cold-cache run, another application clock, TF32 on: each has its own baseline folder
    flushed = fingerprint("cuda", 16, "n/a", l2_flush=True, gpu=GPU)
    clocked = fingerprint("cuda", 16, "n/a", gpu={**GPU, "app_clock_mhz": "1410"})
    tf32 = fingerprint("cuda", 16, "n/a", gpu={**GPU, "fp32_matmul": "high"})
    assert "-l2flush-" in slug(flushed)
    assert len({slug(fp), slug(flushed), slug(clocked), slug(tf32)}) == 4
    assert slug(fingerprint("cuda", 16, "n/a", gpu=dict(GPU))) == slug(fp)  # and the same facts, the same folder


def test_l2_flush_is_refused_off_cuda(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_p="""
import pytest
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_p(perf, impl):
    perf(lambda: None)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--perf-device", "cpu", "--perf-l2-flush")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-l2-flush overwrites a GPU's L2 cache*this session runs on cpu*"])


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda() and os.environ.get("PERFGATE_REQUIRE_CUDA") != "1",
                    reason="CUDA events and GPU facts need a CUDA device (PERFGATE_REQUIRE_CUDA=1: fail instead)")
def test_cuda_events_read_a_kernel_of_known_length() -> None:
    """torch.cuda._sleep spins a kernel for a number of cycles: twice the cycles read about twice
    the time, with no synchronize inside the block."""
    import torch

    from perfgate.fingerprint import gpu_facts
    from perfgate.timing import timer_for

    timer = timer_for("cuda")
    short = timer.block((lambda: torch.cuda._sleep(1_000_000), None), 8)
    long = timer.block((lambda: torch.cuda._sleep(2_000_000), None), 8)
    ratio = sorted(long)[4] / sorted(short)[4]
    assert 1.8 < ratio < 2.2, (short, long)
    flushed = timer_for("cuda", l2_flush=True).block((lambda: torch.cuda._sleep(1_000_000), None), 8)
    assert 0.8 < sorted(flushed)[4] / sorted(short)[4] < 1.25  # the flush is outside the reading
    facts = gpu_facts("cuda")
    assert set(SMI_FIELDS) <= set(facts) and facts["sms"] > 0
