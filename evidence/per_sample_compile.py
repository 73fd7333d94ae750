"""per_sample_grads against torch.compile(vmap(grad)) over the batch size, on the suite's MLP
(784-256-256-10), with the identity bare beside them: where the compiled recipe leads, and why.

Rows, each a median of interleaved rounds in one process (perfgate's timer, evidence.ab): ours
(a fresh result, and ``out=``), torch.func's vmap(grad) eager and compiled by inductor (one
compile per batch size, shapes fixed, outside the timing: a training loop's steady state), and
"identity, bare": the Linear identity written out for this MLP with none of ours' checks (its
forward hooked, one backward to the layer outputs, the outer products and bias sums into the
``out=`` buffers, streamed where ours streams; its buffers are torch.empty_like, not ours' huge
pages, which if anything counts against it at large B). bare / ours is the share of ours' call its checks
and bookkeeping leave to the arithmetic and the write; compiled / ours (ours with ``out=``) the
lead, with its paired 95% interval.

    python -m evidence.per_sample_compile [threads, default 2] [batches, default 2,8,16,32,64,128,256]
"""

import sys

from perfgate.timing import configure_malloc

malloc = configure_malloc("cache")  # the suite's mode, before any large allocation

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import compare, medians  # noqa: E402
from kernels import nontemporal  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from perfgate.timing import timer_for  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402


def bare_identity(model: nn.Module, x: Tensor, y: Tensor, out: dict[str, Tensor]) -> None:
    """The identity with no check: each Linear's input and output kept by a forward hook, one
    backward of the summed per-sample losses to the outputs, g_i a_i^T and g_i into ``out``."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    seen: dict[str, tuple[Tensor, Tensor]] = {}
    hooks = [m.register_forward_hook(lambda m, args, o, n=n: seen.__setitem__(n, (args[0].detach(), o)))
             for n, m in layers.items()]
    try:
        losses = F.cross_entropy(model(x), y, reduction="none")
    finally:
        for h in hooks:
            h.remove()
    grads = torch.autograd.grad(losses.sum(), [o for _, o in seen.values()])
    weights = sum(out[f"{n}.weight"].numel() * 4 for n in layers)
    for (n, (a, _)), g in zip(seen.items(), grads, strict=True):
        nontemporal.outer(g.unsqueeze(2), a.unsqueeze(1), out[f"{n}.weight"], stream=nontemporal.pays(weights))
        torch.sum(g.unsqueeze(1), 1, out=out[f"{n}.bias"])


def measure(batch: int) -> str:
    """One line of the table: batch size ``batch``'s rows."""
    args = per_sample_problem(batch)
    model, loss_fn, x, y = args
    buffers = kernels.per_sample_grads(*args)
    bare_out = {n: torch.empty_like(t) for n, t in buffers.items()}
    bare_identity(model, x, y, bare_out)
    for n, t in bare_out.items():  # the bare identity computes ours' result
        torch.testing.assert_close(t, buffers[n])
    compiled = torch.compile(vmap_grads, dynamic=False)
    compiled(*args)  # compiled outside the timing
    rows = {"ours": lambda: kernels.per_sample_grads(*args),
            "out=": lambda: kernels.per_sample_grads(*args, out=buffers),
            "bare": lambda: bare_identity(model, x, y, bare_out),
            "compiled": lambda: compiled(*args), "vmap": lambda: vmap_grads(*args)}
    ms = medians(rows, rounds=15, calls=3)
    point, low, high, *_ = compare(timer_for("cpu"), rows["compiled"], rows["out="])
    megabytes = sum(t.numel() * t.element_size() for t in buffers.values()) / 1e6
    return (f"{batch:4d} {megabytes:6.1f} " + " ".join(f"{ms[k]:8.3f}" for k in rows)
            + f"  {ms['bare'] / ms['out=']:9.2f}  {point:.2f}x ({low:.2f}-{high:.2f})")


if __name__ == "__main__":  # evidence.per_sample_write_rate imports bare_identity
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "2,8,16,32,64,128,256").split(",")]
    torch._dynamo.config.cache_size_limit = 4 * len(batches)  # one graph per batch size, none evicted
    print(f"# {_cpu_model()}, {torch.get_num_threads()} thread(s), malloc {malloc}, torch {torch.__version__}; "
          "MLP 784-256-256-10; ms a call, medians of 15 rounds of 3 calls each")
    print(f"{'B':>4} {'MB':>6} {'ours':>8} {'out=':>8} {'bare':>8} {'compiled':>8} {'vmap':>8}  bare/out=  "
          "ours over compiled: its time / out='s (95% CI, 15 pairs)")
    for batch in batches:
        print(measure(batch), flush=True)
