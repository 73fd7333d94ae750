"""The ResNet-on-CIFAR workload: reference loop vs the engine, with the original's ablation.

Model: kernels.models.ResNet10 (0.31M parameters, the size class of the original's 230k course net).
Data: CIFAR-shaped (3x32x32, 10 classes) synthetic images a model can learn: each class is a
smooth random template (4x4 noise upsampled), each image its template plus pixel noise. No
download; pass real CIFAR-10 tensors to ``run`` instead if you have them locally.

    python -m workloads.cli.cifar_resnet --steps 30 --batch 128 [--device cpu] [--no-compile]

prints the ablation table: each row adds one optimization, measured on this device in one run,
compile time apart, accuracy on held-out images after the same number of steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from itertools import islice

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.determinism import deterministic
from kernels.models import ResNet10
from kernels.optim import adamw
from kernels.training import Recipe, train
from reference.workloads import cifar_resnet as reference_run
from workloads.cifar_data import as_stored, loader
from workloads.common import amp_recipe, bf16_emulated, check_device, markdown, progress, require_positive


def synthetic_cifar(n: int, *, seed: int = 0, classes: int = 10, noise: float = 2.5,
                    y: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x (n, 3, 32, 32) float32, standardized; y (n,) int64 class ids (drawn uniformly, or the
    given ``y``, e.g. a long-tailed label list)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    gen = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.randn(classes, 3, 4, 4, generator=torch.Generator().manual_seed(1234)),
                              size=32, mode="bilinear", align_corners=False)
    if y is None:
        y = torch.randint(0, classes, (n,), generator=gen)
    elif y.shape != (n,) or y.dtype != torch.int64 or not bool(((y >= 0) & (y < classes)).all()):
        raise ValueError(f"y must be ({n},) int64 class ids in [0, {classes}), got {tuple(y.shape)} {y.dtype}")
    x = templates[y] + noise * torch.randn(n, 3, 32, 32, generator=gen)
    return (x - x.mean()) / x.std(), y


@dataclass
class RunReport:
    name: str
    ms_per_step: float  # median-free mean over the timed steps (first steps excluded)
    first_steps_s: float  # the untimed warm-up steps: compile time lives here
    accuracy: float  # on held-out images after the run
    final_loss: float
    losses: list[float] = field(default_factory=list)  # per optimizer step, warm-up steps included


@dataclass(frozen=True)
class Config:
    steps: int = 30
    batch: int = 128
    warmup: int = 2
    device: str = "cpu"
    seed: int = 0
    eval_images: int = 1000  # held-out images the accuracy is measured on

    def __post_init__(self) -> None:
        require_positive(self, ("steps", "batch", "eval_images"))
        check_device(self.device)

    def batches(self, channels_last: bool = False, micro: int = 1) -> list[tuple[Tensor, Tensor]]:
        """Preloaded on the device once, in the layout the run uses: the loops time compute,
        not host copies or layout conversions. Each step's batch in ``micro`` micro-batches."""
        if self.batch % micro:
            raise ValueError(f"batch ({self.batch}) must split into {micro} equal micro-batches")
        x, y = synthetic_cifar((self.steps + self.warmup) * self.batch, seed=self.seed)
        x, y = x.to(self.device), y.to(self.device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        size = self.batch // micro
        return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


@torch.no_grad()
def accuracy(model: torch.nn.Module, device: str, n: int) -> float:
    """On ``n`` held-out images (synthetic, of another seed)."""
    x, y = synthetic_cifar(n, seed=10_000)
    model.eval()
    return (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()


def timed(name: str, cfg: Config, model: torch.nn.Module, step: Callable[[Iterable], object],
          channels_last: bool = False, micro: int = 1, data: Iterable | None = None) -> RunReport:
    """Warm-up steps apart, then the timed steps; accuracy after both. ``data``: batches from a
    loader (read as the steps run, so loading is in the time), else ``cfg.batches`` preloaded."""
    batches = iter(cfg.batches(channels_last, micro) if data is None else data)
    t0 = time.perf_counter()
    warm = step(islice(batches, cfg.warmup * micro))
    t1 = time.perf_counter()
    result = step(islice(batches, cfg.steps * micro))
    t2 = time.perf_counter()
    held_out = accuracy(model, cfg.device, cfg.eval_images)
    return RunReport(name, 1e3 * (t2 - t1) / cfg.steps, t1 - t0, held_out, result.losses[-1],
                     [*warm.losses, *result.losses])


def run(cfg: Config, recipe: Recipe, name: str, lr: float = 2e-3, one_cycle: bool = False,
        workers: int | None = None, reproducible: bool = False) -> RunReport:
    """The optimized loop: fused AdamW (the original's opt 2 optimizer) under ``recipe``, each
    step's batch in ``recipe.accumulation`` micro-batches; ``one_cycle``: OneCycleLR peaking at
    ``lr`` over the run's optimizer steps (the original's opt 2 schedule), stepped by the engine
    once per applied step. ``workers``: batches from the input pipeline (workloads.cifar_data:
    uint8 images cropped, flipped and normalized per item) with this many DataLoader workers,
    instead of preloaded tensors. ``reproducible``: the whole run in ``kernels.deterministic``."""
    if reproducible:
        with deterministic(cfg.seed):
            return run(cfg, recipe, name, lr, one_cycle, workers)
    torch.manual_seed(cfg.seed)
    model = ResNet10().to(cfg.device)
    opt = adamw(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=cfg.warmup + cfg.steps)
             if one_cycle else None)
    # one scaler across the warm-up and timed calls, so the timed steps keep its learned scale
    scaler = torch.amp.GradScaler(torch.device(cfg.device).type) if recipe.grad_scaler else None
    data = None
    if workers is not None:  # the pipeline's workers start here, before the clock
        x, y = synthetic_cifar((cfg.steps + cfg.warmup) * cfg.batch, seed=cfg.seed)
        data = iter(loader(as_stored(x), y, batch=cfg.batch // recipe.accumulation, workers=workers, seed=cfg.seed,
                           device=cfg.device))
    return timed(name, cfg, model,
                 lambda d: train(model, F.cross_entropy, opt, d, recipe, device=cfg.device, scaler=scaler,
                                 scheduler=sched),
                 recipe.channels_last, recipe.accumulation, data)


def run_reference(cfg: Config, lr: float = 0.01) -> RunReport:
    """The reference run (reference.workloads.cifar_resnet) on the same model and data."""
    torch.manual_seed(cfg.seed)
    model = ResNet10().to(cfg.device)
    return timed(reference_run.NAME, cfg, model, reference_run.steps(model, cfg.device, lr))


LOADER_WORKERS = (0, 2)


def compile_modes(device: str) -> tuple[str, ...]:
    """The torch.compile modes an ablation measures on ``device``: reduce-overhead is CUDA graphs
    (the OCS seed's choice for small batches), which a CPU does not have: there torch compiles it
    as the default mode, so it gets no row of its own; max-autotune (the ViT seed's) autotunes
    the CPU's GEMM templates or CUDA's Triton kernels."""
    return ("default", "reduce-overhead", "max-autotune") if device.startswith("cuda") else \
        ("default", "max-autotune")


def ablation(cfg: Config, compile_: bool = True, emulated_bf16: bool = False) -> list[RunReport]:
    """baseline / + fused AdamW / + AMP / + channels_last / + compile / auto / auto + OneCycleLR
    with accumulation 2 / auto fed by the DataLoader pipeline with 0 and 2 workers, in one
    process (--batch must be even for the accumulation row). Where bf16 is emulated (a CPU without
    bf16 instructions) the AMP rows are left out and the later rows build on fp32, unless
    ``emulated_bf16``."""
    amp_rows = emulated_bf16 or not bf16_emulated(cfg.device)
    amp = amp_recipe(cfg.device) if amp_rows else Recipe()
    x, y = cfg.batches()[0]
    auto = Recipe.auto(cfg.device, model=ResNet10().to(cfg.device), loss_fn=F.cross_entropy, batch=(x, y))
    # (name, recipe, run's keywords): one row each, in the table's order
    rows: list[tuple[str, Recipe | None, dict]] = [
        (reference_run.NAME, None, {}), ("+ fused AdamW (fp32)", Recipe(), {}),
        *([("+ AMP", amp, {})] if amp_rows else []), ("+ channels_last", replace(amp, channels_last=True), {})]
    if compile_:  # compile time is in the warm-up column, apart from ms/step
        rows += [("+ compile" if mode == "default" else f"+ compile ({mode})",
                  replace(amp, channels_last=True, compile_mode=mode), {}) for mode in compile_modes(cfg.device)]
    rows += [(f"auto ({auto.name})", auto, {}),
             ("auto, deterministic", auto, {"reproducible": True}),  # what reproducibility costs
             # the original's "Optimization 2": AdamW + OneCycleLR + gradient accumulation
             ("auto + OneCycleLR, accumulation 2", replace(auto, accumulation=2), {"one_cycle": True})]
    # the original's input pipeline: augmented per item by a DataLoader, in-process and in 2 workers
    rows += [(f"auto + DataLoader, {w} workers (crop, flip, normalize)", auto, {"workers": w})
             for w in LOADER_WORKERS]
    return [run_reference(cfg) if recipe is None else run(cfg, recipe, name, **kw)
            for name, recipe, kw in progress(rows, desc="ablation", unit="run")]


HEADER = ["run", "ms/step", "speedup", "warm-up s (compile)", "accuracy", "final loss"]


def table(rows: list[RunReport]) -> list[list[str]]:
    """The cells of ``HEADER``, one list per run."""
    base = rows[0].ms_per_step
    return [[r.name, f"{r.ms_per_step:.1f}", f"{base / r.ms_per_step:.2f}x", f"{r.first_steps_s:.1f}",
             f"{r.accuracy:.1%}", f"{r.final_loss:.3f}"] for r in rows]


def format_rows(rows: list[RunReport]) -> list[str]:
    return markdown(HEADER, table(rows))
