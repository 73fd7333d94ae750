"""Online Coreset Selection on rotated digits (after jaehong31/OCS ocs_mnist.py), end to end.

Data: scikit-learn's digits (1797 8x8 images, shipped with the package) upsampled to 28x28 so the
model is the original MLP 784-256-256-10 (dropout 0.2 after the first hidden layer), split 80/20;
task t rotates every image by 9 (t - 1) degrees. MNIST from local files with ``--mnist PATH``
(torchvision, never downloaded).

Per task, ``passes`` passes over the task's training images in stream batches of 100, the same
batches in the same order each pass (the original's unshuffled loader): each batch is scored
(``ocs_scores``: similarity - diversity, + tau x affinity to the whole memory from task 2 on),
its top 10 train one SGD step (lr 0.005 x 0.75^(t-1), momentum 0.8, a fresh optimizer per task)
with, from task 2 on, a replay batch of 10 from one memory slot (slots cut into batches of 10,
batches shuffled each pass) at loss weight 1: the original's ref_hyp of 10 multiplies a mean
loss that its get_coreset_loss divides by the batch size. At a task's end its slot of the
200-sample memory is a class-balanced pick of the last pass's selections in random order, and
earlier slots shrink to 200 // t by their OCS ranking.

Departures, stated: the original's 10 passes over MNIST's 60000 images become ``passes`` over
1437 (15 batches, the last of 37); a batch of at most 10 samples is skipped, not trained whole;
the new slot is capped by the last pass's 150 candidates (MNIST has 6000), so after task 1 the
memory holds 150, not 200; the class-balanced pick fills short classes with the best of the
rest instead of raising the other classes' quota; the random first 100 batches (r2c) are left
out; scoring runs with the model in eval mode (the original scores under the training step's
dropout masks, which makes the selection random, and no two implementations could be compared).

    python -m workloads.cli.ocs [--tasks 3] [--passes 10] [--ablation] [--mnist PATH]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.coreset import Memory, ocs_scores, top_k
from kernels.models import MLP
from kernels.optim import sgd
from kernels.training import Recipe, train
from perfgate.timing import peak_memory
from reference.workloads import ocs as reference_run
from workloads.common import check_device, progress, require_positive
from workloads.rotated_digits import Split

Scorer = Callable[..., Tensor]  # (model, loss_fn, inputs, targets, *, memory, tau) -> (N,) scores


@dataclass(frozen=True)
class Config:
    tasks: int = 3
    passes: int = 10
    stream: int = 100
    select: int = 10
    memory: int = 200
    lr: float = 0.005
    momentum: float = 0.8
    lr_decay: float = 0.75
    tau: float = 1000.0
    replay_weight: float = 1.0  # the original's ref_hyp 10 on a loss it divides by the batch (10)
    degrees: float = 9.0
    classes: int = 10
    seed: int = 0
    device: str = "cpu"
    mnist: str | None = None  # local MNIST root (torchvision layout) instead of scikit-learn's digits

    def __post_init__(self) -> None:
        require_positive(self, ("tasks", "passes", "stream", "select", "memory"))
        check_device(self.device)
        if self.select >= self.stream:  # a stream batch of select samples or fewer is skipped (_steps)
            raise ValueError(f"select ({self.select}) must be under stream ({self.stream}): each stream batch "
                             "picks select of its samples, and one with select or fewer is not trained on")


@dataclass
class OCSReport:
    name: str
    accuracy: list[list[float]] = field(default_factory=list)  # [t][j]: after task t+1, on task j+1
    seconds: list[float] = field(default_factory=list)  # per task: training, selection, memory update
    selected: list[Tensor] = field(default_factory=list)  # every step's picked train indices
    peak_bytes: list[int | None] = field(default_factory=list)  # per task, perfgate's measure
    params: Tensor | None = None  # the model's parameters after the last task, flattened

    @property
    def average_accuracy(self) -> float:
        return sum(self.accuracy[-1]) / len(self.accuracy[-1])

    @property
    def peak_mib(self) -> float | None:
        known = [b for b in self.peak_bytes if b is not None]
        return max(known) / 2**20 if known else None

    @property
    def forgetting(self) -> float:
        """Mean over earlier tasks of (best accuracy seen before the last task) - (accuracy now)."""
        if len(self.accuracy) < 2:
            return 0.0
        last = self.accuracy[-1]
        drops = [max(row[j] for row in self.accuracy[:-1] if j < len(row)) - last[j] for j in range(len(last) - 1)]
        return sum(drops) / len(drops)


class ReplayLoss:
    """Cross-entropy of the first ``n`` rows (the picked stream samples) plus ``weight`` times
    that of the remaining rows (the replay batch), as the original's two losses."""

    def __init__(self, n: int, weight: float) -> None:
        self.n, self.weight = n, weight

    def __call__(self, out: Tensor, y: Tensor) -> Tensor:
        loss = F.cross_entropy(out[: self.n], y[: self.n])
        if out.shape[0] > self.n:
            loss = loss + self.weight * F.cross_entropy(out[self.n :], y[self.n :])
        return loss


