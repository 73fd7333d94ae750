"""RopeSelfAttention's training forward and backward: the projected attention
(kernels.attention._ProjectedAttention) against the unfused path (the same module with autograd
over the torch ops and the rotation's Function), interleaved in one process.

    python -m evidence.attention_training [cache|default] [threads, default 2] [causal]

Each row: the module's forward and backward (a gradient for x and every parameter) on x (B, S, dim),
unfused time over fused, point (95% CI) from 15 interleaved ABBA pairs (perfgate.timing), and each
side's median ms. The shapes: the RoPE ViT's attention (dim 192, 6 heads, 64 tokens) at its two
micro-batches' and its batch's B, grouped-query heads, and the longest S the path takes;
``causal``: the same modules with the causal mask (the fused path's softmax in causal rows,
against SDPA's causal call).
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from collections.abc import Callable  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

import kernels.attention as KA  # noqa: E402
from evidence.ab import versus  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
causal = sys.argv[3:] == ["causal"]
timer = timer_for("cpu")
SHAPES = [  # (B, S, dim, heads, kv heads)
    (16, 64, 192, 6, 6), (32, 64, 192, 6, 6), (8, 128, 256, 8, 2), (4, 128, 512, 8, 8)]


def step(module: KA.RopeSelfAttention, x: torch.Tensor, fused: bool) -> Callable[[], None]:
    """One forward and backward of ``module`` on x, the fused path taken or not."""
    grad = torch.randn_like(x)

    def run() -> None:
        with mock.patch.object(KA, "_trains_fused", KA._trains_fused if fused else lambda *a: False):
            module(x).backward(grad)
    return run


print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
      f"unfused / fused{', causal' if causal else ''}")
for b, s, dim, heads, kv in SHAPES:
    torch.manual_seed(0)
    module = KA.RopeSelfAttention(dim, heads, kv, causal=causal)
    x = torch.randn(b, s, dim, requires_grad=True)
    print(f"B {b} S {s} dim {dim} heads {heads}/{kv}: "
          f"{versus(timer, step(module, x, False), step(module, x, True))}", flush=True)
