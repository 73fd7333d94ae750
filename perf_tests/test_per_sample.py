"""Per-sample gradients of the OCS MLP (784-256-256-10): loop of backward passes vs identities.

The floors sit under the measured spread (the grads row follows memory bandwidth) and above losing
the kernel (~1x; the Gram's materialized row ~1.5x) (evidence/from-the-code.md). The CUDA
floors (full size) sit far under the committed H100 baseline (evidence/floors.md).

Peer rows (perf_tests/peers.py): Opacus's GradSampleModule (per-layer hooks; its norms as its
clipping computes them; its E @ E.T for the Gram) and its ghost clipping (fast gradient clipping,
the norms from each Linear layer's activations and backprops), the library a user would pick for
per-sample gradients; skipped with the reason where opacus is not installed. The "vmap" row is torch.func's
vmap(grad) recipe for every layer, and "peer: torch.compile(vmap)" that recipe compiled by inductor (a
torch user's first alternative; no floor: docs/peers.md); "optimized vs X" rows time ours against X
directly.
"""

from __future__ import annotations

import pytest
import torch

import kernels
import reference
from correctness_tests.tolerances import ELEMENTWISE, REDUCTION, assert_close, assert_dicts_close
from perf_tests.peers import COMPILED_VMAP, PEERS
from workloads.common import per_sample_problem, vmap_grads

BATCH = {"smoke": 64, "full": 256}
IMPLS = {"reference": reference, "optimized": kernels}


def _time(perf, fn, ref_fn) -> None:
    """Time ``fn(model, loss, x, y)`` on the OCS MLP at this session's size, then check the timed
    result equals the reference's on the same inputs (the pair computes one function here too)."""
    batch = BATCH[perf.size]
    args = per_sample_problem(batch, perf.device)
    got = perf(lambda: fn(*args), label=f"MLP B={batch}")
    want = ref_fn(*args)
    if isinstance(want, dict):
        assert_dicts_close(got, want, ELEMENTWISE)
    else:
        assert_close(got, want, REDUCTION)


def _into_buffers():
    """Row "optimized, out=": per_sample_grads writing into the previous call's result, as a
    training loop can, so its B x P output is not allocated (and page-faulted) on every call."""
    buffers: dict[str, torch.Tensor] = {}

    def run(model, loss_fn, x, y):
        if not buffers:
            buffers.update(kernels.per_sample_grads(model, loss_fn, x, y))
        return kernels.per_sample_grads(model, loss_fn, x, y, out=buffers)

    return run


def _materialized_gram(model, loss_fn, x, y):
    """Ablation row: the kernel's per-sample gradients, flattened, then E @ E.T (no ghost)."""
    flat = torch.cat([g.flatten(1) for g in kernels.per_sample_grads(model, loss_fn, x, y).values()], 1)
    return flat @ flat.T


@pytest.mark.speedup(cpu={"smoke": 3.3, "full": 5.0}, cuda={"full": 10.0})
@pytest.mark.speedup(cpu={"smoke": 1.0}, over="vmap")
@pytest.mark.speedup(impl="optimized, out=", cpu={"smoke": 0.95}, over="vmap")
@pytest.mark.speedup(cpu={"smoke": 1.4}, over="peer: opacus")
@pytest.mark.speedup(over=COMPILED_VMAP)
@pytest.mark.speedup(impl="optimized, out=", over=COMPILED_VMAP)
@pytest.mark.parametrize("impl", ["reference", "vmap", "optimized", "optimized, out=", "peer: opacus",
                                  COMPILED_VMAP])
def test_per_sample_grads(perf, impl: str) -> None:
    fn = (PEERS[impl] if impl.startswith("peer") else vmap_grads if impl == "vmap" else
          _into_buffers() if impl == "optimized, out=" else IMPLS[impl].per_sample_grads)
    _time(perf, fn, reference.per_sample_grads)


@pytest.mark.speedup(cpu={"smoke": 10.0, "full": 20.0}, cuda={"full": 10.0})
@pytest.mark.speedup(cpu={"smoke": 9.0}, over="peer: opacus Gram")
@pytest.mark.parametrize("impl", ["reference", "materialized", "optimized", "peer: opacus Gram"])
def test_per_sample_grad_gram(perf, impl: str) -> None:
    fn = {"materialized": _materialized_gram, **PEERS}.get(impl) or IMPLS[impl].per_sample_grad_gram
    _time(perf, fn, reference.per_sample_grad_gram)


@pytest.mark.speedup(cpu={"smoke": 10.08, "full": 20.0}, cuda={"full": 10.0})
@pytest.mark.speedup(cpu={"smoke": 3.0}, over="peer: opacus norms")
@pytest.mark.speedup(cpu={"smoke": 0.75}, over="peer: opacus ghost clipping")
@pytest.mark.parametrize("impl", [*IMPLS, "peer: opacus norms", "peer: opacus ghost clipping"])
def test_per_sample_grad_norms(perf, impl: str) -> None:
    fn = PEERS.get(impl) or IMPLS[impl].per_sample_grad_norms
    _time(perf, fn, reference.per_sample_grad_norms)
