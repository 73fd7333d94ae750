"""rope_attention's fused CPU path against rotating q and k first, interleaved in one process.

    python -m evidence.fused_attention [cache|default] [causal]

Without the causal mask in float32 on the CPU, kernels/attention.py's fused path rotates each
chunk's q and k by the C pass into buffers of their own and attends over them at once, a few
heads at a time (FUSED_BYTES), instead of rotating both tensors whole and then
attending (the explicit path up to 128 positions, SDPA above). Each line: the other paths' time
over the fused one's, point (95% CI) and the two medians from 15 interleaved ABBA pairs
(evidence/ab.py), at 2 threads and at 1, D 64, forward, no mask; B8 H8 up to S=512, then fewer
batch rows; then at 2 threads grouped-query heads (8 q heads over 2 kv heads) and a boolean mask.
Beyond the lengths where the path is taken (CPU_FUSED_SEQ, CPU_FUSED_SEQ_TWO_THREADS) it is forced,
to show where it stops paying. Each fused result is checked against the other's at the project's
tolerance.

``causal``: the causal mask instead, at 2 threads and at 1 up to S=512 (the fused path's softmax
over each query's keys up to its own position, kernels._softmax's causal rows, against rotating
first and SDPA's causal call, or its blocks over 384-512), then at S=128 grouped-query heads and
the causal mask with a boolean one (the two as one mask in the fused path).
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from unittest import mock  # noqa: E402

import torch  # noqa: E402

import kernels  # noqa: E402
import kernels.attention as KA  # noqa: E402
from correctness_tests.tolerances import REDUCTION, assert_close  # noqa: E402
from evidence.ab import versus  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

timer = timer_for("cpu")
LENGTHS = {2: (64, 128, 192, 256, 384, 512, 768, 1024), 1: (64, 128, 192, 256, 512)}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: kernels.RotaryEmbedding, fused: bool,
           mask: torch.Tensor | None = None, causal: bool = False):
    """rope_attention with the fused path taken (``fused``) or left, whatever the length."""
    def run() -> torch.Tensor:
        with mock.patch.object(KA, "_fuses", lambda *args: fused):
            return kernels.rope_attention(q, k, v, rope, attn_mask=mask, causal=causal)
    return run


def line(label: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> None:
    """One line: rotating first over fused, the fused result checked against the other's."""
    rope = kernels.RotaryEmbedding(64)
    first, fused = attend(q, k, v, rope, False, mask, causal), attend(q, k, v, rope, True, mask, causal)
    assert_close(fused(), first(), REDUCTION)
    combined = KA.combined_mask(mask, causal, q.shape[2], q.device, q.dtype)  # as rope_attention passes it
    taken = KA._fuses(q, k, v, rope, causal, combined, None)
    print(f"{label}{'' if taken else ' (forced)'}: {versus(timer, first, fused)}", flush=True)


if sys.argv[2:] == ["causal"]:
    print(f"{_cpu_model()}, malloc {mode}, torch {torch.__version__}; rotated first / fused, D64 fp32, causal")
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for s in (64, 128, 192, 256, 384, 512):
            torch.manual_seed(0)
            line(f"{threads} thread(s), S={s} B8", *(torch.randn(8, 8, s, 64) for _ in range(3)), causal=True)
        torch.manual_seed(0)
        line(f"{threads} thread(s), S=128 B8, H8 over 2 kv heads", torch.randn(8, 8, 128, 64),
             *(torch.randn(8, 2, 128, 64) for _ in range(2)), causal=True)
        pad = torch.ones(8, 1, 1, 128, dtype=torch.bool)
        pad[..., -16:] = False  # the last 16 keys padding
        line(f"{threads} thread(s), S=128 B8, a padding mask", *(torch.randn(8, 8, 128, 64) for _ in range(3)),
             mask=pad, causal=True)
    sys.exit()
print(f"{_cpu_model()}, malloc {mode}, torch {torch.__version__}; rotated first / fused, "
      "D64 fp32, not causal")
for threads, lengths in LENGTHS.items():
    torch.set_num_threads(threads)
    for s in lengths:
        b = 8 if s <= 512 else 4 if s <= 768 else 2
        torch.manual_seed(0)
        line(f"{threads} thread(s), S={s} B{b}", *(torch.randn(b, 8, s, 64) for _ in range(3)))
torch.set_num_threads(2)
for s in (128, 256, 512):
    torch.manual_seed(0)
    line(f"2 thread(s), S={s} B8, H8 over 2 kv heads", torch.randn(8, 8, s, 64),
         *(torch.randn(8, 2, s, 64) for _ in range(2)))
    mask = torch.rand(8, 1, s, s) < 0.7
    mask[..., 0] = True  # every query keeps a key
    line(f"2 thread(s), S={s} B8, a boolean mask", *(torch.randn(8, 8, s, 64) for _ in range(3)), mask=mask)
