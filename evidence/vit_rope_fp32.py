"""The ViT step in fp32 (what Recipe.auto keeps on a CPU without bf16 instructions): where the
optimized run's time goes against the reference's, interleaved in one process.

    python -m evidence.vit_rope_fp32 [cache|default]

perf_tests/test_vit_rope.py's step at B=32 (smoke), 2 threads: the reference step against the
engine forced to fp32 with 2 micro-batches (the suite's setting) and with 1; then the model's
forward and backward alone with the reference's attention against ours, at the batch and the
micro-batch; then ours at one batch of 32 against two of 16. Reference time over ours, point
(95% CI) from 11 interleaved ABBA pairs (perfgate.timing), median ms of each side.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from evidence.ab import versus as ab  # noqa: E402
from kernels.models import RopeViT  # noqa: E402
from kernels.training import Recipe  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.vit_rope import Config, Method, optimized_method, reference_method  # noqa: E402

torch.set_num_threads(2)
timer = timer_for("cpu")
BATCH = 32


def versus(label: str, reference: Callable[[], object], ours: Callable[[], object]) -> None:
    """One line: reference time / ours, point (95% CI) from 11 interleaved pairs, and each side's
    median ms."""
    print(f"{label}: {ab(timer, reference, ours, rounds=11)}", flush=True)


def step(method: Method, cfg: Config) -> Callable[[], object]:
    """One optimizer step of ``method`` on the step's batch, as the perf test times it."""
    torch.manual_seed(0)
    model = RopeViT(attention=method.attention)
    opt = method.optimizer_fn(model.parameters(), lr=1e-3, weight_decay=0.05)
    batches = cfg.data(method.recipe.accumulation if method.recipe else 1)
    return lambda: method.train_fn(model, F.cross_entropy, opt, batches, method.recipe, device="cpu",
                                   max_grad_norm=cfg.max_grad_norm)


def forward_backward(attention: type[nn.Module], batch: int) -> Callable[[], None]:
    """The model's forward and backward on one batch, no optimizer, no engine."""
    torch.manual_seed(0)
    model = RopeViT(attention=attention)
    x, y = Config(batch=batch).data(1)[0]
    return lambda: F.cross_entropy(model(x), y).backward()


print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
      "reference / ours")
cfg = Config(steps=1, warmup_steps=0, batch=BATCH)
reference = reference_method()
for k in (2, 1):
    ours = optimized_method(Config(batch=BATCH, accumulation=k), Recipe(accumulation=k))
    versus(f"step, B={BATCH}, ours fp32 in {k} micro-batch(es)", step(reference, cfg),
           step(ours, Config(steps=1, warmup_steps=0, batch=BATCH, accumulation=k)))
theirs, mine = reference.attention, ours.attention
for b in (BATCH, BATCH // 2):
    versus(f"model forward and backward, B={b}, the reference's attention / ours", forward_backward(theirs, b),
           forward_backward(mine, b))
one, half = forward_backward(mine, BATCH), forward_backward(mine, BATCH // 2)
versus(f"ours, one batch of {BATCH} / two of {BATCH // 2}", one, lambda: (half(), half()))
