"""The RoPE rotation in one pass (kernels._rope, C) against the same rotation through torch ops.

    python -m evidence.rope_rotation [cache|default]

B8 H8 S512 D64 fp32, 2 threads, 15 interleaved ABBA pairs a line (perfgate.timing), speedup
(95% CI) and the two medians. First the forward alone in each pair layout (the torch ops:
half-split four ops over half rows; paired an interleaving copy then the complex multiply;
interleaved one complex multiply), the torch ops' time over the C part's; then the forward and
backward over the reference's, through each path; then rope_attention (which rotates q and k
with ``paired``) through the torch ops over the C part, full and causal.
"""

import sys

from perfgate.timing import configure_malloc, timer_for

mode = configure_malloc(sys.argv[1] if len(sys.argv) > 1 else "cache")  # before any large allocation

from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

import kernels  # noqa: E402
import kernels.rope as K  # noqa: E402
import reference  # noqa: E402
from evidence.ab import versus  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402

torch.set_num_threads(2)
timer = timer_for("cpu")
C = K._c
assert C is not None, "kernels._rope is not built: pip install -e . (or make install) compiles it"


def torch_ops(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with kernels.rope's C part switched off: its torch ops rotate."""
    def run() -> object:
        K._c = None
        try:
            return fn()
        finally:
            K._c = C
    return run


print(f"{_cpu_model()}, malloc {mode}, {torch.get_num_threads()} threads, torch {torch.__version__}")
torch.manual_seed(0)
x = torch.randn(8, 8, 512, 64, requires_grad=True)
grad = torch.randn(8, 8, 512, 64)
for name, interleaved_pairs, paired in (("half-split", False, False), ("paired", False, True),
                                        ("interleaved", True, False)):
    rope = kernels.RotaryEmbedding(64, interleaved=interleaved_pairs)
    fn = (lambda rope=rope: rope.paired(x.detach())) if paired else (lambda rope=rope: rope(x.detach()))
    # D 64 leaves torch's complex multiply no scalar tail (which may fuse a multiply-add); half-split:
    # torch's addcmul may fuse one, within one rounding
    assert torch.equal(fn(), torch_ops(fn)()) or name == "half-split"
    print(f"forward, {name}: torch ops / C part {versus(timer, torch_ops(fn), fn)}", flush=True)

ref = reference.RotaryEmbedding(64)
ours = kernels.RotaryEmbedding(64)
backward = lambda rope: (lambda: torch.autograd.grad(rope(x), x, grad)[0])
print(f"forward and backward, half-split: reference / C part {versus(timer, backward(ref), backward(ours))}")
slow = versus(timer, backward(ref), torch_ops(backward(ours)))
print(f"forward and backward, half-split: reference / torch ops {slow}")

q, k, v = (torch.randn(8, 8, 512, 64) for _ in range(3))
for causal in (False, True):
    attend = lambda causal=causal: kernels.rope_attention(q, k, v, ours, causal=causal)
    print(f"rope_attention S=512 {'causal' if causal else 'full'}: torch ops / C part "
          f"{versus(timer, torch_ops(attend), attend)}", flush=True)
