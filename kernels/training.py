"""The training-loop engine every workload shares, configured by a ``Recipe``.

One loop: autocast (fp16 + GradScaler, or bf16), gradient accumulation (one optimizer and
scaler step per window of k micro-batches, each weighted by its samples: the step is that of the
window's samples merged, a smaller last micro-batch or a trailing partial window included),
``zero_grad(set_to_none=True)``, channels_last and ``torch.compile`` as options, batches moved
to the device (``non_blocking`` when they come pinned, e.g. from ``DataLoader(pin_memory=True)``;
workloads preload them on the device), a scheduler stepped once per optimizer step, and steps
the GradScaler skipped (inf/NaN gradients) counted, never applied.

Nothing non-finite passes silently, and no check costs a host sync of its own (they read the
loss the engine already reads once per optimizer step, and the scale the skip count reads):

- a non-finite loss raises FloatingPointError before its step, under every recipe. A GradScaler
  cannot help: the loss is computed before any scaling, so the forward itself is not finite (a
  NaN or inf in the batch, or activations overflowing), and skipping it would hide the cause.
- without a GradScaler, non-finite gradients raise the same way.
- with one, a step whose gradients overflow is skipped and the scale halved, as torch does; a run
  that skipped any step warns at its end (how many of how many). Skips that cannot be transient
  raise: when a skip leaves the scale below ``Recipe.min_grad_scale`` (default 1). Each skip
  halves the scale and only ``growth_interval`` (2000) clean steps in a row double it, so the
  scale falls that far only when steps keep being skipped, in a row or often (17 in a row from
  torch's initial 2^16). Below 1 the scaler no longer enlarges the gradients, so what overflows
  is the gradient itself (fp16 holds up to 65504) or a NaN, which no scale fixes: every later
  step would be skipped too. One overflow in a long run backs the scale off once: warned, not raised.
- ``train`` refuses an optimizer that holds parameters which are not the model's (built on
  another model or a copy; ``loss_fn``'s own count when it is an nn.Module) and one that holds
  none of its trainable parameters. Trainable parameters the optimizer does not hold are a
  warning, not an error: training part of a model with one optimizer is legitimate (another
  optimizer for the rest, or parameters frozen by leaving them out), but the engine still
  computes their gradients and, zeroing only the optimizer's, lets them accumulate across steps;
  ``requires_grad_(False)`` freezes them without that cost.

``Recipe.auto`` picks per device what measured faster. On CPU the answer differs between CPU
kinds (bf16 and channels_last sped a ResNet-10 up on an AVX512-BF16 AMD EPYC and slowed
resnet18 down on a Xeon; evidence/from-the-code.md), so ``auto`` times the candidates
on the caller's model and batch when given them (interleaved, each on its own copy of the model:
a round is one step of each, so a change in the host's speed falls on all of them alike), and
otherwise keeps plain fp32; it leaves fp32
only for a candidate at least 10% faster (a smaller gain is timing noise, not a reason to lose
precision and the reference's exact selections). bf16 is a candidate only on a CPU that computes
it natively (``native_bf16``): elsewhere autocast converts it in software, 9-20x slower than
fp32, so timing it would only cost the caller seconds. On CUDA ``auto`` times fp32, fp16 with its
GradScaler and bf16 (from compute capability 8.0) the same way when given the model and batch (a
small model's step is its launches, to which autocast adds casts: lower precision need not pay);
without them it takes fp16 + GradScaler + channels_last, torch's documented fast path.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from kernels import checks
from kernels.distributed import active, agree, all_mean_, rank, unwrap
from kernels.feature_cache import read_safetensors, write_safetensors

LossFn = Callable[[Tensor, Tensor], Tensor]
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune")
AUTO_MARGIN = 0.10  # Recipe.auto leaves fp32 only for a candidate at least this much faster


@dataclass(frozen=True)
class Recipe:
    """How the loop trains; the defaults are the plain fp32 loop."""

    autocast_dtype: torch.dtype | None = None  # torch.float16 or torch.bfloat16
    grad_scaler: bool = False  # needed for fp16: skips steps whose gradients overflow
    accumulation: int = 1  # micro-batches per optimizer step
    channels_last: bool = False
    compile_mode: str | None = None  # a torch.compile mode; None: eager
    min_grad_scale: float = 1.0  # a GradScaler skip leaving the scale below this raises (module note); 0: never

    def __post_init__(self) -> None:
        checks.choice(self.autocast_dtype, "autocast_dtype", (None, torch.float16, torch.bfloat16))
        checks.flag(self.grad_scaler, "grad_scaler")
        object.__setattr__(self, "accumulation", checks.integer(self.accumulation, "accumulation", low=1,
                                                                hint="micro-batches per optimizer step"))
        checks.flag(self.channels_last, "channels_last")
        checks.choice(self.compile_mode, "compile_mode", COMPILE_MODES)
        object.__setattr__(self, "min_grad_scale", checks.number(self.min_grad_scale, "min_grad_scale", low=0))
        if self.autocast_dtype == torch.float16 and not self.grad_scaler:
            raise ValueError("fp16 autocast needs grad_scaler=True: fp16 gradients underflow without it")

    @property
    def name(self) -> str:
        """e.g. ``fp32``, ``bfloat16+channels_last``, ``float16+channels_last+compile``,
        ``fp32+compile:max-autotune``."""
        parts = [str(self.autocast_dtype).removeprefix("torch.") if self.autocast_dtype else "fp32"]
        mode = [] if not self.compile_mode else ["compile" if self.compile_mode == "default" else
                                                 f"compile:{self.compile_mode}"]
        return "+".join(parts + ["channels_last"] * self.channels_last + mode)

    @classmethod
    def from_name(cls, name: str, *, accumulation: int = 1) -> Recipe:
        """The recipe ``name`` describes (``Recipe.name``'s inverse), e.g. the one a checkpoint's run
        was saved under: ``bfloat16+channels_last``, ``float16+compile:max-autotune`` (fp16 with its
        GradScaler)."""
        precision, *rest = str(name).split("+")
        dtypes = {"fp32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
        compiled = [part for part in rest if part == "compile" or part.startswith("compile:")]
        unknown = [part for part in rest if part not in ("channels_last", *compiled)]
        if precision not in dtypes or unknown or len(compiled) > 1:
            raise ValueError(f"name must be a Recipe.name such as 'bfloat16+channels_last' or 'fp32+compile', "
                             f"got {name!r}")
        mode = None if not compiled else "default" if compiled[0] == "compile" else compiled[0].split(":", 1)[1]
        dtype = dtypes[precision]
        return cls(dtype, dtype == torch.float16, accumulation, channels_last="channels_last" in rest,
                   compile_mode=mode)

    @classmethod
    def auto(cls, device: str | torch.device, *, accumulation: int = 1, model: nn.Module | None = None,
             loss_fn: LossFn | None = None, batch: tuple[Tensor, Tensor] | None = None,
             compile_modes: tuple[str, ...] = ()) -> Recipe:
        """The fastest recipe for ``device``: ``Recipe.choose(...).recipe``."""
        return cls.choose(device, accumulation=accumulation, model=model, loss_fn=loss_fn, batch=batch,
                          compile_modes=compile_modes).recipe

    @classmethod
    def choose(cls, device: str | torch.device, *, accumulation: int = 1, model: nn.Module | None = None,
               loss_fn: LossFn | None = None, batch: tuple[Tensor, Tensor] | None = None,
               compile_modes: tuple[str, ...] = ()) -> Choice:
        """The fastest recipe for ``device`` and the timings it was chosen by, measured on
        ``model``/``batch`` when given them (see module). ``compile_modes`` (opt-in: each compiles the model,
        seconds to minutes): torch.compile modes tried on top of the chosen recipe, one kept only
        when its steps measure at least ``AUTO_MARGIN`` faster; compile time is kept apart."""
        for mode in compile_modes:
            if mode not in COMPILE_MODES[1:]:
                raise ValueError(f"compile_modes must be among {COMPILE_MODES[1:]}, got {mode!r}")
        measured = model is not None and loss_fn is not None and batch is not None
        if not measured:  # CUDA: torch's documented fast path; CPU: plain fp32
            cuda = torch.device(device).type == "cuda"
            best, step_ms = cls(torch.float16 if cuda else None, cuda, accumulation, channels_last=cuda), {}
        else:
            best, step_ms = _fastest_eager(cls(accumulation=accumulation), model, loss_fn, batch, device)
        if not compile_modes or not measured:
            return Choice(best, step_ms)
        return _keep_faster_compile(Choice(best, step_ms), compile_modes, model, loss_fn, batch, device)


@dataclass(frozen=True)
class Choice:
    """What ``Recipe.choose`` picked, and what it timed to pick it."""

    recipe: Recipe
    step_ms: dict[str, float] = field(default_factory=dict)  # median ms a training step, by recipe name
    compile_s: dict[str, float] = field(default_factory=dict)  # a compiled candidate's first step, seconds


def native_bf16(device: str | torch.device) -> bool:
    """Whether bf16 autocast on ``device`` runs in hardware: a GPU of compute capability 8.0 or
    later (Ampere, Hopper; older ones emulate it), or a CPU with AVX512-BF16 or AMX (torch's own
    checks; without them oneDNN converts bf16 in software). A device this process cannot query
    (CUDA absent, another backend) or a torch without the checks answers True, so ``auto``
    measures rather than guesses."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)[0] >= 8
    if kind != "cpu":
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if None in probes:
        return True
    return any(probe() for probe in probes)


def _fastest_eager(base: Recipe, model: nn.Module, loss_fn: LossFn, batch: tuple[Tensor, Tensor],
                   device: str | torch.device) -> tuple[Recipe, dict[str, float]]:
    """The fastest of ``base``'s candidates (on CPU bf16 where native; on CUDA fp16 with its
    GradScaler, and bf16 from compute capability 8.0; channels_last for images), ``base`` unless
    one is ``AUTO_MARGIN`` faster, and every candidate's ms a step."""
    layouts = [False, True] if batch[0].ndim == 4 else [False]  # channels_last is for images
    cuda = torch.device(device).type == "cuda"  # fp16 a candidate on a GPU only, as torch AMP has it
    dtypes = [None] + [torch.float16] * cuda + [torch.bfloat16] * native_bf16(device)
    candidates = [replace(base, autocast_dtype=d, grad_scaler=d == torch.float16, channels_last=c)
                  for c in layouts for d in dtypes]
    step_ms = _time_steps(candidates, model, loss_fn, batch, device)
    best = min(candidates, key=lambda r: step_ms[r.name])
    if step_ms[best.name] > (1 - AUTO_MARGIN) * step_ms[base.name]:
        best = base  # a win inside the timing noise does not pay for reduced precision
    return best, step_ms


def _keep_faster_compile(eager: Choice, modes: tuple[str, ...], model: nn.Module, loss_fn: LossFn,
                         batch: tuple[Tensor, Tensor], device: str | torch.device) -> Choice:
    """``eager``'s recipe compiled in the fastest of ``modes`` when that is at least AUTO_MARGIN
    faster per step than eager (compile time aside), else eager's. Eager and every compiled
    candidate are timed in one interleaved group (``_time_steps``: each compiled model held at
    once), so a change in the host's speed falls on all alike; eager's time there replaces its
    earlier one, and each candidate's first step (its compile) is reported apart."""
    best = eager.recipe
    compiled = [replace(best, compile_mode=m) for m in modes]
    first: list[float] = []
    step_ms = {**eager.step_ms, **_time_steps([best, *compiled], model, loss_fn, batch, device, first_s=first)}
    compile_s = {r.name: s for r, s in zip(compiled, first[1:], strict=True)}
    fastest = min(compiled, key=lambda r: step_ms[r.name])
    keep = fastest if step_ms[fastest.name] <= (1 - AUTO_MARGIN) * step_ms[best.name] else best
    return Choice(keep, step_ms, compile_s)


@contextlib.contextmanager
def _rng_kept(device: str | torch.device):
    """The caller's torch (CPU and ``device``), Python and NumPy random states, put back on exit:
    timing steps draws dropout masks a seeded run must not see drawn."""
    on = torch.device(device)
    devices = [on.index if on.index is not None else torch.cuda.current_device()] if on.type == "cuda" else []
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices, device_type=on.type if on.type == "cuda" else "cuda"):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


