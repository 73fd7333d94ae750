"""The RoPE vision transformer workload (after Vision-BDH): reference loop vs the engine.

Model: kernels.models.RopeViT (4x4 patches of 32x32 images -> 64 tokens, D 192, 6 heads, pre-LN,
RoPE over the patch index with theta 2^16 and interleaved pairs). Data: CIFAR-shaped images a
model can learn (workloads.cifar_resnet.synthetic_cifar: per-class templates plus
noise), or CIFAR-10 from local files (``--cifar PATH``, its binary version, never downloaded).
Training: AdamW lr 1e-3 (a short budget; the original's 1e-4 is for long runs), weight decay 0.05,
linear warm-up then cosine decay, gradients clipped to a global norm of 1.0 as the original does
(both runs, once per optimizer step; ``--max-grad-norm``, ``--no-clip``).

Reference: fp32, per-call RoPE + explicit softmax attention, per-parameter Python AdamW, the
plain loop, one batch a step. Optimized: cached RoPE + the attention kernel (SDPA; on CPU in fp32
at these 64 tokens its measured explicit path, kernels/attention.py), fused AdamW, the engine under
``Recipe.auto`` (AMP only where it measures faster) with gradient accumulation: each step's batch
in ``accumulation`` micro-batches, the same samples as the reference's step.

    python -m workloads.cli.vit_rope [--steps 20] [--batch 64] [--accumulation 2] [--ablation]
        [--checkpoint PATH [--save-every K] [--resume]] [--max-grad-norm 1.0 | --no-clip]
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import RopeSelfAttention, check_attention
from kernels.models import RopeViT
from kernels.optim import adamw
from kernels.training import Recipe, check_max_grad_norm, load_checkpoint, save_checkpoint, train
from perfgate.timing import peak_memory
from reference.attention import softmax_attention
from reference.workloads import vit_rope as reference_run
from workloads.cifar_data import as_stored, loader
from workloads.cifar_resnet import compile_modes, synthetic_cifar
from workloads.common import amp_recipe, bf16_emulated, check_device, markdown, mib, progress, require_positive


@dataclass(frozen=True)
class Config:
    steps: int = 20  # timed optimizer steps
    warmup_steps: int = 2  # untimed, first (compile, allocator, caches)
    batch: int = 64  # samples per optimizer step
    accumulation: int = 2  # optimized run: micro-batches per step
    dim: int = 192
    heads: int = 6
    depth: int = 6
    lr: float = 1e-3
    weight_decay: float = 0.05
    device: str = "cpu"
    seed: int = 0
    cifar: str | None = None  # a folder holding CIFAR-10's cifar-10-batches-bin/, instead of synthetic images
    max_grad_norm: float | None = 1.0  # the original's clipping; None: none
    eval_images: int = 1000  # held-out images the accuracy is measured on
    checkpoint: str | None = None  # save the run's state here every save_every steps (atomically)
    save_every: int = 10
    resume: bool = False  # continue from ``checkpoint``

    def __post_init__(self) -> None:
        require_positive(self, ("steps", "batch", "accumulation", "dim", "heads", "depth", "save_every",
                                "eval_images"))
        check_max_grad_norm(self.max_grad_norm)
        check_device(self.device)
        if self.cifar is not None and not (Path(self.cifar) / CIFAR_BIN).is_dir():
            raise ValueError(f"cifar: {_no_cifar(self.cifar)}")
        if self.resume and (self.checkpoint is None or not Path(self.checkpoint).is_file()):
            raise ValueError(f"resume needs an existing checkpoint file, got {self.checkpoint!r}")
        if self.batch % self.accumulation:
            raise ValueError(f"batch ({self.batch}) must split into {self.accumulation} equal micro-batches")

    def images(self) -> tuple[Tensor, Tensor]:
        """The run's (steps + warm-up steps) x batch training images (N, 3, 32, 32) and labels, on the CPU."""
        n = (self.steps + self.warmup_steps) * self.batch
        x, y = cifar10(self.cifar, train=True) if self.cifar else synthetic_cifar(n, seed=self.seed)
        if len(y) < n:
            raise ValueError(f"{n} training images needed, the data has {len(y)}")
        return x[:n], y[:n]

    def data(self, micro: int = 1) -> list[tuple[Tensor, Tensor]]:
        """Step batches preloaded on the device, each cut into ``micro`` micro-batches."""
        x, y = (t.to(self.device) for t in self.images())
        n, size = len(y), self.batch // micro
        return [(x[i : i + size], y[i : i + size]) for i in range(0, n, size)]


