"""The training-loop engine every workload shares, configured by a ``Recipe``.

One loop: autocast (fp16 + GradScaler, or bf16), gradient accumulation (loss / k, one optimizer
and scaler step per window, a trailing partial window rescaled to its own size),
``zero_grad(set_to_none=True)``, channels_last and ``torch.compile`` as options, batches moved
to the device (``non_blocking`` when they come pinned, e.g. from ``DataLoader(pin_memory=True)``;
workloads preload them on the device), a scheduler stepped once per optimizer step, and steps
the GradScaler skipped (inf/NaN gradients) counted, never applied.

``Recipe.auto`` picks per device what measured faster. On CPU the answer differs between CPU
kinds (bf16 and channels_last sped a ResNet-10 up on an AVX512-BF16 AMD EPYC and slowed
resnet18 down on a Xeon; docs/measurements/from-the-code.md), so ``auto`` times the candidates
on the caller's model and batch when given them, and otherwise keeps plain fp32; it leaves fp32
only for a candidate at least 10% faster (a smaller gain is timing noise, not a reason to lose
precision and the reference's exact selections). CUDA: fp16 + GradScaler + channels_last,
torch's documented fast path, not yet measured in this project.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

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
    measured_ms: dict = field(default_factory=dict, compare=False)  # what auto timed: ms per step
    compile_s: dict = field(default_factory=dict, compare=False)  # what auto compiled: seconds, apart

    def __post_init__(self) -> None:
        if self.autocast_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError("autocast_dtype must be None, torch.float16 or torch.bfloat16, "
                             f"got {self.autocast_dtype}")
        if not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise ValueError(f"accumulation must be an int >= 1, got {self.accumulation!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
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
    def auto(cls, device: str | torch.device, *, accumulation: int = 1, model: nn.Module | None = None,
             loss_fn: LossFn | None = None, batch: tuple[Tensor, Tensor] | None = None,
             compile_modes: tuple[str, ...] = ()) -> Recipe:
        """The fastest recipe for ``device``; on CPU measured on ``model``/``batch`` (see module).
        ``compile_modes`` (opt-in: each compiles the model, seconds to minutes): torch.compile
        modes tried on top of the chosen recipe, one kept only when its steps measure at least
        ``AUTO_MARGIN`` faster; compile time is kept apart in ``compile_s``."""
        for mode in compile_modes:
            if mode not in COMPILE_MODES[1:]:
                raise ValueError(f"compile_modes must be among {COMPILE_MODES[1:]}, got {mode!r}")
        kind = torch.device(device).type
        if kind == "cuda":
            best = cls(torch.float16, True, accumulation, channels_last=True)
            if not compile_modes or model is None or loss_fn is None or batch is None:
                return best
            return _keep_faster_compile(best, compile_modes, model, loss_fn, batch, device)
        base = cls(accumulation=accumulation)
        if model is None or loss_fn is None or batch is None:
            return base
        candidates = [base, replace(base, autocast_dtype=torch.bfloat16), replace(base, channels_last=True),
                      replace(base, autocast_dtype=torch.bfloat16, channels_last=True)]
        if batch[0].ndim != 4:
            candidates = candidates[:2]  # channels_last is for images
        timings = {r.name: _time_step(r, model, loss_fn, batch, device) for r in candidates}
        best = min(candidates, key=lambda r: timings[r.name])
        if timings[best.name] > (1 - AUTO_MARGIN) * timings[base.name]:
            best = base  # a win inside the timing noise does not pay for reduced precision
        best = replace(best, measured_ms=timings)
        return _keep_faster_compile(best, compile_modes, model, loss_fn, batch, device) if compile_modes else best


def _keep_faster_compile(best: Recipe, modes: tuple[str, ...], model: nn.Module, loss_fn: LossFn,
                         batch: tuple[Tensor, Tensor], device: str | torch.device) -> Recipe:
    """``best`` compiled in the fastest of ``modes`` when that is at least AUTO_MARGIN faster per
    step than ``best`` eager (compile time aside), else ``best``; both timings recorded."""
    timings, compile_s = dict(best.measured_ms), {}
    if best.name not in timings:
        timings[best.name] = _time_step(best, model, loss_fn, batch, device)
    compiled = [replace(best, compile_mode=m) for m in modes]
    for r in compiled:
        first: list[float] = []
        timings[r.name] = _time_step(r, model, loss_fn, batch, device, first_s=first)
        compile_s[r.name] = first[0]
    fastest = min(compiled, key=lambda r: timings[r.name])
    keep = fastest if timings[fastest.name] <= (1 - AUTO_MARGIN) * timings[best.name] else best
    return replace(keep, measured_ms=timings, compile_s=compile_s)


def _time_step(recipe: Recipe, model: nn.Module, loss_fn: LossFn, batch: tuple[Tensor, Tensor],
               device: str | torch.device, budget_s: float = 0.05, max_repeats: int = 50,
               first_s: list[float] | None = None) -> float:
    """Median ms of a training step under ``recipe`` on a copy of the model, after a warm-up
    step (its seconds appended to ``first_s``: compilation lives there): at least 3 steps, more
    while they fit in ``budget_s`` (millisecond steps are noisy)."""
    trial = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(trial.parameters(), lr=0.0)
    t0 = time.perf_counter()
    train(trial, loss_fn, opt, [batch], recipe, device=device)
    if first_s is not None:
        first_s.append(time.perf_counter() - t0)
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget_s and len(times) < max_repeats):
        t0 = time.perf_counter()
        train(trial, loss_fn, opt, [batch], recipe, device=device)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


@dataclass
class TrainResult:
    losses: list[float]  # one per optimizer step: the mean loss over its micro-batches
    optimizer_steps: int
    skipped_steps: int  # GradScaler found inf/NaN gradients and did not apply the step
    seconds: float
    grad_norms: list[float] = field(default_factory=list)  # with max_grad_norm: each step's norm before clipping


def check_max_grad_norm(max_grad_norm: float | None) -> None:
    """``max_grad_norm``: None (no clipping) or a finite number > 0. Shared with the reference."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be None (no clipping) or a finite number > 0, got {max_grad_norm!r}")