MIN_ROUNDS = 7  # interleaved rounds Recipe.auto times at least: a 10% margin is judged on their medians


def _time_steps(recipes: list[Recipe], model: nn.Module, loss_fn: LossFn, batch: tuple[Tensor, Tensor],
                device: str | torch.device, budget_s: float = 0.1, max_rounds: int = 50,
                first_s: list[float] | None = None) -> dict[str, float]:
    """Median ms of a training step under each of ``recipes`` (by name), each on its own copy of
    the model, interleaved: after a warm-up step of each (its seconds appended to ``first_s``:
    compilation lives there), rounds of one step of each, in an order rotated every round, so a
    change in the host's speed falls on every recipe alike; ``MIN_ROUNDS`` at least, more while
    they fit in ``budget_s`` a recipe (millisecond steps are noisy). Every copy is held until the
    end: memory for len(recipes) models, their gradients and one step's activations."""
    trials = []
    for recipe in recipes:
        trial = copy.deepcopy(model).to(device)
        trials.append((recipe, trial, torch.optim.SGD(trial.parameters(), lr=0.0)))
    times: dict[str, list[float]] = {recipe.name: [] for recipe in recipes}
    spent, rounds = 0.0, 0
    # a fresh GradScaler per timed call may skip its first step: not news here
    with _rng_kept(device), warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"\d+ of \d+ optimizer steps were skipped", RuntimeWarning)
        for recipe, trial, opt in trials:
            t0 = time.perf_counter()
            train(trial, loss_fn, opt, [batch], recipe, device=device)
            if first_s is not None:
                first_s.append(time.perf_counter() - t0)
        while rounds < MIN_ROUNDS or (spent < budget_s * len(trials) and rounds < max_rounds):
            shift = rounds % len(trials)
            for recipe, trial, opt in trials[shift:] + trials[:shift]:
                t0 = time.perf_counter()
                train(trial, loss_fn, opt, [batch], recipe, device=device)
                times[recipe.name].append(time.perf_counter() - t0)
                spent += times[recipe.name][-1]
            rounds += 1
    return {name: 1e3 * sorted(ts)[len(ts) // 2] for name, ts in times.items()}


@dataclass
class TrainResult:
    losses: list[float]  # one per optimizer step: the mean loss over its window's samples
    optimizer_steps: int
    skipped_steps: int  # GradScaler found inf/NaN gradients and did not apply the step
    seconds: float
    grad_norms: list[float] = field(default_factory=list)  # with max_grad_norm: each step's norm before clipping


def check_max_grad_norm(max_grad_norm: float | None) -> float | None:
    """``max_grad_norm``: None (no clipping) or a finite number > 0, returned as a float. Shared
    with the reference."""
    if max_grad_norm is None:
        return None
    return checks.number(max_grad_norm, "max_grad_norm (None: no clipping)", low=0, low_open=True)


def _owned(*owners: object) -> dict[int, Tensor]:
    """The parameters of ``owners`` (the nn.Modules among them), by id."""
    return {id(p): p for m in owners if isinstance(m, nn.Module) for p in m.parameters()}


def _foreign(optimizer: torch.optim.Optimizer, owned: dict[int, Tensor]) -> list[Tensor]:
    """The optimizer's parameters that are not in ``owned`` (``_owned``)."""
    return [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]


def check_parameters(model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's parameters, refused unless they train ``model`` (module note): every one
    the model's (or ``loss_fn``'s, when it is an nn.Module) and at least one of them trainable; a
    warning for the trainable parameters of either it leaves out. DistributedDataParallel and
    torch.compile wrappers hold the module's own parameters, so they pass as the module does."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    owned = _owned(model, loss_fn)
    foreign = len(_foreign(optimizer, owned))
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} of its {len(params)} parameters that are not the model's "
                         "(nor loss_fn's, when loss_fn is an nn.Module): it was built on another model or a copy "
                         "(copy.deepcopy, a model built again); build it on the parameters of the model passed "
                         "here, optimizer(model.parameters())")
    held = {id(p) for p in params}
    trainable = [p for p in owned.values() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (requires_grad=False on every one): nothing would "
                         "train; unfreeze the ones to train with requires_grad_(True)")
    if not any(id(p) in held for p in trainable):
        raise ValueError(f"the optimizer holds none of the model's {len(trainable)} trainable parameters, only "
                         "frozen ones (requires_grad=False): nothing would train; build it on the parameters to "
                         "train, or unfreeze them")
    left_out = sum(id(p) not in held for p in trainable)
    if left_out:
        warnings.warn(f"{left_out} of the trainable parameters (the model's, and loss_fn's when it is an "
                      "nn.Module) are not in the optimizer: their gradients "
                      "are computed every step and never applied nor cleared (they accumulate in .grad); freeze "
                      "them with requires_grad_(False), or add them to the optimizer", UserWarning, stacklevel=3)
    return params


