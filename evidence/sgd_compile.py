"""SGD with momentum over resnet18's 11.7M parameters: torch.compile of the foreach step against
torch's fused CPU step (what kernels.sgd picks), interleaved in one process.

    python -m evidence.sgd_compile [cache|default] [threads, default 2]

Each row: fused time over compiled, point (95% CI) from 41 interleaved ABBA pairs (perfgate.timing),
and each side's median ms, with the GB/s of the 233.8 MB a step must move (p read and written,
grad read, momentum read and written). The two steps of a row are alive together (2 x 140 MB),
then dropped: the parameters as the model has them (62 tensors), then one flat tensor of the
same 11.7M elements (one kernel call a step), which tells the loop from the per-tensor calls.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torchvision  # noqa: E402

from evidence.ab import compare  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
timer = timer_for("cpu")
MOVED_MB = 233.8


def step(flat: bool, compiled: bool) -> Callable[[], None]:
    """One SGD step (lr 0.01, momentum 0.9) over fresh parameters and gradients, buffers made."""
    params = list(torchvision.models.resnet18().parameters())
    if flat:
        params = [torch.nn.Parameter(torch.randn(sum(p.numel() for p in params)))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, **({"foreach": True} if compiled else {"fused": True}))
    opt.step()  # the momentum buffers exist from here on, as in training
    fn = torch.compile(opt.step) if compiled else opt.step
    fn()  # compiled here, outside the timed pairs
    return fn


print(f"{_cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, malloc {mode}")
for flat in (False, True):
    point, low, high, fused_ms, compiled_ms = compare(timer, step(flat, False), step(flat, True), rounds=41)
    print(f"{'one flat tensor' if flat else 'resnet18, 62 tensors'}: fused / compiled {point:.2f}x "
          f"({low:.2f}-{high:.2f}), {fused_ms:.2f} / {compiled_ms:.2f} ms; "
          f"{MOVED_MB / fused_ms:.1f} / {MOVED_MB / compiled_ms:.1f} GB/s")
