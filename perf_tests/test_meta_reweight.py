"""One outer step of the Meta-Weight-Net workload (inner step + hypergradient + Adam on W) and
its peak memory, Betty's memory table as gated rows: every impl against the reference (fp32,
one batch, Python SGD, the exact hypergradient) in the same run.

Smoke runs batch 100: smaller micro-batches are slow convolutions on CPU. The "optimized" row is
the fixed recipe bf16 (a CPU with bf16 instructions) / fp32 (one without) / fp16 (CUDA) x 4
micro-batches, so the gated row does not move with Recipe.auto's timing; the CLI's optimized run
uses Recipe.auto. The floors sit under every
measurement and above losing the DARTS kernel (1.0x) or bf16 (evidence/from-the-code.md).
"""

from __future__ import annotations

import pytest
import torch

from kernels.training import Recipe
from perfgate.fingerprint import bf16_instructions
from reference.workloads.meta_reweight import reference_step
from workloads.common import amp_recipe
from workloads.meta_reweight import Config, batches, datasets, learner, outer_step, reference_learner

BATCH = {"smoke": 100, "full": 200}
ACCUMULATION = 4


def _recipe(impl: str, device: str) -> Recipe:
    """The row's fixed recipe. On a CPU without bf16 instructions "optimized" is fp32 (what
    Recipe.auto keeps there) and the bf16 ablation is skipped: emulated bf16 ran 5x slower than
    the reference on an AVX2 Zen 3, a row that says only that this CPU lacks bf16."""
    amp = "amp" in impl
    k = ACCUMULATION if "accumulation" in impl or impl == "optimized" else 1
    if device == "cpu" and (amp or impl == "optimized") and not bf16_instructions():
        if amp:
            pytest.skip(f"{impl}: this CPU has no bf16 instructions (AVX512-BF16 / AMX-BF16); "
                        "autocast bf16 is emulated here, so the bf16 rows are measured where it is native")
        return Recipe(accumulation=k)
    return amp_recipe(device, k) if amp or impl == "optimized" else Recipe(accumulation=k)


@pytest.mark.speedup(cpu={"smoke": 1.3, "full": 1.6}, variant="bf16 instructions")
@pytest.mark.speedup(cpu=1.5, impl="darts+amp", variant="bf16 instructions")
@pytest.mark.memory(cpu=0.7)
@pytest.mark.memory(cpu=0.4, impl="darts")
@pytest.mark.memory(cpu=0.6, impl="darts+amp", variant="bf16 instructions")
@pytest.mark.memory(cpu=0.7, impl="darts+accumulation")
@pytest.mark.parametrize("impl", ["reference", "darts", "darts+amp", "darts+accumulation", "optimized"])
def test_meta_reweight_step(perf, impl: str) -> None:
    b = BATCH[perf.size]
    cfg = Config(max_per_class=max(b, 100), meta_per_class=b // 10, batch=b, meta_batch=b, device=perf.device)
    if impl == "reference":
        ln, step = reference_learner(cfg), reference_step
    else:
        ln, step = learner(cfg, recipe=_recipe(impl, perf.device)), outer_step
    train_set, meta_set, _ = datasets(cfg)
    batch, meta = next(batches(train_set, b, 1)), next(batches(meta_set, b, 2))
    calls = []

    def outer() -> None:
        step(ln, batch, meta, cfg)
        calls.append(1)

    # the bf16 rows' CPU floors hold where the CPU has bf16 instructions (fingerprint.py); without
    # them "optimized" runs fp32 (_recipe) and its bf16 floors do not apply
    variant = "bf16 instructions" if bf16_instructions() else "no bf16 instructions"
    perf(outer, label=f"batch {b}, {ln.recipe.name} x{ln.recipe.accumulation}", variant=variant)
    w = next(ln.weight_net.parameters())  # every call made one Adam step of W, none skipped
    assert int(ln.outer_opt.state[w]["step"]) == len(calls)
    assert all(bool(torch.isfinite(p).all()) for p in ln.model.parameters())