def balanced(order: Tensor, labels: Tensor, n: int, classes: int) -> Tensor:
    """The first ``n`` of ``order`` taking at most n // classes per class, filled up with the
    best of the rest: the original's class-wise fair selection."""
    quota, counts, chosen, rest = n // classes, [0] * classes, [], []
    for i, c in zip(order.tolist(), labels[order].tolist(), strict=True):
        if counts[c] < quota:
            counts[c] += 1
            chosen.append(i)
        else:
            rest.append(i)
    return torch.tensor(chosen + rest[: n - len(chosen)], dtype=torch.int64, device=order.device)


def _score(scorer: Scorer, model: nn.Module, x: Tensor, y: Tensor, memory: Memory | None, tau: float) -> Tensor:
    model.eval()  # deterministic scores (module note); the loop's step runs in train mode
    try:
        return scorer(model, F.cross_entropy, x, y, memory=memory, tau=tau)
    finally:
        model.train()


def _replay_batches(coreset: dict[int, Split], size: int, gen: torch.Generator) -> list[Split]:
    """Each memory slot shuffled and cut into batches of ``size``, the batches shuffled: the
    original's reconstruct_coreset_loader2, rebuilt every pass."""
    batches = []
    for x, y in coreset.values():
        perm = torch.randperm(len(y), generator=gen).to(y.device)
        batches += [(x[i], y[i]) for i in perm.split(size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def _steps(model: nn.Module, train: Split, coreset: dict[int, Split], cfg: Config, scorer: Scorer,
           gen: torch.Generator, report: OCSReport, last: list[Tensor]):
    """Yield one (inputs, targets) training batch per stream batch, scored with the model as the
    previous step left it (the engine pulls the next batch after stepping)."""
    x_all, y_all = train
    memory = (torch.cat([c[0] for c in coreset.values()]), torch.cat([c[1] for c in coreset.values()])) \
        if coreset else None
    stream = [i for i in torch.arange(len(y_all), device=y_all.device).split(cfg.stream) if len(i) > cfg.select]
    if not stream:
        raise ValueError(f"a task's training split has {len(y_all)} samples, no stream batch more than select "
                         f"({cfg.select}): nothing to select from; pass a smaller select or a larger task")
    for p in range(cfg.passes):
        replay = _replay_batches(coreset, cfg.select, gen) if coreset else []
        for b, idx in enumerate(stream):  # the same batches in the same order every pass, as the original
            x, y = x_all[idx], y_all[idx]
            # the top k as a set, in stream order: scores that tie within rounding may swap places
            # inside the top k, and the batch's order must not change the step's rounding
            pick = idx[top_k(_score(scorer, model, x, y, memory, cfg.tau), cfg.select).sort().values]
            report.selected.append(pick)
            if p == cfg.passes - 1:
                last.append(pick)
            xs, ys = x_all[pick], y_all[pick]
            if replay:
                rx, ry = replay[b % len(replay)]
                xs, ys = torch.cat([xs, rx]), torch.cat([ys, ry])
            yield xs, ys


def _update_memory(model: nn.Module, coreset: dict[int, Split], task: int, train: Split, last: list[Tensor],
                   cfg: Config, scorer: Scorer, gen: torch.Generator) -> None:
    size = cfg.memory // task
    for t, (x, y) in list(coreset.items()):  # earlier slots shrink by their OCS ranking
        if len(y) > size:
            order = top_k(_score(scorer, model, x, y, None, cfg.tau), len(y))
            keep = balanced(order, y, size, cfg.classes)
            coreset[t] = (x[keep], y[keep])
    cand = torch.cat(last)
    order = cand[torch.randperm(len(cand), generator=gen).to(cand.device)]
    keep = balanced(torch.arange(len(order), device=order.device), train[1][order], min(size, len(order)),
                    cfg.classes)
    coreset[task] = (train[0][order[keep]], train[1][order[keep]])


@torch.no_grad()
def accuracy(model: nn.Module, test: Split) -> float:
    model.eval()
    return (model(test[0]).argmax(1) == test[1]).float().mean().item()


@dataclass(frozen=True)
class Method:
    """How a run scores, loops and steps: the reference's pieces or the optimized ones."""

    name: str
    scorer: Scorer  # kernels.ocs_scores, reference.ocs_scores, or an ablation's
    train_fn: Callable  # kernels.training.train (the engine) or reference.training.train
    optimizer_fn: Callable  # kernels.sgd or reference.sgd
    recipe: Recipe | None = None


@dataclass
class Learner:
    """A model partway through the stream of tasks, with its memory and random state."""

    model: nn.Module
    gen: torch.Generator
    report: OCSReport
    coreset: dict[int, Split] = field(default_factory=dict)


def start(cfg: Config, name: str) -> Learner:
    torch.manual_seed(cfg.seed)
    return Learner(MLP(dropout=0.2).to(cfg.device), torch.Generator().manual_seed(cfg.seed), OCSReport(name))


def train_task(learner: Learner, t: int, tasks: list[tuple[Split, Split]], cfg: Config, method: Method) -> None:
    """Task t (1-based): its passes of selection and steps, then the memory update; the time and
    the accuracy on tasks 1..t are appended to the learner's report."""
    model, data = learner.model, tasks[t - 1][0]
    torch.manual_seed(cfg.seed + t)  # dropout masks: a function of the task, not of what ran before
    opt = method.optimizer_fn(model.parameters(), lr=cfg.lr * cfg.lr_decay ** (t - 1), momentum=cfg.momentum)
    loss_fn, last = ReplayLoss(cfg.select, cfg.replay_weight), []

    def task() -> None:
        _sync(cfg.device)
        t0 = time.perf_counter()
        steps = _steps(model, data, learner.coreset, cfg, method.scorer, learner.gen, learner.report, last)
        method.train_fn(model, loss_fn, opt, steps, method.recipe, device=cfg.device)
        _update_memory(model, learner.coreset, t, data, last, cfg, method.scorer, learner.gen)
        _sync(cfg.device)
        learner.report.seconds.append(time.perf_counter() - t0)

    learner.report.peak_bytes.append(peak_memory(task, cfg.device))
    learner.report.params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    learner.report.accuracy.append([accuracy(model, test) for _, test in tasks[:t]])


def run(method: Method, cfg: Config, tasks: list[tuple[Split, Split]]) -> OCSReport:
    """All tasks in order from the same seeds: same data order, same initial model."""
    learner = start(cfg, method.name)
    for t in progress(range(1, len(tasks) + 1), desc=method.name, unit="task"):
        train_task(learner, t, tasks, cfg, method)
    return learner.report


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def optimized_recipe(cfg: Config, tasks: list[tuple[Split, Split]]) -> Recipe:
    """Recipe.auto on the training step's model and batch (picked + replay rows): AMP only where
    it measures faster."""
    x, y = tasks[0][0][0][: 2 * cfg.select], tasks[0][0][1][: 2 * cfg.select]
    return Recipe.auto(cfg.device, model=MLP(dropout=0.2).to(cfg.device),
                       loss_fn=ReplayLoss(cfg.select, cfg.replay_weight), batch=(x, y))


def optimized(recipe: Recipe, scorer: Scorer = ocs_scores, name: str | None = None) -> Method:
    """Ghost-Gram scores (or ``scorer``), the engine under ``recipe``, kernels.sgd."""
    return Method(name or f"optimized (ghost Gram, {recipe.name})", scorer, train, sgd, recipe)


# The reference run (reference/workloads/ocs.py): loop scores, the plain fp32 loop, the same SGD.
REFERENCE = Method(reference_run.NAME, reference_run.scores, reference_run.train, reference_run.optimizer)