def _to_device(t: Tensor, device: torch.device, channels_last: bool) -> Tensor:
    if t.device != device:  # non_blocking overlaps only from pinned memory (DataLoader(pin_memory=True))
        t = t.to(device, non_blocking=t.is_pinned())
    if channels_last and t.ndim == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


@dataclass
class _Steps:
    """One ``train`` call's optimizer steps: what each needs, and what they produced so far."""

    recipe: Recipe
    optimizer: torch.optim.Optimizer
    params: list[Tensor]
    scaler: torch.amp.GradScaler
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    max_grad_norm: float | None
    data_parallel: bool  # losses (and a trailing window's gradients) are averaged over ranks
    # under DDP, the optimizer's parameters the wrapped model does not own (a loss module's): DDP
    # all-reduces none of their gradients, so the step does, or each rank would step its own copy
    outside: list[Tensor] = field(default_factory=list)
    window: list[Tensor] = field(default_factory=list)  # the losses of the window's micro-batches
    sizes: list[int] = field(default_factory=list)  # their sample counts (the inputs' first dim)
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    norms: list[Tensor] = field(default_factory=list)  # each step's gradient norm before clipping
    skipped: int = 0  # steps the GradScaler skipped
    scale: float = math.nan  # the GradScaler's scale after the last step (nan without one)

    def step(self) -> None:
        """One optimizer step on the window's accumulated gradients; refuses non-finite ones."""
        recipe, n = self.recipe, len(self.losses) + 1
        grads = [p.grad for p in self.params if p.grad is not None]
        # each micro-batch's loss went in as loss * (n_i / n_0) / k: the window's mean over its
        # samples once times k n_0 / N (1 for k micro-batches of one size; k / m for a trailing
        # window of m)
        k, n0, total = recipe.accumulation, self.sizes[0], sum(self.sizes)
        losses = torch.stack(self.window)
        equal = all(n == n0 for n in self.sizes)
        loss = losses.mean() if equal else (losses * losses.new_tensor(self.sizes)).sum() / total
        if self.data_parallel:  # one all-reduce: every rank reports the global loss and scales alike
            # the sizes' squares too: their means tell whether the ranks' shares are equal, which the
            # mean of the ranks' mean losses needs (unequal ones weigh a sample by its rank's share)
            sizes = loss.new_tensor([n0, total, n0 * n0, total * total])
            for p in self.outside:  # a zero where a rank's batch left it none: the ranks' lists must match
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_mean_([loss, sizes, *(p.grad for p in self.outside)])
            n0, total, n0_sq, total_sq = sizes.tolist()  # the ranks' means: n0 / total is sum n0 / sum N
            if abs(n0_sq - n0 * n0) > 1e-6 * n0_sq or abs(total_sq - total * total) > 1e-6 * total_sq:
                raise ValueError(f"the ranks' batches differ in size at optimizer step {n}: under DDP each rank's "
                                 "mean loss counts alike, so a sample would weigh by its rank's share; give every "
                                 "rank an equal share (kernels.distributed.shard, or a DistributedSampler)")
        if abs(total - k * n0) > 1e-6 * total and grads:
            torch._foreach_mul_(grads, k * n0 / total)
        loss = loss.item()
        if not math.isfinite(loss):  # the forward: no scale can fix it (module note)
            raise _loss_not_finite(loss, n, recipe)
        if not recipe.grad_scaler and checks.nonfinite({str(j): g for j, g in enumerate(grads)}):  # one sync
            raise FloatingPointError(
                f"the gradients of loss {loss:.4g} are not finite at optimizer step {n}; the step was not "
                "applied. Lower the learning rate, or use grad_scaler=True to skip such steps")
        if self.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones (a no-op when disabled)
            self.norms.append(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).detach())
        before = self.scale
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scale = self.scaler.get_scale() if recipe.grad_scaler else math.nan
        if self.scale < before:  # the scaler backed off: step skipped
            self.skipped += 1
            if self.scale < recipe.min_grad_scale:
                raise _scaler_gave_up(n, self.skipped, self.scale, recipe.min_grad_scale)
        elif self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss)
        self.window.clear()
        self.sizes.clear()


