"""Causal attention on the CPU: one SDPA call against one call per block of query rows.

    python -m evidence.causal_blocks [cache|default]

torch's flash CPU kernel scores each block of queries against a whole block of up to 512 keys and
masks the keys past the query afterwards, so below 512 positions a causal call costs what a full
one does. kernels.attention._blocked_causal calls SDPA once per block of query rows, over the keys
those rows may see. Each line: sequence length and B, H (B8 H8 up to S=512, then fewer so that
B*H*S^2 stays within 2x of 8*8*512^2), the single causal call's and the full call's median ms,
then, per block size, one causal call's time over the blocked path's: speedup (95% CI) and the
two medians from 15 interleaved ABBA pairs (evidence/ab.py), 2 threads, D 64, fp32, forward, no mask; then forward
and backward at S=512; then bf16 and fp16 inputs (SDPA's reduced-precision kernel, blocks of
256) from S=384. Each blocked result is checked against the single call's at the project's
tolerance for its dtype.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from correctness_tests.tolerances import REDUCTION, assert_close  # noqa: E402
from evidence.ab import versus  # noqa: E402
from kernels.attention import _blocked_causal  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

torch.set_num_threads(2)
timer = timer_for("cpu")


def ms(fn: Callable[[], object]) -> float:
    """Median ms of 5 back-to-back calls after one warming call."""
    return statistics.median(timer.block((fn, None), 5)) * 1e3


def forward(s: int, b: int, h: int, dtype: torch.dtype = torch.float32,
            blocks: tuple[int, ...] = (128, 192, 256)) -> str:
    """One line: one causal call and one full call in ms, then one causal call over each block size."""
    q, k, v = (torch.randn(b, h, s, 64, dtype=dtype) for _ in range(3))
    one = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want, cells = one(), []
    for block in blocks:
        if block < s:
            blocked = lambda block=block: _blocked_causal(q, k, v, None, block)
            assert_close(blocked(), want, REDUCTION)
            cells.append(f"block {block}: {versus(timer, one, blocked)}")
    full = ms(lambda: F.scaled_dot_product_attention(q, k, v))
    name = str(dtype).removeprefix("torch.")
    return f"S={s} B{b} H{h} {name}: causal {ms(one):.1f} ms, full {full:.1f} ms; " + "; ".join(cells)


def forward_backward(s: int, block: int) -> str:
    """Forward and backward at B8 H8: one causal call over the blocks."""
    q, k, v = (torch.randn(8, 8, s, 64, requires_grad=True) for _ in range(3))
    g = torch.randn(8, 8, s, 64)
    one = lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)
    blocked = lambda: torch.autograd.grad(_blocked_causal(q, k, v, None, block), (q, k, v), g)
    return f"S={s} B8 H8 forward and backward: block {block}: {versus(timer, one, blocked)}"


print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, torch {torch.__version__}")
torch.manual_seed(0)
for shape in ((256, 8, 8), (384, 8, 8), (448, 8, 8), (512, 8, 8), (640, 4, 8), (768, 4, 8), (1024, 2, 8)):
    print(forward(*shape), flush=True)
print(forward_backward(512, 128))
print(forward_backward(512, 256))
for dtype in (torch.bfloat16, torch.float16):
    for s in (384, 448, 512, 640):
        print(forward(s, 8 if s <= 512 else 4, 8, dtype, blocks=(256,)), flush=True)
