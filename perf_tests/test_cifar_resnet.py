"""One training step of the CIFAR ResNet workload: the reference loop vs the engine.

Reference: fp32, per-parameter Python SGD (momentum 0.9), plain loop. Optimized: the same SGD
as kernels.sgd (fused) under Recipe.auto, which on CPU times fp32 / bf16 / channels_last /
both on this model and batch before the timed rounds. The CPU floor is keyed to the recipe auto
chose: its gain is bf16's, so where auto keeps fp32 (a CPU whose bf16 is slower) no CPU floor
applies and the row says so. No CUDA floor yet (evidence/floors.md).

Peer rows (perf_tests/peers.py): the step as PyTorch's AMP docs write it, with torch.optim.SGD
at its defaults (foreach), in fp32 and under autocast bf16: the loop a user has without an engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
import reference
import reference.training
from kernels.models import ResNet10
from kernels.training import Recipe, train
from perf_tests.peers import torch_step
from perfgate.fingerprint import bf16_instructions
from workloads.cifar_resnet import synthetic_cifar

BATCH = {"smoke": 64, "full": 2048}  # full: the original's baseline batch
PEERS = {"peer: torch loop": None, "peer: torch loop, autocast bf16": torch.bfloat16}


@pytest.mark.speedup(cpu=1.2, variant="bfloat16*")
@pytest.mark.speedup(over="peer: torch loop")
@pytest.mark.speedup(over="peer: torch loop, autocast bf16")
@pytest.mark.parametrize("impl", ["reference", "optimized", *PEERS])
def test_cifar_resnet_step(perf, impl: str) -> None:
    batch = BATCH[perf.size]
    x, y = synthetic_cifar(batch)
    x, y = x.to(perf.device), y.to(perf.device)
    torch.manual_seed(0)
    model = ResNet10().to(perf.device)
    if impl in PEERS:  # torch.optim.SGD at its defaults (foreach), the step as torch's docs write it
        if PEERS[impl] is torch.bfloat16 and perf.device == "cpu" and not bf16_instructions():
            pytest.skip(f"{impl}: this CPU has no bf16 instructions; emulated autocast bf16 ran 13.6x "
                        "slower than our step on an AVX2 Zen 3, not a loop a user would keep")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = lambda: torch_step(model, F.cross_entropy, opt, x, y, PEERS[impl])
        loss = perf(step, label=f"ResNet10 B={batch}")
        assert bool(torch.isfinite(loss))
        return
    side = reference if impl == "reference" else kernels
    opt = side.sgd(model.parameters(), lr=0.01, momentum=0.9)
    if impl == "reference":
        result = perf(lambda: reference.training.train(model, F.cross_entropy, opt, [(x, y)]),
                      label=f"ResNet10 B={batch}")
        assert result.optimizer_steps == 1 and all(torch.isfinite(torch.tensor(result.losses)))
        return
    recipe = Recipe.auto(perf.device, model=model, loss_fn=F.cross_entropy, batch=(x, y))
    if recipe.channels_last:  # data arrive in the layout the run uses, outside the timed calls
        x = x.contiguous(memory_format=torch.channels_last)
    scaler = torch.amp.GradScaler(torch.device(perf.device).type) if recipe.grad_scaler else None
    result = perf(lambda: train(model, F.cross_entropy, opt, [(x, y)], recipe, scaler=scaler),
                  label=f"ResNet10 B={batch} auto={recipe.name}", variant=recipe.name)
    assert result.optimizer_steps == 1 and all(torch.isfinite(torch.tensor(result.losses)))
