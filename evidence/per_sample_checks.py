"""What per_sample_grads(out=)'s checks cost inside the call (suite's MLP 784-256-256-10, B=64 by
default, cache malloc): each part of the call timed by a wrapper around it over ``calls`` calls
(a part's own time, its callees' included), and the call with one check patched out at a time (an
experiment on a fixed model whose checks all pass: the library never skips them), beside the
Linear identity with no check (``evidence.per_sample_compile.bare_identity``), medians of
interleaved rounds.

    python -m evidence.per_sample_checks [threads, default 2] [batch, default 64] [calls, default 300]
"""

import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

from perfgate.timing import configure_malloc

malloc = configure_malloc("cache")  # the suite's mode, before any large allocation

import torch  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import medians  # noqa: E402
from evidence.per_sample_compile import bare_identity  # noqa: E402
from kernels import checks  # noqa: E402
from kernels import layer_capture as capture  # noqa: E402
from kernels import per_sample as ps  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.common import per_sample_problem  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
torch.set_num_threads(threads)
args = per_sample_problem(batch)
model, _, x, y = args
buffers = kernels.per_sample_grads(*args)
bare_out = {n: torch.empty_like(t) for n, t in buffers.items()}


def timed_parts() -> dict[str, float]:
    """ms a call of each part, wrapped where per_sample_grads and capture look it up."""
    spent: dict[str, list[float]] = {}

    def wrap(module: object, name: str) -> contextlib.AbstractContextManager:
        fn = getattr(module, name)

        @functools.wraps(fn)
        def timed(*a: object, **k: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - start)
        return mock.patch.object(module, name, timed)

    parts = [(ps, "_trainable"), (ps, "check_out"), (ps, "_plan"), (ps, "_from_terms"),
             (capture, "_probe_forward"), (capture, "_probe"), (capture, "loss_parameters"),
             (capture, "_used_outside"), (capture, "per_sample_losses"), (checks, "nonfinite"),
             (checks, "finite_extremes")]
    whole = []
    with contextlib.ExitStack() as stack:
        for module, name in parts:
            stack.enter_context(wrap(module, name))
        for i in range(calls + calls // 5):
            start = time.perf_counter()
            kernels.per_sample_grads(*args, out=buffers)
            if i >= calls // 5:  # the first fifth warms up
                whole.append(time.perf_counter() - start)
            else:
                spent.clear()
    return {"the whole call (median)": statistics.median(whole) * 1e3,
            **{name: sum(v) / calls * 1e3 for name, v in spent.items()}}


def without(*patches: tuple[object, str, object]) -> Callable[[], object]:
    """The call with ``patches`` in place."""
    def call() -> object:
        with contextlib.ExitStack() as stack:
            for module, name, value in patches:
                stack.enter_context(mock.patch.object(module, name, value))
            return kernels.per_sample_grads(*args, out=buffers)
    return call


print(f"# {_cpu_model()}, {threads} thread(s), malloc {malloc}, torch {torch.__version__}; MLP 784-256-256-10, "
      f"B={batch}, out=")
print(f"# 1. each part timed inside the call, ms a call over {calls} calls (nonfinite and finite_extremes: every "
      "finiteness read, _trainable's (check_inputs' checks) among them; _from_terms: the write, which reads the "
      "captured terms' largest magnitudes as it streams)")
for name, ms in timed_parts().items():
    print(f"{name:40s} {ms:7.3f}")
rows = {"ours out=": without(),
        "  without the probe": without((capture, "_probe_forward", lambda *a: [])),
        "  without the finiteness reads": without((checks, "finite", lambda *a, **k: None),
                                                  (checks, "finite_extremes", lambda *a, **k: {})),
        "  without the weight-use walk": without((capture, "_used_outside", lambda *a, **k: None)),
        "  without check_out": without((ps, "check_out", lambda *a, **k: None)),
        "identity, no check": lambda: bare_identity(model, x, y, bare_out)}
print("# 2. the call with one check patched out at a time, medians of 25 interleaved rounds of 3 calls, ms")
for name, ms in medians(rows, rounds=25, calls=3).items():
    print(f"{name:40s} {ms:7.3f}")
