"""Optimizer steps: per-parameter Python loops vs the torch optimizers kernels.* choose (fused, foreach).

The resnet18 rows time one step over its 62 parameter tensors (11.7M values) with fixed grads;
the ablation rows are torch's own for-loop and foreach implementations, the peer row torch.compile
of torch's default step. The bandwidth row moves
50M parameters and compares AdamW's bytes/s (28 bytes a parameter: p, g, m, v read; p, m, v
written) with an in-place stream over 50M floats (x.mul_, 8 bytes a value) in the same run:
its "speedup" is the fraction of the streaming bandwidth AdamW reaches.

The floors sit under every measurement and above losing fused (AdamW ~1.0x, bandwidth ~0.2); SGD's
1.0x means "never slower than the Python loop", the baseline compare of `make bench` watches the
rest (evidence/from-the-code.md, floors.md).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kernels
import reference
from perf_tests.peers import COMPILED

STEP = {"reference": reference, "optimized": kernels}
BANDWIDTH_PARAMS = {"smoke": 50_000_000, "full": 50_000_000}


def _resnet18_params(device: str) -> list[torch.Tensor]:
    import torchvision

    torch.manual_seed(0)
    params = [p.detach().to(device).requires_grad_() for p in torchvision.models.resnet18().parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _step(kind: str, impl: str, params: list[torch.Tensor]) -> Callable[[], object]:
    """One optimizer step of ``impl``: ours, the reference, torch's for-loop or foreach step, or
    torch.compile of torch's default step (PyTorch's compiled-optimizer recipe)."""
    hyper = dict(lr=1e-3, weight_decay=1e-2) if kind == "adamw" else dict(lr=1e-2, momentum=0.9)
    if impl in STEP:
        return getattr(STEP[impl], kind)(params, **hyper).step
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    if impl == COMPILED:
        return torch.compile(cls(params, **hyper).step)
    return cls(params, foreach=impl == "torch_foreach", **hyper).step


def _time_steps(perf, kind: str, impl: str) -> None:
    """Time steps over resnet18's parameters; they must have moved and stayed finite."""
    params = _resnet18_params(perf.device)
    before = [p.detach().clone() for p in params]
    perf(_step(kind, impl, params), label="resnet18 11.7M")
    assert all(torch.isfinite(p).all() for p in params)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


@pytest.mark.speedup(cpu=2.0, cuda={"full": 4.0})
@pytest.mark.speedup(cpu={"smoke": 2.2}, over="torch_foreach")
@pytest.mark.speedup(cpu={"smoke": 0.95}, over=COMPILED)
@pytest.mark.parametrize("impl", ["reference", "torch_forloop", "torch_foreach", "optimized", COMPILED])
def test_adamw_step(perf, impl: str) -> None:
    _time_steps(perf, "adamw", impl)


@pytest.mark.speedup(cpu={"smoke": 0.9, "full": 1.0}, cuda={"full": 2.0})
@pytest.mark.speedup(cpu={"smoke": 1.0}, over="torch_foreach")
@pytest.mark.speedup(over=COMPILED)
@pytest.mark.parametrize("impl", ["reference", "torch_forloop", "torch_foreach", "optimized", COMPILED])
def test_sgd_step(perf, impl: str) -> None:
    _time_steps(perf, "sgd", impl)


@pytest.mark.speedup(cpu={"smoke": 0.55, "full": 0.55}, cuda={"full": 0.6})
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_adamw_bandwidth(perf, impl: str) -> None:
    n = BANDWIDTH_PARAMS[perf.size]
    if impl == "reference":  # the roofline: an in-place stream over n floats
        x = torch.randn(n, device=perf.device)
        perf(lambda: x.mul_(1.0000001), label="50M params vs in-place stream", work_bytes=8.0 * n)
        assert torch.isfinite(x).all()
        return
    p = torch.zeros(n, device=perf.device, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = kernels.adamw([p])
    perf(opt.step, label="50M params vs in-place stream", work_bytes=28.0 * n)
    assert torch.isfinite(p).all() and int(opt.state[p]["step"]) > 1
