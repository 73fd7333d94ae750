"""per_sample_grads against vmap(grad) as a training loop calls them: back to back, and in blocks.

    python -m evidence.per_sample_loops [threads, default 2]

The suite's MLP (784-256-256-10) at B=64 and B=256, malloc cache. Each impl is timed two ways in
one process:

- back to back: ``CALLS`` calls of one impl in a row, the median of the calls after the first
  ``SETTLE``; the impls in turn, ``ROUNDS`` times. Twice: each result dropped before the next
  call ("dropped", a loop that consumes it and lets it go: ``del grads``), and each result alive
  while the next is made ("kept", ``grads = per_sample_grads(...)`` in a loop);
- in blocks: perfgate's interleaved ABBA blocks (``evidence.ab.compare``: the previous result
  alive while the next is made, a warming call before each block), vmap against each of ours,
  both sides' blocks ``perfgate.timing.block_calls`` calls of vmap's back-to-back time (the suite
  sizes each side's from its own: 4-6 calls here where these are 6-7).

Then, at B=64, each impl's first calls after a pause (50 ms of sleep) and after a pass over
1 GiB of memory (``torch.add_``), as a training loop's other work leaves the host between calls.
Each row also counts the page faults its calls take (``getrusage``'s minor faults): memory the
allocator hands back mapped afresh, zeroed on the first touch. A process's own state moves vmap's
time more than ours (evidence/per-sample-loops-xeon.txt): compare the ratios of one run, and runs
of the script in several processes.
"""

import resource
import statistics
import sys
import time
from unittest import mock

from perfgate.timing import configure_malloc

malloc = configure_malloc("cache")  # the suite's mode, before any large allocation

import torch  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import compare  # noqa: E402
from kernels import nontemporal  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from perfgate.timing import block_calls, timer_for  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

CALLS, SETTLE, ROUNDS = 30, 5, 3
AFTER = 6  # calls timed after each pause
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
timer = timer_for("cpu")


def minor_faults() -> int:
    """Page faults this process has taken that needed no I/O (a page mapped, or zeroed, on touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def back_to_back(fn, keep: bool = False) -> tuple[float, float]:
    """(median seconds of a call, page faults a call) among CALLS in a row, after the first SETTLE;
    ``keep``: each result alive until the next call returns."""
    times, result = [], None
    for i in range(CALLS):
        if i == SETTLE:
            faults = minor_faults()
        start = time.perf_counter()
        if keep:
            result = fn()
        else:
            fn()
        times.append(time.perf_counter() - start)
    del result
    return statistics.median(times[SETTLE:]), (minor_faults() - faults) / (CALLS - SETTLE)


class Counted:
    """fn, counting its calls and the page faults taken during them."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.faults = fn, 0, 0

    def __call__(self):
        before = minor_faults()
        out = self.fn()
        self.faults += minor_faults() - before
        self.calls += 1
        return out

    def per_call(self) -> float:
        return self.faults / max(1, self.calls)


def impls_at(batch: int) -> dict:
    """vmap(grad), per_sample_grads, per_sample_grads(out=) and that with its streaming stores
    off (torch.mul for every layer) on the MLP at ``batch``, as calls."""
    args = per_sample_problem(batch)
    into = kernels.per_sample_grads(*args)
    return {"vmap(grad)": lambda: vmap_grads(*args),
            "per_sample_grads": lambda: kernels.per_sample_grads(*args),
            "per_sample_grads(out=)": lambda: kernels.per_sample_grads(*args, out=into),
            "per_sample_grads(out=), torch.mul": mock.patch.object(nontemporal, "pays", lambda nbytes: False)(
                lambda: kernels.per_sample_grads(*args, out=into))}


print(f"# {_cpu_model()}, {torch.get_num_threads()} thread(s), malloc {malloc}, torch {torch.__version__}; "
      f"MLP 784-256-256-10; back to back: {ROUNDS} rounds of {CALLS} calls an impl, the median after the "
      f"first {SETTLE}, each result dropped and kept; in blocks: 15 ABBA pairs. Each ratio is vmap's time over "
      f"the row's; faults are page faults a call")
for batch in (64, 256):
    impls = impls_at(batch)
    loops: dict[tuple[str, bool], list[tuple[float, float]]] = {(n, k): [] for n in impls for k in (False, True)}
    for _ in range(ROUNDS):
        for (name, keep), runs in loops.items():
            runs.append(back_to_back(impls[name], keep))
    readings = {key: [statistics.median(column) for column in zip(*runs, strict=True)]
                for key, runs in loops.items()}
    vmap_s = {keep: readings["vmap(grad)", keep][0] for keep in (False, True)}
    calls = block_calls(vmap_s[False])[0]
    for name in impls:
        line = f"B={batch:3d} {name:34s}"
        for keep, what in ((False, "dropped"), (True, "kept")):
            seconds, faults = readings[name, keep]
            line += f"  {what} {seconds * 1e3:7.3f} ms {faults:5.0f} faults"
            if name != "vmap(grad)":
                line += f" {vmap_s[keep] / seconds:4.2f}x"
        if name != "vmap(grad)":
            slow, fast = Counted(impls["vmap(grad)"]), Counted(impls[name])
            point, low, high, slow_ms, fast_ms = compare(timer, slow, fast, calls=(calls, calls))
            line += (f";  blocks of {calls}: {point:4.2f}x ({low:.2f}-{high:.2f}), {slow_ms:.3f} / {fast_ms:.3f} "
                     f"ms, faults {slow.per_call():.0f} / {fast.per_call():.0f}")
        print(line)

# the first AFTER calls after each pause, the median of 2 x ROUNDS pauses, B=64
impls = impls_at(64)
del impls["per_sample_grads"], impls["per_sample_grads(out=), torch.mul"]
evicting = torch.zeros(1 << 28)  # 1 GiB of float32
pauses = {"50 ms of sleep": lambda: time.sleep(0.05), "a pass over 1 GiB": lambda: evicting.add_(1.0)}
print(f"\nB= 64, ms of each of the first {AFTER} calls after a pause (medians of {2 * ROUNDS}), then back to back")
for pause, wait in pauses.items():
    for name, fn in impls.items():
        firsts = []
        for _ in range(2 * ROUNDS):
            back_to_back(fn)
            wait()
            firsts.append([])
            for _ in range(AFTER):
                start = time.perf_counter()
                fn()
                firsts[-1].append(time.perf_counter() - start)
        calls = [statistics.median(f[i] for f in firsts) * 1e3 for i in range(AFTER)]
        print(f"after {pause:18s} {name:34s} " + " ".join(f"{t:6.2f}" for t in calls)
              + f"  | {back_to_back(fn)[0] * 1e3:6.2f}")