def _loss_not_finite(loss: float, n: int, recipe: Recipe) -> FloatingPointError:
    cause = ("a GradScaler cannot skip it: it scales gradients, and the loss is computed before any scaling, so "
             "the forward itself is not finite" if recipe.grad_scaler else "the forward is not finite")
    fp16 = "; fp16 activations overflow past 65504: try bf16" if recipe.autocast_dtype == torch.float16 else ""
    return FloatingPointError(f"loss {loss:.4g} is not finite at optimizer step {n}; the step was not applied: "
                              f"{cause}. Check the batch for NaN or inf; a model that diverged needs a lower "
                              f"learning rate{fp16}")


def _scaler_gave_up(n: int, skipped: int, scale: float, min_grad_scale: float) -> FloatingPointError:
    return FloatingPointError(
        f"the GradScaler skipped optimizer step {n} ({skipped} of {n} in this call) for inf/NaN gradients and has "
        f"backed off to a scale of {scale:g}, below min_grad_scale={min_grad_scale:g}: these skips are not "
        "transient. At a scale of 1 or less the scaled gradients are no larger than the true ones, so these "
        "overflow or are NaN by themselves (an op such as sqrt, log or a division at 0, or a model that diverged: "
        "lower the learning rate) and every later step would be skipped too. Recipe(min_grad_scale=0) turns this "
        "check off")