def _all_finite(tensors: list[Tensor]) -> bool:
    """One device sync for all: are all values finite?"""
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _to_device(t: Tensor, device: torch.device, channels_last: bool) -> Tensor:
    if t.device != device:  # non_blocking overlaps only from pinned memory (DataLoader(pin_memory=True))
        t = t.to(device, non_blocking=t.is_pinned())
    if channels_last and t.ndim == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


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
    the norms before clipping are returned in ``grad_norms``.

    Data parallel: pass ``model`` wrapped by ``kernels.distributed`` (DistributedDataParallel)
    and each rank's own batches (a DistributedSampler, or ``kernels.distributed.shard``), the
    same number on every rank. Gradients are all-reduced once per optimizer step (the window's
    last micro-batch; the others run under ``no_sync``), and ``losses`` are the mean over ranks.
    """
    recipe = recipe or Recipe()
    check_max_grad_norm(max_grad_norm)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device, cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    if recipe.channels_last:
        model.to(memory_format=torch.channels_last)
    forward = torch.compile(model, mode=recipe.compile_mode) if recipe.compile_mode else model
    if scaler is None:
        scaler = torch.amp.GradScaler(device.type, enabled=recipe.grad_scaler)
    elif not recipe.grad_scaler:
        raise ValueError("a scaler was passed but recipe.grad_scaler is False")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    data_parallel = isinstance(model, DistributedDataParallel) and active()
    autocast = recipe.autocast_dtype is not None
    k, losses, window, skipped, start = recipe.accumulation, [], [], 0, time.perf_counter()
    norms: list[Tensor] = []
    model.train()
    optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        nonlocal skipped
        grads = [p.grad for p in params if p.grad is not None]
        if len(window) < k and grads:  # trailing partial window: loss was divided by k, not its size
            torch._foreach_mul_(grads, k / len(window))
        loss = torch.stack(window).mean()
        loss = (all_mean_([loss])[0] if data_parallel else loss).item()  # every rank reports the global loss
        if not recipe.grad_scaler and not (math.isfinite(loss) and _all_finite(grads)):
            raise FloatingPointError(
                f"loss {loss:.4g} or its gradients are not finite at optimizer step {len(losses) + 1}; "
                "the step was not applied. Lower the learning rate, or use grad_scaler=True to skip "
                "such steps")
        if max_grad_norm is not None:
            scaler.unscale_(optimizer)  # clip true gradients, not scaled ones (a no-op when disabled)
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_grad_norm).detach())
        scale = scaler.get_scale() if recipe.grad_scaler else None
        scaler.step(optimizer)
        scaler.update()
        if recipe.grad_scaler and scaler.get_scale() < scale:  # the scaler backed off: step skipped
            skipped += 1
        elif scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        window.clear()

    for x, y in batches:  # each batch is read after the previous step: a generator may depend on it
        x, y = _to_device(x, device, recipe.channels_last), _to_device(y, device, False)
        # DDP: gradients are all-reduced only on the window's last micro-batch (one all-reduce a step)
        sync = not data_parallel or len(window) == k - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(device.type, dtype=recipe.autocast_dtype, enabled=autocast):
                loss = loss_fn(forward(x), y)
            if loss.ndim != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            scaler.scale(loss / k).backward()
        window.append(loss.detach().float())
        if len(window) == k:
            step()
    if window:  # a trailing partial window; under DDP its micro-batches ran under no_sync: all-reduce now
        if data_parallel:
            all_mean_([p.grad for p in params if p.grad is not None])
        step()
    grad_norms = torch.stack(norms).tolist() if norms else []  # one sync for all steps
    return TrainResult(losses, len(losses), skipped, time.perf_counter() - start, grad_norms)


# Checkpoint and resume: one safetensors file (every tensor) whose metadata holds the rest as
# JSON, written atomically; no pickle anywhere, so reading a checkpoint runs no code.
CHECKPOINT_FORMAT = "kernelgate-checkpoint-1"


def _json(value: object, what: str) -> str:
    try:
        return json.dumps(value)
    except TypeError as e:
        raise TypeError(f"{what} holds a value JSON cannot store ({e}); checkpoints keep tensors and "
                        "plain values only (no pickle)") from None


def _own(t: Tensor) -> Tensor:
    return t.detach().to("cpu").clone().contiguous()  # own storage: safetensors refuses shared ones


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    scaler: torch.amp.GradScaler | None = None, step: int = 0) -> None:
    """Model, optimizer, scheduler, GradScaler and RNG states (torch, CUDA, Python, NumPy) and
    ``step`` in one file at ``path``, replaced atomically (a crash leaves the previous one).

    Data parallel: call it on every rank; rank 0 writes (the replicas are equal) and every rank
    returns once the file is complete, or raises when rank 0 could not write it. On several hosts
    ``path`` must be on a file system they share, for a resume to read it. The model's names are
    those of the wrapped module, so a checkpoint loads into one process or many alike. The RNG
    states are rank 0's: after resuming, every rank starts from them (reseed per rank for
    distinct dropout or augmentation streams)."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not active():
        _write_checkpoint(path, unwrap(model), optimizer, scheduler, scaler, step)
        return
    error = None
    if rank() == 0:
        try:
            _write_checkpoint(path, unwrap(model), optimizer, scheduler, scaler, step)
        except Exception as e:  # every rank learns of it below, so none waits for a file that never comes
            error = e
    if not agree(error is None):  # also the barrier: no rank reads the file before rank 0 has replaced it
        if error is not None:
            raise error
        raise RuntimeError(f"rank 0 could not write the checkpoint {path} (its error is in rank 0's log)")


