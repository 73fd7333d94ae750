"""What the gate's host readings see, and what they do not (docs/gate.md, "A contended host").

    python -m evidence.host_contention probe            # the streaming probe, 100 readings
    python -m evidence.host_contention probe-streamed   # the same beside a copy loop on vCPU 1
    python -m evidence.host_contention pool             # the Standardizer after randomized_svd
    python -m evidence.host_contention sag 200          # the Standardizer's sag, in 200 windows
    python -m evidence.host_contention sag-probes 400   # beside probes that might see it
    python -m evidence.host_contention placement 1000   # beside the threads' round trip, which sees it
    python -m evidence.host_contention detect-streamed  # the gate's detection runs beside a copy loop

``probe``: perfgate's ``timing.Bandwidth`` on vCPU 0, 20 ms apart. ``pool``: the Standardizer
(10000 x 512 fp32, torch's default threads, cache malloc) alone, right after scikit-learn's
``randomized_svd`` (numpy's OpenBLAS pool), and 0.3 s after it; median of 15 calls each.
``sag``: nothing else runs; each window is the Standardizer's fit + transform at 2 threads
(median of 15) and at 1 (median of 7), the scikit-learn reference (median of 3), the streaming
probe, and what /proc shows while the 2-thread calls ran: this process's CPU seconds per wall
second, the busy seconds of other processes, and the hypervisor's steal. ``sag-probes``: each
window is the same 2-thread call (median of 15) beside three probes, median microseconds: an add
over 512 KiB at 2 threads (one parallel region, 200 calls), a ``sin`` over 64 Ki floats in cache
at 2 threads and at 1 (11 calls), and at 1 thread pinned to vCPU 0, then to vCPU 1.
``placement``: each window is the Standardizer's fit + transform at 2 threads (median of 15) and
at 1 (median of 5), then perfgate's ``timing.RoundTrip`` (the cache-line round trip between torch's
two threads, ns); the summary splits the windows by ``stats.apart`` against the least round trip read.
``detect-streamed``: the perf rows of the gate's detection tests (correctness_tests/test_perfgate_suite.py),
unchanged, 4x slower and with every kernel replaced by its reference, each 3 times at the default
``--perf-contended`` (not the tests' ``inf``) beside the copy loop; their rows and verdicts.
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perfgate.timing import Bandwidth, configure_malloc

STREAMER = ("import os, numpy as np; os.sched_setaffinity(0, {1}); a = np.ones(2**25); b = np.empty_like(a)\n"
            "while True: np.copyto(b, a)")


def probe() -> None:
    os.sched_setaffinity(0, {0})
    bw = Bandwidth()
    readings = []
    for _ in range(100):
        readings.append(bw.read())
        time.sleep(0.02)
    q = statistics.quantiles(readings, n=10)
    print(f"probe GB/s: median {statistics.median(readings):.1f}, 10th-90th percentile {q[0]:.1f}-{q[-1]:.1f}")


def pool() -> None:
    configure_malloc("cache")
    import numpy as np
    import torch
    from sklearn.utils.extmath import randomized_svd

    from kernels.standardize import Standardizer

    x, a = 5 + 3 * torch.randn(10000, 512), np.random.default_rng(0).random((512, 512))

    def call() -> float:
        start = time.perf_counter()
        Standardizer().fit(x).transform(x)
        return 1e3 * (time.perf_counter() - start)

    for _ in range(3):
        call()
    alone = statistics.median(call() for _ in range(15))
    after, later = [], []
    for pause, out in ((0.0, after), (0.3, later)):
        for _ in range(15):
            randomized_svd(a, 10, random_state=0)
            time.sleep(pause)
            out.append(call())
    print(f"Standardizer, {torch.get_num_threads()} threads: alone {alone:.1f} ms, right after randomized_svd "
          f"{statistics.median(after):.1f} ms, 0.3 s after {statistics.median(later):.1f} ms")


def _median_s(fn, calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn``."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sag(windows: int) -> None:
    import resource

    import torch

    from kernels.standardize import Standardizer
    from reference.standardize import Standardizer as Reference

    configure_malloc("cache")
    x = 5.0 + 3.0 * torch.randn(10000, 512, generator=torch.Generator().manual_seed(0))
    bw, tick = Bandwidth(), os.sysconf("SC_CLK_TCK")

    def proc() -> tuple[list[int], float, float]:
        with open("/proc/stat", encoding="ascii") as fh:
            ticks = [int(v) for v in fh.readline().split()[1:9]]
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return ticks, usage.ru_utime + usage.ru_stime, time.perf_counter()

    def ours() -> None:
        Standardizer().fit(x).transform(x)

    print("window  ours@2thr ms  ours@1thr ms  ref ms  ref/ours@2  stream GB/s  our CPUs busy  others s  steal s")
    for w in range(windows):
        ticks0, cpu0, wall0 = proc()
        torch.set_num_threads(2)
        two = 1e3 * _median_s(ours, 15)
        ticks1, cpu1, wall1 = proc()
        torch.set_num_threads(1)
        one = 1e3 * _median_s(ours, 7)
        torch.set_num_threads(2)
        ref = 1e3 * _median_s(lambda: Reference().fit(x).transform(x), 3)
        d = [b - a for a, b in zip(ticks0, ticks1, strict=True)]
        others = (d[0] + d[1] + d[2] + d[5] + d[6]) / tick - (cpu1 - cpu0)
        print(f"{w:6d}  {two:12.2f}  {one:12.2f}  {ref:6.1f}  {ref / two:10.2f}  {bw.read():11.1f}  "
              f"{(cpu1 - cpu0) / (wall1 - wall0):13.2f}  {others:+8.2f}  {d[7] / tick:7.2f}", flush=True)


def sag_probes(windows: int) -> None:
    import torch

    from kernels.standardize import Standardizer

    configure_malloc("cache")
    x = 5.0 + 3.0 * torch.randn(10000, 512, generator=torch.Generator().manual_seed(0))
    a, b, t = torch.rand(1 << 16), torch.empty(1 << 16), torch.ones(1 << 17)

    def sin() -> float:
        return 1e6 * _median_s(lambda: torch.sin(a, out=b), 11)

    cpus = os.sched_getaffinity(0)
    print("window  ours@2thr ms  add@2thr us  sin@2thr us  sin@1thr us  sin@vCPU0 us  sin@vCPU1 us")
    for w in range(windows):
        torch.set_num_threads(2)
        add, sin2 = 1e6 * _median_s(lambda: t.add_(1.0), 200), sin()
        ours = 1e3 * _median_s(lambda: Standardizer().fit(x).transform(x), 15)
        torch.set_num_threads(1)
        sin1 = sin()
        os.sched_setaffinity(0, {0})
        cpu0 = sin()
        os.sched_setaffinity(0, {1})
        cpu1 = sin()
        os.sched_setaffinity(0, cpus)
        print(f"{w:6d}  {ours:12.2f}  {add:11.1f}  {sin2:11.1f}  {sin1:11.1f}  {cpu0:12.1f}  {cpu1:12.1f}",
              flush=True)


def detect_streamed(runs: int = 3) -> None:
    from correctness_tests.test_perfgate_suite import CAUGHT, CAUGHT_TESTS, LOST_CONFTEST

    root = Path(__file__).resolve().parents[1]
    ids = [f"{f}::{t}[{impl}]" for f, t in zip(CAUGHT, CAUGHT_TESTS, strict=True)
           for impl in ("reference", "optimized")]
    conditions = {"unchanged": ("", []), "4x slower": ("", ["-p", "perfgate.slowdown", "--perf-slowdown=4"]),
                  "lost": (LOST_CONFTEST, [])}
    env = {**os.environ, "PYTHONPATH": str(root)}
    # the table rows of these kernels (test name less "test_") and the verdict lines
    keep = (*(f"{t.removeprefix('test_')} " for t in CAUGHT_TESTS), "GATE FAILED", "UNRESOLVED", "gate ",
            "timed again")
    streamer = subprocess.Popen([sys.executable, "-c", STREAMER])
    try:
        for name, (conftest, args) in conditions.items():
            for run in range(runs):
                with tempfile.TemporaryDirectory() as scratch:
                    for f in CAUGHT:
                        shutil.copy(root / "perf_tests" / f, scratch)
                    Path(scratch, "conftest.py").write_text(conftest)
                    out = subprocess.run([sys.executable, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider",
                                          "--perf-device", "cpu", "--perf-size", "smoke", *args], cwd=scratch,
                                         env=env, capture_output=True, text=True)
                print(f"## {name}, run {run + 1}: pytest exit {out.returncode}")
                print("\n".join(line for line in out.stdout.splitlines() if line.startswith(keep)), flush=True)
    finally:
        streamer.kill()


def placement(windows: int) -> None:
    import torch

    from kernels.standardize import Standardizer
    from perfgate.stats import apart
    from perfgate.timing import RoundTrip

    configure_malloc("cache")
    x = 5.0 + 3.0 * torch.randn(10000, 512, generator=torch.Generator().manual_seed(0))
    probe = RoundTrip(2)

    def ours() -> None:
        Standardizer().fit(x).transform(x)

    rows = []
    print("window  ours@2thr ms  ours@1thr ms  round trip ns  time")
    for w in range(windows):
        torch.set_num_threads(2)
        two = 1e3 * _median_s(ours, 15)
        torch.set_num_threads(1)
        one = 1e3 * _median_s(ours, 5)
        torch.set_num_threads(2)
        rows.append((two, one, probe.read()))
        print(f"{w:6d}  {two:12.2f}  {one:12.2f}  {rows[-1][2]:13.1f}  {time.strftime('%H:%M:%S')}", flush=True)
    near = min(r[2] for r in rows)
    for name, part in (("near", [r for r in rows if not apart(r[2], near)]),
                       ("apart", [r for r in rows if apart(r[2], near)])):
        if part:
            q = [statistics.quantiles([r[i] for r in part], n=10) if len(part) > 1 else [part[0][i]] * 9
                 for i in range(3)]
            print(f"{name}: {len(part)} windows; round trip {q[2][0]:.0f}-{q[2][-1]:.0f} ns, ours@2thr "
                  f"{q[0][0]:.2f}-{q[0][-1]:.2f} ms, ours@1thr {q[1][0]:.2f}-{q[1][-1]:.2f} ms "
                  "(10th-90th percentile)")
    slow = [r for r in rows if r[0] > 1.5 * statistics.median(r[0] for r in rows if not apart(r[2], near))]
    print(f"windows with ours@2thr over 1.5x the near windows' median: {len(slow)}, "
          f"of them read apart: {sum(apart(r[2], near) for r in slow)}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "probe"
    if what == "probe-streamed":
        streamer = subprocess.Popen([sys.executable, "-c", STREAMER])
        try:
            time.sleep(1)
            probe()
        finally:
            streamer.kill()
    elif what == "detect-streamed":
        detect_streamed()
    elif what in ("sag", "sag-probes", "placement"):
        windows = int(sys.argv[2]) if len(sys.argv) > 2 else 200
        {"sag": sag, "sag-probes": sag_probes, "placement": placement}[what](windows)
    else:
        {"probe": probe, "pool": pool}[what]()
