"""One training step of the RoPE ViT workload (D 192, 6 heads, depth 6, 64 tokens): the reference
(fp32, per-call RoPE, explicit softmax, Python AdamW, plain loop) against the optimized run
(cached RoPE + the attention kernel, fused AdamW, the engine under Recipe.auto with 2
micro-batches a step; auto picks bf16, so attention runs in SDPA).

No CPU speedup floor: the step's gain is bf16 matmul's on the CPU at hand (the fp32 engine alone
is ~1.03x), and that differs between CPU models with the same bf16 instructions, so no floor is
true of every CPU (evidence/floors.md). The row is gated against its machine's own
baseline (`make bench`); losing its kernels fails their own rows (attention, AdamW).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.models import RopeViT
from workloads.vit_rope import Config, optimized_method, reference_method

BATCH = {"smoke": 32, "full": 128}


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_vit_rope_step(perf, impl: str) -> None:
    cfg = Config(steps=1, warmup_steps=0, batch=BATCH[perf.size], device=perf.device)
    method = reference_method() if impl == "reference" else optimized_method(cfg)
    torch.manual_seed(0)
    model = RopeViT(attention=method.attention).to(perf.device)
    opt = method.optimizer_fn(model.parameters(), lr=1e-3, weight_decay=0.05)
    batches = cfg.data(method.recipe.accumulation if method.recipe else 1)
    step = lambda: method.train_fn(model, F.cross_entropy, opt, batches, method.recipe, device=perf.device,
                                   max_grad_norm=cfg.max_grad_norm)  # both clip at 1.0, as the original
    result = perf(step, label=f"B={cfg.batch} {method.name}")
    assert result.optimizer_steps == 1 and all(torch.isfinite(torch.tensor(result.losses)))