def _write_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LRScheduler | None, scaler: torch.amp.GradScaler | None,
                      step: int) -> None:
    tensors = {f"model/{k}": _own(v) for k, v in model.state_dict().items()}
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
        "rng": {"python": [py_version, list(py_state), py_gauss],
                "numpy": [np_kind, np_keys.tolist(), np_pos, np_has_gauss, np_gauss]},
    }
    write_safetensors(path, tensors, {"format": CHECKPOINT_FORMAT, "state": _json(state, "the training state")})


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    scaler: torch.amp.GradScaler | None = None) -> int:
    """Restore what ``save_checkpoint`` wrote into the given objects (built as for a fresh run)
    and the RNG states; returns the saved ``step``. A checkpoint holding a scheduler or scaler
    state not asked for (or the reverse) is an error: resuming without it would change the run."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a kernelgate checkpoint (format {meta.get('format')!r})")
    state = json.loads(meta["state"])
    for name, given in (("scheduler", scheduler), ("scaler", scaler)):
        if (state[name] is None) != (given is None):
            have = "holds" if state[name] is not None else "holds no"
            raise ValueError(f"{path} {have} {name} state but {name}= was "
                             f"{'not ' if given is None else ''}passed; resume with the run's own {name}")
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    unwrap(model).load_state_dict(weights)
    opt_state: dict[int, dict] = {int(pid): dict(v) for pid, v in state["optimizer"]["state"].items()}
    for key, v in tensors.items():
        if key.startswith("optimizer/"):
            _, pid, name = key.split("/", 2)
            opt_state.setdefault(int(pid), {})[name] = v
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
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
