"""A fresh result in huge pages, written by torch's threads: its pages faulted by the writers as
they go, first by the calling thread (``kernels.hugepages.empty``'s ``prefault``), or the way
``kernels.hugepages.fresh`` chooses from its recent calls' times (the kernels' default: "chosen").

1. A 69 MB buffer (the per-sample result at B=64) from ``hugepages.empty``, then ``fill_`` by
   torch's threads: "hot", back to back (each call gets the huge pages the last one freed);
   "cold", each call after a 70 MB tensor in small pages is made and kept (as a peer's result is
   alive between ours' calls in the suite's pairs); "idle", each call after 5 s of sleep (as
   between a training loop's epochs). The three methods call by call in turn. ms: median [min-max].
2. The suite's pairs, each call timed (perfgate's interleaved ABBA pairs, 15 rounds of 3 calls a
   side): ``per_sample_grads`` with a fresh result (MLP B=64) beside the reference, Opacus and
   vmap(grad), and ``Standardizer().fit(X).transform(X)`` (50000 x 512) beside the reference and
   the torch ops, without the prefault, with it, chosen, chosen, with it, without (a host that
   changes over minutes reads on all). Ours' calls, ms: median, mean, max, and how many took over
   twice the median.

    python -m evidence.prefault [threads, default 2] [malloc mode, default "default"] [1: part 1 alone]
"""

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from perfgate.timing import configure_malloc, interleaved, timer_for

malloc = configure_malloc(sys.argv[2] if len(sys.argv) > 2 else "default")  # before any large allocation

import torch  # noqa: E402

import kernels  # noqa: E402
import reference  # noqa: E402
from kernels import hugepages  # noqa: E402
from perf_tests.peers import opacus_grads, torch_standardize  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus's, on every call
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
ELEMENTS = 69_000_000 // 4
held: list[torch.Tensor] = []
before = {"hot": lambda: None, "cold": lambda: (held.clear(), held.append(torch.ones(70_000_000 // 4))),
          "idle": lambda: time.sleep(5)}


timer = timer_for("cpu")


def filled(prefault: bool | None) -> None:
    """A fresh 69 MB buffer filled by torch's threads: from hugepages.empty (``prefault``), or from
    hugepages.fresh (None: the way it chooses)."""
    if prefault is None:
        with hugepages.fresh((ELEMENTS,), like=torch.empty(0), site="evidence") as t:
            t.fill_(1.0)
    else:
        hugepages.empty((ELEMENTS,), like=torch.empty(0), prefault=prefault).fill_(1.0)


def fresh(prefault: bool | None, condition: str) -> float:
    """ms of one call of ``filled``, by perfgate's timer, ``condition``'s setup run before it,
    outside the reading."""
    return timer.block((lambda _: filled(prefault), before[condition]), 1, warm=0)[0] * 1e3


HOW = {False: "writers fault", True: "prefaulted", None: "chosen"}


pages = "advised" if hugepages._madvise() else "unasked" if hugepages._huge_unasked() else "none: torch.empty"
# the THP defrag setting: where a fault may compact memory for a huge page
defrag = hugepages._bracketed(str(Path(hugepages.THP_MODE).with_name("defrag"))) or "unknown"
print(f"# {_cpu_model()}, {torch.get_num_threads()} thread(s), malloc {malloc}, torch {torch.__version__}, "
      f"THP mode {hugepages._mode() or 'unknown'} (huge pages {pages}), defrag {defrag}")
print("# 1. hugepages.empty((69 MB,)) then fill_ by torch's threads, the three methods call by call in turn: "
      "median [min-max] ms")
for condition, calls in (("hot", 12), ("cold", 12), ("idle", 6)):
    times: dict[bool | None, list[float]] = {False: [], True: [], None: []}
    for i in range(calls):
        for prefault in (False, True, None) if i % 2 == 0 else (None, True, False):
            times[prefault].append(fresh(prefault, condition))
    for prefault, ms in times.items():
        how = HOW[prefault]
        print(f"{condition:5s} {how:14s} {statistics.median(ms):7.1f} [{min(ms):.1f}-{max(ms):.1f}], "
              f"{calls} calls", flush=True)
held.clear()

if sys.argv[3:4] == ["1"]:  # part 1 alone
    sys.exit()
print("# 2. the suite's pairs: ours' calls, ms")
choose = hugepages._Ways.choose


def pairs(label: str, peer: Callable[[], object], ours: Callable[[], object]) -> None:
    """Ours' call times beside ``peer``, without the prefault, with it, chosen, chosen, with it,
    without (a line each; a forced way is what ``fresh`` chooses, and its times are kept as ever)."""
    for prefault in (False, True, None, None, True, False):
        hugepages._Ways.choose = choose if prefault is None else lambda ways, now, way=prefault: way
        times = [b * 1e3 for _, b in interleaved(timer, (peer, None), (ours, None), 15, (3, 3))]
        median = statistics.median(times)
        print(f"{label:44s} {HOW[prefault]:14s} median {median:6.1f}  mean "
              f"{statistics.mean(times):6.1f}  max {max(times):6.1f}  over 2x the median: "
              f"{sum(t > 2 * median for t in times)}/{len(times)}", flush=True)
    hugepages._Ways.choose = choose

args = per_sample_problem(64)
x = 5.0 + 3.0 * torch.randn(50_000, 512, generator=torch.Generator().manual_seed(0))
for label, peer in (("per_sample_grads B=64 beside the reference", reference.per_sample_grads),
                    ("per_sample_grads B=64 beside opacus", opacus_grads),
                    ("per_sample_grads B=64 beside vmap(grad)", vmap_grads)):
    pairs(label, lambda peer=peer: peer(*args), lambda: kernels.per_sample_grads(*args))
for label, peer in (("Standardizer 50000x512 beside the reference",
                     lambda: reference.Standardizer().fit(x).transform(x)),
                    ("Standardizer 50000x512 beside torch ops", lambda: torch_standardize(x))):
    pairs(label, peer, lambda: kernels.Standardizer().fit(x).transform(x))
