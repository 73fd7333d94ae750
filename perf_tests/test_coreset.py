"""The OCS selection step on the original MLP (784-256-256-10): the reference materializes E with
the per-sample loop and computes every cosine literally; the kernel works from Gram products.

Stream of rotated digits (smoke 100, the original's stream; full 512), replay memory of 200 (the
original's total memory, against which every step from task 2 on measures affinity). The timed
result must select the reference's samples.

Peer row: Opacus's per-sample gradients (E materialized by hooks) and the original's formulas
(perf_tests/peers.py), what a user with a per-sample-gradient library would write.

The floors sit under the measured speedups and far above a lost ghost path (materialized E:
~1.2x) (evidence/from-the-code.md, floors.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
import reference
from kernels.models import MLP
from perf_tests.peers import PEERS
from workloads.rotated_digits import digits, rotated_tasks

STREAM = {"smoke": 100, "full": 512}
MEMORY = 200
K = 10
IMPLS = {"reference": reference.ocs_select, "optimized": kernels.ocs_select}
PEER = "peer: opacus + OCS formulas"


@pytest.mark.speedup(cpu={"smoke": 7.5, "full": 30.0}, cuda={"full": 15.0})
@pytest.mark.speedup(cpu={"smoke": 7.6}, over=PEER)
@pytest.mark.parametrize("impl", [*IMPLS, PEER])
def test_ocs_select(perf, impl: str) -> None:
    (train, _), = rotated_tasks(digits(), 1, device=perf.device)
    n = STREAM[perf.size]
    x, y = train[0].repeat(2, 1)[:n], train[1].repeat(2)[:n]  # 512 > 1437 // 2: wrap around
    memory = (train[0][-MEMORY:], train[1][-MEMORY:])
    torch.manual_seed(0)
    model = MLP().to(perf.device).eval()
    fn = IMPLS.get(impl) or PEERS[impl]
    got = perf(lambda: fn(model, F.cross_entropy, x, y, K, memory=memory),
               label=f"MLP N={n} M={MEMORY} k={K}")
    assert torch.equal(got, reference.ocs_select(model, F.cross_entropy, x, y, K, memory=memory))
