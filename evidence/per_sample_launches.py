"""What one call of each per-sample row dispatches: the ops (on CUDA, about one kernel launch each)
and the host reads (each a device sync on CUDA), beside its median time (the rows in turn within
each round, perfgate's timer: the previous call's result alive while the next is made). On CUDA also the syncs
torch's sync debug mode reports (host reads, pageable copies) and the time the device spends in
kernels, which tells a launch- or sync-bound call (the device mostly idle) from one its kernels
bound. The rows of perf_tests/test_per_sample.py: ours, torch.func's vmap(grad), and Opacus's
per-sample gradients and ghost clipping, on the suite's MLP.

    python -m evidence.per_sample_launches [cpu|cuda] [batch, default 256] [threads, default 2] [cache|default]

The last argument is the CPU allocator's mode (perfgate.timing.configure_malloc; the suite's is cache).

Ops are counted by a dispatch mode (views included); host reads at ``Tensor.tolist``, ``item`` and
``__bool__`` (a CPU tensor's ``tolist`` dispatches no op; ``float(t)``, ``int(t)`` and ``.cpu()`` are
not seen there: on CUDA the syncs column counts every read).
"""

import sys

from perfgate.timing import configure_malloc

malloc = configure_malloc(sys.argv[4] if len(sys.argv) > 4 else "cache")  # before any large allocation

from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import medians  # noqa: E402
from perf_tests.peers import PEERS  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)


class Ops(TorchDispatchMode):
    """Counts every op dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def host_reads(fn: Callable[[], object]) -> int:
    """How many times one call of ``fn`` reads a tensor's values back to the host."""
    reads = 0
    patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__")}

    def counting(name: str) -> Callable:
        def read(t: torch.Tensor, *a: object, **kw: object) -> object:
            nonlocal reads
            reads += 1
            return patched[name](t, *a, **kw)
        return read

    for name in patched:
        setattr(torch.Tensor, name, counting(name))
    try:
        fn()
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)
    return reads


def device_syncs(fn: Callable[[], object]) -> int:
    """CUDA: the synchronizing calls of one call of ``fn`` (device-to-host reads, pageable copies,
    ``nonzero``...), as torch's sync debug mode warns of each."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def kernel_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """CUDA: the device's kernel time per call, torch.profiler's "Self CUDA time total" (each
    kernel's time once, whatever op launched it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    # the device's own events: a CPU op's self device time repeats its kernels' (as the table's total reads)
    kernels_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA
                     and not e.is_user_annotation)
    return kernels_us / 1e3 / calls


args = per_sample_problem(batch, device)
rows = {
    "per_sample_grads: optimized": lambda: kernels.per_sample_grads(*args),
    "per_sample_grads: vmap": lambda: vmap_grads(*args),
    "per_sample_grads: peer opacus": lambda: PEERS["peer: opacus"](*args),
    "per_sample_grad_norms: optimized": lambda: kernels.per_sample_grad_norms(*args),
    "per_sample_grad_norms: peer opacus ghost clipping": lambda: PEERS["peer: opacus ghost clipping"](*args),
    "per_sample_grad_gram: optimized": lambda: kernels.per_sample_grad_gram(*args),
    "per_sample_grad_gram: peer opacus Gram": lambda: PEERS["peer: opacus Gram"](*args),
}
where = torch.cuda.get_device_name() if device == "cuda" else _cpu_model()
print(f"# {where}, {device}, MLP 784-256-256-10, B={batch}, {torch.get_num_threads()} thread(s), "
      f"malloc {malloc}, torch {torch.__version__}")
cuda_columns = f" {'syncs':>5s} {'kernel ms':>9s}" if device == "cuda" else ""
print(f"{'row':52s} {'ms':>8s} {'ops':>5s} {'host reads':>10s}{cuda_columns}  most frequent ops")
for fn in rows.values():  # warm: Opacus wraps its model on the first call, vmap traces
    for _ in range(3):
        fn()
ms = medians(rows, rounds=15, calls=5, device=device)  # the rows in turn within a round, by perfgate's timer
for name, fn in rows.items():
    counted = Ops()
    with counted:
        fn()
    extra = f" {device_syncs(fn):5d} {kernel_ms(fn):9.3f}" if device == "cuda" else ""
    top = ", ".join(f"{op} {n}" for op, n in counted.ops.most_common(5))
    print(f"{name:52s} {ms[name]:8.3f} {sum(counted.ops.values()):5d} {host_reads(fn):10d}{extra}  {top}")