def _device(device: str | torch.device | None, params: list[Tensor]) -> torch.device:
    """The device to train on: ``device``, else the parameters'; it must be theirs."""
    device = torch.device(device) if device is not None else params[0].device
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device, cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    if params[0].device != device:
        raise ValueError(f"the model's parameters are on {params[0].device} but device={str(device)!r}: move the "
                         "model there first (model.to(device)), then build its optimizer")
    return device


def _batch(batch: object, i: int, device: torch.device, channels_last: bool) -> tuple[Tensor, Tensor]:
    """Batch ``i``'s (inputs, targets), checked and moved to ``device``."""
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise TypeError(f"batches must yield (inputs, targets) pairs; batch {i} is a {type(batch).__name__}"
                        f"{f' of {len(batch)}' if isinstance(batch, tuple | list) else ''}")
    x, y = checks.tensor(batch[0], f"batch {i}'s inputs"), checks.tensor(batch[1], f"batch {i}'s targets")
    return _to_device(x, device, channels_last), _to_device(y, device, False)


def train(model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
          batches: Iterable[tuple[Tensor, Tensor]], recipe: Recipe | None = None, *,
          device: str | torch.device | None = None,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
          scaler: torch.amp.GradScaler | None = None, max_grad_norm: float | None = None) -> TrainResult:
    """Run ``recipe`` over ``batches`` (x (B, ...), y (B, ...)); one optimizer step per window.

    Pass the same ``scaler`` to successive calls (epochs) to keep its scale; by default each
    call starts a fresh one. channels_last converts ``model`` in place. ``max_grad_norm``: clip
    the global 2-norm of the optimizer's gradients to it once per optimizer step, on the window's
    accumulated gradient, unscaled first under a GradScaler (``torch.nn.utils.clip_grad_norm_``);
    the norms before clipping are returned in ``grad_norms``. A window's micro-batches count by
    their samples (the inputs' first dim), for a ``loss_fn`` that is a mean over its batch, as
    torch's losses are by default: its step and loss are those of its samples as one batch.
    Each batch must be an (inputs,
    targets) pair of tensors on any device (moved to ``device``, where the model's parameters must
    be); their shapes and dtypes are the model's and loss's business, whose own errors come
    through. An empty ``batches`` trains nothing: the result has 0 optimizer steps.

    Data parallel: pass ``model`` wrapped by ``kernels.distributed`` (DistributedDataParallel)
    and each rank's own batches (a DistributedSampler, or ``kernels.distributed.shard``), the
    same number on every rank. Gradients are all-reduced once per optimizer step (the window's
    last micro-batch; the others run under ``no_sync``; a loss module's parameters, which DDP does
    not own, in the step's own all-reduce), and ``losses`` are the mean over ranks.
    """
    recipe = Recipe() if recipe is None else recipe
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a kernels.Recipe or None, got {type(recipe).__name__}")
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    checks.module(model, "model")
    params = check_parameters(model, loss_fn, optimizer)
    device = _device(device, params)
    if scaler is not None and not recipe.grad_scaler:
        raise ValueError("a scaler was passed but recipe.grad_scaler is False")
    if scaler is not None and not scaler.is_enabled():  # it would skip nothing, and the grads go unchecked
        raise ValueError("scaler is disabled (enabled=False, or built for a device this machine lacks, which "
                         f"disables it with a warning): pass torch.amp.GradScaler({device.type!r}), or none")
    _check_scheduler(scheduler, optimizer)
    own_scaler = scaler is None
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.grad_scaler) if own_scaler else scaler
    if recipe.channels_last:
        model.to(memory_format=torch.channels_last)
    forward = torch.compile(model, mode=recipe.compile_mode) if recipe.compile_mode else model
    data_parallel = isinstance(model, DistributedDataParallel) and active()
    owned = {id(p) for p in unwrap(model).parameters()}
    steps = _Steps(recipe, optimizer, params, scaler, scheduler, max_grad_norm, data_parallel=data_parallel,
                   outside=[p for p in params if id(p) not in owned] if data_parallel else [],
                   scale=scaler.get_scale() if recipe.grad_scaler else math.nan)  # read once a step from here on
    k, autocast, start = recipe.accumulation, recipe.autocast_dtype is not None, time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for i, batch in enumerate(batches):  # each batch is read after the previous step: a generator may depend on it
        x, y = _batch(batch, i, device, recipe.channels_last)
        # DDP: gradients are all-reduced only on the window's last micro-batch (one all-reduce a step)
        sync = not steps.data_parallel or len(steps.window) == k - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(device.type, dtype=recipe.autocast_dtype, enabled=autocast):
                loss = loss_fn(forward(x), y)
            if loss.ndim != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            n = x.shape[0] if x.ndim else 1
            if n == 0:  # its mean loss is 0/0, and it would weigh nothing in the window
                raise ValueError(f"batch {i} has no samples (inputs of shape {tuple(x.shape)}); leave empty "
                                 "batches out (a DataLoader with drop_last=True, or a sampler without them)")
            n0 = steps.sizes[0] if steps.sizes else n
            # weighted by its samples (a smaller last micro-batch counts for less), exactly loss / k
            # where the window's micro-batches are of one size
            scaler.scale(loss / k if n == n0 else loss * (n / n0) / k).backward()
        # an fp16/bf16 loss (autocast) averaged in fp32, an fp64 one in fp64 (fp32 would overflow or flush it)
        steps.window.append(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)))
        steps.sizes.append(n)
        if len(steps.window) == k:
            steps.step()
    if steps.window:  # a trailing partial window; under DDP its micro-batches ran under no_sync: all-reduce now
        if steps.data_parallel:
            all_mean_([p.grad for p in params if p.grad is not None])
        steps.step()
    if steps.skipped:
        keep = "; pass the same scaler= to successive calls to keep the scale it found" if own_scaler else ""
        warnings.warn(f"{steps.skipped} of {len(steps.losses)} optimizer steps were skipped: the GradScaler found "
                      f"inf/NaN gradients and backed its scale off to {steps.scale:g}{keep} (result.skipped_steps "
                      "counts them)", RuntimeWarning, stacklevel=2)
    grad_norms = torch.stack(steps.norms).tolist() if steps.norms else []  # one sync for all steps
    return TrainResult(steps.losses, len(steps.losses), steps.skipped, time.perf_counter() - start, grad_norms)