@dataclass(frozen=True)
class Method:
    name: str
    attention: type[RopeSelfAttention]
    optimizer_fn: Callable  # kernels.adamw or reference.adamw
    train_fn: Callable  # kernels.training.train or reference.training.train
    recipe: Recipe | None = None  # None: the reference loop's plain fp32


@dataclass
class ViTReport:
    name: str
    ms_per_step: float
    peak_mib: float | None  # memory the timed steps added (perfgate's measure)
    accuracy: float
    final_loss: float
    losses: list[float] = field(default_factory=list)  # per optimizer step this run took
    warmup_s: float = 0.0  # the untimed warm-up steps: torch.compile's compile time lives here
    first_step: int = 1  # the step ``losses`` starts at: past 1 for a resumed run


def cosine_schedule(opt: torch.optim.Optimizer, total: int, warmup: int = 2) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


CIFAR_BIN = "cifar-10-batches-bin"  # CIFAR-10's binary version: raw bytes (the Python version is a pickle)
CIFAR_ROW = 1 + 3 * 32 * 32  # a record: its label byte, then its pixels, channel-major


def _no_cifar(root: str) -> str:
    return (f"no CIFAR-10 files under {root!r}: the binary version's {CIFAR_BIN}/ (data_batch_1.bin ... "
            "test_batch.bin) is read; the Python version's pickles are not (no pickle is read back from "
            "disk here), and this workload never downloads")


