"""What the gate's host readings see, and what they do not (docs/gate.md, "A contended host").

    python docs/measurements/host_contention.py probe            # the streaming probe, 100 readings
    python docs/measurements/host_contention.py probe-streamed   # the same beside a copy loop on vCPU 1
    python docs/measurements/host_contention.py pool             # the Standardizer after randomized_svd

``probe``: perfgate's ``timing.Bandwidth`` on vCPU 0, 20 ms apart. ``pool``: the Standardizer
(10000 x 512 fp32, torch's default threads, cache malloc) alone, right after scikit-learn's
``randomized_svd`` (numpy's OpenBLAS pool), and 0.3 s after it; median of 15 calls each.
"""

import os
import statistics
import subprocess
import sys
import time

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


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "probe"
    if what == "probe-streamed":
        streamer = subprocess.Popen([sys.executable, "-c", STREAMER])
        try:
            time.sleep(1)
            probe()
        finally:
            streamer.kill()
    else:
        {"probe": probe, "pool": pool}[what]()