def _check_scheduler(scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler ``train`` can step once per applied step: an LRScheduler of ``optimizer`` that
    takes no metric (one built on another optimizer would change another's lr)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("scheduler is a ReduceLROnPlateau, which steps on a metric: pass scheduler=None and "
                         "call scheduler.step(metric) after each train call (an epoch)")
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError("scheduler must be a torch.optim.lr_scheduler.LRScheduler or None, got "
                        f"{type(scheduler).__name__}")
    if scheduler.optimizer is not optimizer:
        raise ValueError("scheduler was built on another optimizer than the one train steps: its learning rates "
                         "would never reach the run; build it on this optimizer")


# Checkpoint and resume: one safetensors file (every tensor) whose metadata holds the rest as
# JSON, written atomically; no pickle anywhere, so reading a checkpoint runs no code.
CHECKPOINT_FORMAT = "kernelgate-checkpoint-1"


KEYED = "__keyed__"  # a dict whose keys are not all strings, as [[key, value], ...] (JSON keys are strings)


def _keyed(value: object) -> object:
    """``value`` with every dict whose keys are not all strings (a MultiStepLR's milestones
    Counter, keyed by epoch) written as ``{KEYED: [[key, value], ...]}``, so its keys come back
    with their types (``_unkeyed``)."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _keyed(v) for k, v in value.items()}
        return {KEYED: [[k, _keyed(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [_keyed(v) for v in value]
    return value


def _unkeyed(value: object) -> object:
    if isinstance(value, dict):
        if set(value) == {KEYED}:
            return {(tuple(k) if isinstance(k, list) else k): _unkeyed(v) for k, v in value[KEYED]}
        return {k: _unkeyed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unkeyed(v) for v in value]
    return value


def _typed_like(value: object, like: object) -> object:
    """``value`` read back from JSON with the container types of ``like``, the state of the object
    it is loaded into: JSON keeps dicts and lists only, where torch keeps a Counter (MultiStepLR's
    milestones, whose ``elements()`` a step to an epoch calls) or a tuple (AdamW's betas)."""
    if isinstance(value, dict) and isinstance(like, dict):
        typed = {k: _typed_like(v, like.get(k)) for k, v in value.items()}
        if type(like) is dict:
            return typed
        out = copy.copy(like)  # a Counter, OrderedDict or defaultdict (its factory kept), emptied and refilled
        out.clear()
        out.update(typed)
        return out
    if isinstance(value, list) and isinstance(like, list | tuple):
        items = [_typed_like(v, w) for v, w in zip(value, like, strict=False)] + value[len(like):]
        return tuple(items) if type(like) is tuple else items
    return value


def _json(value: object, what: str) -> str:
    try:
        return json.dumps(_keyed(value))
    except TypeError as e:
        raise TypeError(f"{what} holds a value JSON cannot store ({e}); checkpoints keep tensors and "
                        "plain values only (no pickle)") from None


def _own(t: Tensor) -> Tensor:
    return t.detach().to("cpu").clone().contiguous()  # own storage: safetensors refuses shared ones


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    scaler: torch.amp.GradScaler | None = None, step: int = 0,
                    loss_fn: nn.Module | None = None, settings: Mapping[str, Any] | None = None) -> None:
    """Model, optimizer, scheduler, GradScaler and RNG states (torch, CUDA, Python, NumPy) and
    ``step`` in one file at ``path``, replaced atomically (a crash leaves the previous one).
    ``loss_fn``: a loss module whose parameters the optimizer trains, saved beside the model (an
    optimizer holding parameters of neither is refused: their values would be lost).
    ``settings``: the run's own settings (plain JSON values: its steps, batch, seed, recipe), which
    ``load_checkpoint(settings=...)`` holds a resume to.

    Data parallel: call it on every rank; rank 0 writes (the replicas are equal) and every rank
    returns once the file is complete, or raises when rank 0 could not write it. On several hosts
    ``path`` must be on a file system they share, for a resume to read it. The model's names are
    those of the wrapped module, so a checkpoint loads into one process or many alike. The RNG
    states are rank 0's: after resuming, every rank starts from them (reseed per rank for
    distinct dropout or augmentation streams)."""
    step = checks.integer(step, "step", low=0)
    checks.module(model, "model")
    _check_owned(model, loss_fn, optimizer)
    settings = _settings(settings)
    if not active():
        _write_checkpoint(path, unwrap(model), optimizer, scheduler, scaler, step, loss_fn, settings)
        return
    error = None
    if rank() == 0:
        try:
            _write_checkpoint(path, unwrap(model), optimizer, scheduler, scaler, step, loss_fn, settings)
        except Exception as e:  # every rank learns of it below, so none waits for a file that never comes
            error = e
    if not agree(error is None):  # also the barrier: no rank reads the file before rank 0 has replaced it
        if error is not None:
            try:
                raise error
            finally:  # the traceback holds this frame: with ``error`` still in it, the model would
                del error  # live in a cycle until a GC pass, and under DDP keep gloo's threads past exit
        raise RuntimeError(f"rank 0 could not write the checkpoint {path} (its error is in rank 0's log)")


def _settings(settings: Mapping[str, Any] | None) -> dict | None:
    """A run's settings as a checkpoint keeps them: plain JSON values, tuples as lists."""
    if settings is None:
        return None
    if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
        raise TypeError(f"settings must be a mapping of names to plain values, got {type(settings).__name__}")
    return json.loads(_json(dict(settings), "settings"))


def _check_settings(path: str | os.PathLike, saved: dict | None, given: dict) -> None:
    """A resume under other settings trains a different run: refused, naming what differs."""
    if saved is None:
        raise ValueError(f"{path} was saved without its run's settings, so this resume cannot be checked against "
                         "them; start afresh, or load it without settings=")
    differ = [f"{k}: saved {saved.get(k)!r}, now {given.get(k)!r}" for k in sorted(set(saved) | set(given))
              if saved.get(k) != given.get(k)]
    if differ:
        raise ValueError(f"{path} was saved by a run with other settings ({'; '.join(differ)}): resume with the "
                         "run's own settings, or start afresh with another checkpoint")


def _read(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict]:
    """A checkpoint's tensors and its state (JSON, its keys' types back), or a ValueError when
    ``path`` holds no kernelgate checkpoint."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a kernelgate checkpoint (format {meta.get('format')!r})")
    return tensors, _unkeyed(json.loads(meta["state"]))


def checkpoint_settings(path: str | os.PathLike) -> dict | None:
    """The ``settings`` the run saved with its checkpoint at ``path`` (None: none were saved)."""
    return _read(path)[1].get("settings")


def _check_owned(model: nn.Module, loss_fn: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer steps is the model's or ``loss_fn``'s: a checkpoint holds their values."""
    if loss_fn is not None:
        checks.module(loss_fn, "loss_fn")
    foreign = _foreign(optimizer, _owned(model, loss_fn))
    if foreign:
        raise ValueError(f"the optimizer steps {len(foreign)} parameter(s) that are not the model's "
                         f"(shapes {[tuple(p.shape) for p in foreign][:4]}): a loss module's? pass it as loss_fn= "
                         "to save_checkpoint and load_checkpoint, so their values are saved and restored too")


def _write_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LRScheduler | None, scaler: torch.amp.GradScaler | None,
                      step: int, loss_fn: nn.Module | None = None, settings: dict | None = None) -> None:
    tensors = {f"model/{k}": _own(v) for k, v in model.state_dict().items()}
    if loss_fn is not None:
        tensors.update({f"loss_fn/{k}": _own(v) for k, v in loss_fn.state_dict().items()})
    opt = optimizer.state_dict()
    plain_state: dict[str, dict] = {}
    for pid, entries in opt["state"].items():
        for k, v in entries.items():
            if isinstance(v, Tensor):
                tensors[f"optimizer/{pid}/{k}"] = _own(v)
            else:
                plain_state.setdefault(str(pid), {})[k] = v
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "step": step,
        "optimizer": {"param_groups": opt["param_groups"], "state": plain_state},
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "loss_fn": loss_fn is not None,
        "settings": settings,
        "rng": {"python": [py_version, list(py_state), py_gauss],
                "numpy": [np_kind, np_keys.tolist(), np_pos, np_has_gauss, np_gauss]},
    }
    write_safetensors(path, tensors, {"format": CHECKPOINT_FORMAT, "state": _json(state, "the training state")})


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    scaler: torch.amp.GradScaler | None = None, loss_fn: nn.Module | None = None,
                    settings: Mapping[str, Any] | None = None) -> int:
    """Restore what ``save_checkpoint`` wrote into the given objects (built as for a fresh run)
    and the RNG states; returns the saved ``step``. A checkpoint holding a scheduler, scaler or
    loss module state not asked for (or the reverse) is an error: resuming without it would
    change the run. ``settings``: this run's, which must be those the checkpoint was saved with
    (else a ValueError naming each that differs, before anything is loaded)."""
    checks.module(model, "model")
    if loss_fn is not None:
        checks.module(loss_fn, "loss_fn")
    tensors, state = _read(path)
    if settings is not None:
        _check_settings(path, state.get("settings"), _settings(settings))
    state["loss_fn"] = state.get("loss_fn") or None  # True where saved
    for name, given in (("scheduler", scheduler), ("scaler", scaler), ("loss_fn", loss_fn)):
        if (state[name] is None) != (given is None):
            have = "holds" if state[name] is not None else "holds no"
            raise ValueError(f"{path} {have} {name} state but {name}= was "
                             f"{'not ' if given is None else ''}passed; resume with the run's own {name}")
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    unwrap(model).load_state_dict(weights)
    if loss_fn is not None:
        loss_fn.load_state_dict({k.removeprefix("loss_fn/"): v for k, v in tensors.items()
                                 if k.startswith("loss_fn/")})
    opt_state: dict[int, dict] = {int(pid): dict(v) for pid, v in state["optimizer"]["state"].items()}
    for key, v in tensors.items():
        if key.startswith("optimizer/"):
            _, pid, name = key.split("/", 2)
            opt_state.setdefault(int(pid), {})[name] = v
    groups = _typed_like(state["optimizer"]["param_groups"], optimizer.state_dict()["param_groups"])
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    if scheduler is not None:
        scheduler.load_state_dict(_typed_like(state["scheduler"], scheduler.state_dict()))
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(tensors["rng/torch"])
    cuda_keys = sorted((t for t in tensors if t.startswith("rng/cuda/")), key=lambda t: int(t.rsplit("/", 1)[1]))
    cuda = [tensors[k] for k in cuda_keys]  # in device order: "rng/cuda/10" sorts before "rng/cuda/2" as text
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    py_version, py_state, py_gauss = state["rng"]["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["rng"]["numpy"]
    np.random.set_state((np_kind, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    return int(state["step"])