def cifar10(root: str, train: bool) -> tuple[Tensor, Tensor]:
    """CIFAR-10 from local files under ``root`` (its binary version, ``CIFAR_BIN``), standardized:
    (N, 3, 32, 32) float32 and (N,) int64. Never downloads, and reads no pickle."""
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
    paths = [Path(root) / CIFAR_BIN / name for name in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(_no_cifar(root) + f" (missing {', '.join(missing)})")
    raw = np.concatenate([np.fromfile(p, dtype=np.uint8) for p in paths])
    if raw.size % CIFAR_ROW:
        raise ValueError(f"the CIFAR-10 files under {root!r} are not whole {CIFAR_ROW}-byte records "
                         f"({raw.size} bytes): a damaged or partial copy")
    rows = torch.from_numpy(raw.reshape(-1, CIFAR_ROW))
    x = rows[:, 1:].reshape(-1, 3, 32, 32).float() / 255.0
    return (x - x.mean()) / x.std(), rows[:, 0].long()


@torch.no_grad()
def accuracy(model: nn.Module, cfg: Config) -> float:
    """On ``cfg.eval_images`` held-out images: synthetic ones of another seed, or CIFAR-10's test split."""
    n = cfg.eval_images
    x, y = cifar10(cfg.cifar, train=False) if cfg.cifar else synthetic_cifar(n, seed=10_000)
    x, y = x[:n], y[:n]
    device = cfg.device
    model.eval()
    return (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()


def run_settings(cfg: Config, recipe: Recipe | None) -> dict:
    """What defines a run's data and steps, saved with its checkpoint: a resume under other ones
    would train another run (load_checkpoint refuses it)."""
    fields = ("steps", "warmup_steps", "batch", "seed", "lr", "weight_decay", "max_grad_norm", "cifar", "dim",
              "heads", "depth")
    return {**{f: getattr(cfg, f) for f in fields}, "recipe": recipe.name if recipe else None,
            "accumulation": recipe.accumulation if recipe else 1}


def run(method: Method, cfg: Config, workers: int | None = None) -> ViTReport:
    """Warm-up steps apart, then the timed steps (peak memory measured around them). With
    ``cfg.checkpoint`` the state is saved every ``cfg.save_every`` optimizer steps; with
    ``cfg.resume`` the run continues from it (the time per step is then over the steps left, and
    the saves made during the timed steps count in it). ``workers``: batches from the input
    pipeline (workloads.cifar_data: crop, flip, normalize per image) with this many DataLoader
    workers, read as the steps run, instead of tensors preloaded on the device."""
    torch.manual_seed(cfg.seed)
    model = RopeViT(cfg.dim, cfg.heads, cfg.depth, attention=method.attention).to(cfg.device)
    opt = method.optimizer_fn(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = cosine_schedule(opt, cfg.steps + cfg.warmup_steps)
    micro = method.recipe.accumulation if method.recipe else 1
    # one scaler over every call, so it keeps (and a checkpoint keeps) its learned scale
    scaled = method.recipe is not None and method.recipe.grad_scaler
    scaler = torch.amp.GradScaler(torch.device(cfg.device).type) if scaled else None
    settings = run_settings(cfg, method.recipe)
    done = load_checkpoint(cfg.checkpoint, model, opt, scheduler=sched, scaler=scaler,
                           settings=settings) if cfg.resume else 0
    first = done + 1
    total = cfg.steps + cfg.warmup_steps
    if done >= total:
        raise ValueError(f"the checkpoint {cfg.checkpoint} is at step {done}: nothing left of {total} steps")
    if workers is None:
        batches = iter(cfg.data(micro))
    else:  # the pipeline's workers start here, before the clock
        x, y = cfg.images()
        batches = iter(loader(as_stored(x), y, batch=cfg.batch // micro, workers=workers, seed=cfg.seed,
                              device=cfg.device))
    for _ in islice(batches, done * micro):  # a resumed run skips the batches of the steps it has done
        pass
    result = []

    def steps(n: int) -> None:
        """``n`` optimizer steps, saved every ``save_every`` with a checkpoint."""
        nonlocal done
        while n > 0:
            take = min(n, cfg.save_every) if cfg.checkpoint else n
            chunk = islice(batches, take * micro)
            result.append(method.train_fn(model, F.cross_entropy, opt, chunk, method.recipe, device=cfg.device,
                                          scheduler=sched, max_grad_norm=cfg.max_grad_norm,
                                          **({"scaler": scaler} if scaler else {})))
            done, n = done + result[-1].optimizer_steps, n - take
            if cfg.checkpoint:
                save_checkpoint(cfg.checkpoint, model, opt, scheduler=sched, scaler=scaler, step=done,
                                settings=settings)

    t0 = time.perf_counter()
    steps(cfg.warmup_steps - done)
    warmup_s = time.perf_counter() - t0
    timed = total - max(done, cfg.warmup_steps)
    t0 = time.perf_counter()
    peak = peak_memory(lambda: steps(timed), cfg.device)
    seconds = time.perf_counter() - t0
    return ViTReport(method.name, 1e3 * seconds / timed, None if peak is None else peak / 2**20,
                     accuracy(model, cfg), result[-1].losses[-1], [loss for r in result for loss in r.losses],
                     warmup_s, first)


def _cached_rope_manual(q: Tensor, k: Tensor, v: Tensor, rope, *, causal: bool = False,
                        attn_mask: Tensor | None = None) -> Tensor:
    """Ablation row: the cached RoPE kernel, then the reference's explicit softmax attention."""
    check_attention(q, k, v, attn_mask)
    return softmax_attention(rope(q), rope(k), v, causal=causal, attn_mask=attn_mask)


class CachedRopeManualAttention(RopeSelfAttention):
    attend = staticmethod(_cached_rope_manual)


def reference_method() -> Method:
    """The reference run (reference/workloads/vit_rope.py)."""
    return Method(reference_run.NAME, reference_run.attention, reference_run.optimizer, reference_run.train)


def optimized_method(cfg: Config, recipe: Recipe | None = None) -> Method:
    """Cached RoPE + SDPA, fused AdamW, the engine; ``recipe`` measured by default."""
    if recipe is None:
        x, y = cfg.data(cfg.accumulation)[0]
        model = RopeViT(cfg.dim, cfg.heads, cfg.depth).to(cfg.device)
        recipe = Recipe.auto(cfg.device, accumulation=cfg.accumulation, model=model, loss_fn=F.cross_entropy,
                             batch=(x, y))
    return Method(f"optimized ({recipe.name}, accumulation {recipe.accumulation})", RopeSelfAttention, adamw,
                  train, recipe)


def ablation(cfg: Config, compile_: bool = True, emulated_bf16: bool = False) -> list[ViTReport]:
    """reference / + cached RoPE / + attention kernel / + fused AdamW (engine) / + AMP, then auto,
    and auto without clipping, saving a checkpoint every ``save_every`` steps, and fed by the
    DataLoader pipeline with 0 and 2 workers; with ``compile_``, the optimized run under each
    torch.compile mode of ``compile_modes`` (the warm-up steps, compile included, are untimed).
    Where bf16 is emulated (a CPU without bf16 instructions) the AMP row is left out, unless
    ``emulated_bf16``."""
    ref = reference_method()
    amp = amp_recipe(cfg.device)
    methods = [ref, replace(ref, name="+ cached RoPE", attention=CachedRopeManualAttention),
               replace(ref, name="+ attention kernel", attention=RopeSelfAttention),
               Method("+ fused AdamW (engine, fp32)", RopeSelfAttention, adamw, train, Recipe()),
               Method(f"+ AMP ({amp.name})", RopeSelfAttention, adamw, train, amp),
               optimized_method(cfg)]
    if not emulated_bf16 and bf16_emulated(cfg.device):
        methods.pop(-2)
    rows = [run(m, cfg) for m in progress(methods, desc="ablation", unit="run")]
    opt = methods[-1]
    if cfg.max_grad_norm is not None:  # what the clipping costs the optimized run
        rows.append(run(replace(opt, name=f"{opt.name}, no clipping"), replace(cfg, max_grad_norm=None)))
    with tempfile.TemporaryDirectory() as tmp:  # what saving a checkpoint every save_every steps costs
        saved = replace(cfg, checkpoint=str(Path(tmp) / "vit.safetensors"), resume=False)
        rows.append(run(replace(opt, name=f"{opt.name}, checkpoint every {cfg.save_every} steps"), saved))
    for workers in (0, 2):  # the input pipeline: crop, flip, normalize per image, in-process and in 2 workers
        rows.append(run(replace(opt, name=f"{opt.name}, DataLoader, {workers} workers"), cfg, workers=workers))
    for mode in compile_modes(cfg.device) if compile_ else ():
        recipe = replace(opt.recipe, compile_mode=mode)
        rows.append(run(replace(opt, name=f"optimized ({recipe.name}, accumulation {recipe.accumulation})",
                                recipe=recipe), cfg))
    return rows


HEADER = ["run", "ms/step", "speedup", "warm-up s (compile)", "peak MiB", "accuracy", "final loss"]


def table(rows: list[ViTReport]) -> list[list[str]]:
    """The cells of ``HEADER``, one list per run."""
    base = rows[0].ms_per_step
    return [[r.name, f"{r.ms_per_step:.1f}", f"{base / r.ms_per_step:.2f}x", f"{r.warmup_s:.1f}", mib(r.peak_mib),
             f"{r.accuracy:.1%}", f"{r.final_loss:.3f}"] for r in rows]


def format_rows(rows: list[ViTReport]) -> list[str]:
    return markdown(HEADER, table(rows))
