"""Meta-Weight-Net data reweighting on long-tailed CIFAR-shaped data (after Betty).

Inner: a CIFAR ResNet (kernels.models.ResNet10) trained on mean_i W(l_i; w) l_i over a
long-tailed training set, n_c = max_per_class / imbalance^(c / 9) (CIFAR-10-LT: 4900 and 100;
scaled to 490 here). Outer: the 1-100-1 reweighting net W trained by Adam on the classifier's
cross-entropy over a balanced meta set, through one unrolled inner step (DARTS hypergradient).
Inner SGD lr 0.1, momentum 0.9, weight decay 5e-4 and Adam weight decay 1e-4 as Betty's example;
meta lr 1e-3 (Betty 1e-4 over 10000 steps; this budget is a few hundred). Through one unrolled
step, momentum and weight decay add nothing to d theta' / dw (they do not depend on w), so the
hypergradient is exact in them. Data: the class-template images of
workloads.cifar_resnet with pixel noise 8 (at its 2.5 every run reached 100% balanced
accuracy), standardized together (train, meta and test share one normalization), no download.

Optimized (this module): the engine (kernels.training) under Recipe.auto with gradient
accumulation k, kernels.sgd, kernels.darts_hypergradient with W's inputs held at theta.
Reference (reference/workloads/meta_reweight.py): the plain fp32 loop, per-parameter Python SGD,
one batch per step, and the exact hypergradient (autograd through the step).

    python -m workloads.cli.meta_reweight [--steps 200] [--accumulation 4] [--device cpu]

prints accuracy with and without reweighting for both runs, then Betty's memory table
(workloads/meta_reweight_ablation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from kernels.distributed import active, shard, unwrap
from kernels.hypergrad import darts_hypergradient, reweighted_loss
from kernels.models import ResNet10
from kernels.optim import sgd
from kernels.training import Recipe, train
from perfgate.timing import peak_memory
from reference.optim import sgd as reference_sgd
from workloads.cifar_resnet import synthetic_cifar
from workloads.common import check_device, median_step_ms, require_positive

Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Config:
    max_per_class: int = 490
    imbalance: float = 100.0
    meta_per_class: int = 10
    test_per_class: int = 100
    batch: int = 100
    meta_batch: int = 100
    steps: int = 200
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    meta_lr: float = 1e-3
    meta_weight_decay: float = 1e-4
    alpha: float = 0.01
    noise: float = 8.0  # pixel noise over the class templates (2.5: every run reaches 100%)
    norm: str = "batch"  # "group": micro-batches compute exactly what one batch does
    widths: tuple[int, ...] = (16, 32, 64, 128)
    seed: int = 0
    device: str = "cpu"
    # micro-batches per outer step of the optimized runs (checked against batch by optimized_recipe: the
    # data-parallel runs build per-rank Configs whose batch it need not divide)
    accumulation: int = 4

    def __post_init__(self) -> None:
        require_positive(self, ("max_per_class", "meta_per_class", "test_per_class", "batch", "meta_batch",
                                "steps"))
        check_device(self.device)
        for name in ("lr", "meta_lr", "alpha"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.imbalance < 1:
            raise ValueError(f"imbalance must be >= 1 (n_0 / n_9), got {self.imbalance}")
        if sum(class_counts(self)) < self.batch or 10 * self.meta_per_class < self.meta_batch:
            raise ValueError(f"a batch of {self.batch} needs max_per_class large enough (train set "
                             f"{sum(class_counts(self))}) and a meta batch of {self.meta_batch} needs "
                             f"meta_per_class >= {-(-self.meta_batch // 10)}")


def class_counts(cfg: Config, classes: int = 10) -> list[int]:
    """n_c = max_per_class / imbalance^(c / (classes - 1)), at least 1."""
    return [max(1, round(cfg.max_per_class / cfg.imbalance ** (c / (classes - 1)))) for c in range(classes)]


def _balanced(per_class: int, classes: int = 10) -> Tensor:
    return torch.arange(classes).repeat_interleave(per_class)


def datasets(cfg: Config) -> tuple[Batch, Batch, Batch]:
    """(long-tailed train, balanced meta, balanced test) sets, each (x, y) on cfg.device."""
    labels = [torch.cat([torch.full((n,), c) for c, n in enumerate(class_counts(cfg))]),
              _balanced(cfg.meta_per_class), _balanced(cfg.test_per_class)]
    x, y = synthetic_cifar(sum(map(len, labels)), seed=cfg.seed, y=torch.cat(labels), noise=cfg.noise)  # one norm.
    sizes = [len(t) for t in labels]
    return tuple((a.to(cfg.device), b.to(cfg.device)) for a, b in zip(x.split(sizes), y.split(sizes), strict=True))


def batches(data: Batch, size: int, seed: int) -> Iterator[Batch]:
    """Shuffled batches of ``size``, epoch after epoch (the last short batch of an epoch dropped)."""
    x, y = data
    if len(x) < size:
        raise ValueError(f"a batch of {size} needs at least {size} samples, the set has {len(x)}")
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=gen).to(x.device)
        for i in range(0, len(x) - size + 1, size):
            yield x[order[i : i + size]], y[order[i : i + size]]


class MetaWeightNet(nn.Module):
    """W(l; w) = sigmoid(Linear(100, 1)(relu(Linear(1, 100)(l)))): (B, 1) losses -> (B, 1) weights."""

    def __init__(self, hidden: int = 100) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, 1), nn.Sigmoid())

    def forward(self, losses: Tensor) -> Tensor:
        return self.net(losses)


@dataclass
class Learner:
    model: nn.Module
    weight_net: MetaWeightNet
    inner_opt: torch.optim.Optimizer
    outer_opt: torch.optim.Optimizer
    recipe: Recipe = field(default_factory=Recipe)
    scaler: torch.amp.GradScaler | None = None  # fp16: one scaler across steps keeps its scale


def learner(cfg: Config, sgd_fn: Callable = sgd, recipe: Recipe | None = None) -> Learner:
    """The same initial classifier and W for every run of one seed."""
    torch.manual_seed(cfg.seed)
    model = ResNet10(widths=cfg.widths, norm=cfg.norm).to(cfg.device)
    weight_net = MetaWeightNet().to(cfg.device)
    inner_opt = sgd_fn(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    outer_opt = torch.optim.Adam(weight_net.parameters(), lr=cfg.meta_lr, weight_decay=cfg.meta_weight_decay)
    recipe = recipe or Recipe()
    scaler = torch.amp.GradScaler(torch.device(cfg.device).type) if recipe.grad_scaler else None
    return Learner(model, weight_net, inner_opt, outer_opt, recipe, scaler)


def per_sample_ce(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.float(), y, reduction="none")


def outer_step(ln: Learner, batch: Batch, meta: Batch, cfg: Config, reweight: bool = True) -> None:
    """One inner step on ``batch`` through the engine (micro-batches of the recipe's accumulation),
    then, with ``reweight``, one Adam step of W on the DARTS hypergradient over ``meta``.
    Data parallel (``ln.model`` wrapped by kernels.distributed): ``batch`` and ``meta`` are the
    global batches, the same on every rank; each rank trains and differentiates on its shard."""
    if isinstance(ln.model, DistributedDataParallel) and active():
        batch, meta = (shard(batch[0]), shard(batch[1])), (shard(meta[0]), shard(meta[1]))
    k = ln.recipe.accumulation
    if len(batch[0]) % k or len(meta[0]) % k:
        each = " each rank's share of" if isinstance(ln.model, DistributedDataParallel) and active() else ""
        raise ValueError(f"accumulation {k} must divide{each} the batch ({len(batch[0])}) and the meta batch "
                         f"({len(meta[0])}): unequal micro-batches would weight samples unequally")
    micro = list(zip(batch[0].chunk(k), batch[1].chunk(k), strict=True))
    if not reweight:
        train(ln.model, F.cross_entropy, ln.inner_opt, micro, ln.recipe, device=cfg.device, scaler=ln.scaler)
        return
    theta = {n: p.detach().clone() for n, p in unwrap(ln.model).named_parameters()}
    held: list[Tensor] = []  # l_i at theta, per micro-batch: W's inputs, held fixed in the difference

    def inner_loss(logits: Tensor, y: Tensor) -> Tensor:
        losses = per_sample_ce(logits, y)
        held.append(losses.detach())
        return reweighted_loss(losses, ln.weight_net)

    result = train(ln.model, inner_loss, ln.inner_opt, micro, ln.recipe, device=cfg.device, scaler=ln.scaler)
    if result.skipped_steps:  # fp16 overflow: theta did not move, so there is no step to differentiate
        return
    inner_fns = [lambda f, x=x, y=y, l0=l0: reweighted_loss(per_sample_ce(f(x), y), ln.weight_net, l0)
                 for (x, y), l0 in zip(micro, held, strict=True)]
    outer_fns = [lambda f, x=x, y=y: F.cross_entropy(f(x).float(), y)
                 for x, y in zip(meta[0].chunk(k), meta[1].chunk(k), strict=True)]
    dtype = ln.recipe.autocast_dtype if ln.recipe.autocast_dtype == torch.bfloat16 else None
    grads = darts_hypergradient(ln.model, inner_fns, outer_fns, ln.weight_net.parameters(), lr=cfg.lr,
                                alpha=cfg.alpha, at=theta, autocast_dtype=dtype)
    for p, g in zip(ln.weight_net.parameters(), grads, strict=True):
        p.grad = g
    ln.outer_opt.step()
    ln.outer_opt.zero_grad(set_to_none=True)


@torch.no_grad()
def balanced_accuracy(model: nn.Module, test: Batch) -> float:
    """Mean over classes of the per-class accuracy."""
    model.eval()
    pred = torch.cat([model(x).argmax(1) for x in test[0].split(500)])
    model.train()
    hits = (pred == test[1]).float()
    return torch.stack([hits[test[1] == c].mean() for c in test[1].unique()]).mean().item()


StepFn = Callable[[Learner, Batch, Batch, Config, bool], None]


@dataclass
class RunReport:
    name: str
    ms_per_step: float  # median over the timed steps
    balanced_accuracy: float
    peak_mib: float | None = None  # one outer step, after the warm-up steps


def run(name: str, step: StepFn, ln: Learner, cfg: Config, reweight: bool = True, warmup: int = 0,
        measure_peak: bool = False) -> RunReport:
    """``warmup`` then ``cfg.steps`` outer steps on the same batch stream as every other run of
    this seed; with ``measure_peak``, one more step measured for its peak memory."""
    train_set, meta_set, test = datasets(cfg)
    data, meta = batches(train_set, cfg.batch, cfg.seed + 1), batches(meta_set, cfg.meta_batch, cfg.seed + 2)
    if ln.recipe.channels_last:
        ln.model.to(memory_format=torch.channels_last)
    # each step with its batches drawn before its clock starts
    calls = (partial(step, ln, next(data), next(meta), cfg, reweight) for _ in range(warmup + cfg.steps))
    ms = median_step_ms(calls, warmup, cfg.device)
    accuracy, peak = balanced_accuracy(ln.model, test), None
    if measure_peak:  # one more step, after the accuracy
        b, m = next(data), next(meta)
        peak = peak_memory(lambda: step(ln, b, m, cfg, reweight), cfg.device)
    return RunReport(name, ms, accuracy, None if peak is None else peak / 2**20)


def optimized_recipe(cfg: Config, accumulation: int | None = None) -> Recipe:
    """Recipe.auto with ``accumulation`` (default ``cfg.accumulation``), timed on the classifier
    at the micro-batch size."""
    accumulation = cfg.accumulation if accumulation is None else accumulation
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or not 1 <= accumulation <= cfg.batch:
        raise ValueError(f"accumulation must be an int in [1, batch={cfg.batch}], got {accumulation!r}")
    if cfg.batch % accumulation:
        raise ValueError(f"accumulation {accumulation} must divide the batch ({cfg.batch}) into equal parts")
    x, y = synthetic_cifar(max(2, cfg.batch // accumulation), seed=99)
    model = ResNet10(widths=cfg.widths, norm=cfg.norm).to(cfg.device)
    return Recipe.auto(cfg.device, accumulation=accumulation, model=model, loss_fn=F.cross_entropy,
                       batch=(x.to(cfg.device), y.to(cfg.device)))


def reference_learner(cfg: Config) -> Learner:
    """The reference run's learner: the same initial classifier and W, per-parameter Python SGD."""
    return learner(cfg, sgd_fn=reference_sgd)
