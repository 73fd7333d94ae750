"""Online Coreset Selection on rotated digits (seed 000, jaehong31/OCS ocs_mnist.py), end to end.

Data: scikit-learn's digits (1797 8x8 images, shipped with the package) upsampled to 28x28 so the
model is the original MLP 784-256-256-10 (dropout 0.2 after the first hidden layer), split 80/20;
task t rotates every image by 9 (t - 1) degrees. MNIST from local files with ``--mnist PATH``
(torchvision, never downloaded).

Per task, ``passes`` shuffled passes over the task's training images in stream batches of 100:
each batch is scored (``ocs_scores``: similarity - diversity, + tau x affinity to the replay
memory from task 2 on), the top 10 train one SGD step (lr 0.005 x 0.75^(t-1), momentum 0.8, a
fresh optimizer per task), plus, from task 2 on, 10 memory samples with loss weight 10. At the
end of a task its slot of the 200-sample memory is a class-balanced pick of the last pass's
selections in random order, and earlier slots shrink to 200 // t by their OCS ranking, as the
original does. Departures, stated: the original's 10 passes over MNIST's 60000 images become
``passes`` over ~1440; its random first 100 batches (r2c) are left out; scoring runs with the
model in eval mode (the original scores under the training step's dropout masks, which makes
the selection random, and no two implementations could be compared).

    python -m kernels.workloads.ocs [--tasks 3] [--passes 10] [--ablation] [--mnist PATH]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.coreset import Memory, ocs_scores, top_k
from kernels.models import MLP
from kernels.optim import sgd
from kernels.perfgate.timing import peak_memory
from kernels.training import Recipe, train
from kernels.workloads.rotated_digits import Split, digits, mnist, rotated_tasks

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
    replay_weight: float = 10.0
    degrees: float = 9.0
    classes: int = 10
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("tasks", "passes", "stream", "select", "memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.select > self.stream:
            raise ValueError(f"select ({self.select}) must not exceed stream ({self.stream})")


@dataclass
class OCSReport:
    name: str
    accuracy: list[list[float]] = field(default_factory=list)  # [t][j]: after task t+1, on task j+1
    seconds: list[float] = field(default_factory=list)  # per task: training, selection, memory update
    selected: list[Tensor] = field(default_factory=list)  # every step's picked train indices
    peak_bytes: list[int | None] = field(default_factory=list)  # per task, kernels.perfgate's measure

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


def _steps(model: nn.Module, train: Split, coreset: dict[int, Split], cfg: Config, scorer: Scorer,
           gen: torch.Generator, report: OCSReport, last: list[Tensor]):
    """Yield one (inputs, targets) training batch per stream batch, scored with the model as the
    previous step left it (the engine pulls the next batch after stepping)."""
    x_all, y_all = train
    memory = (torch.cat([c[0] for c in coreset.values()]), torch.cat([c[1] for c in coreset.values()])) \
        if coreset else None
    replay = torch.randperm(len(memory[1]), generator=gen).to(x_all.device) if memory else None
    step = 0
    for p in range(cfg.passes):
        perm = torch.randperm(len(y_all), generator=gen).to(x_all.device)
        for b in range(len(y_all) // cfg.stream):
            idx = perm[b * cfg.stream : (b + 1) * cfg.stream]
            x, y = x_all[idx], y_all[idx]
            # the top k as a set, in stream order: scores that tie within rounding may swap places
            # inside the top k, and the batch's order must not change the step's rounding
            pick = idx[top_k(_score(scorer, model, x, y, memory, cfg.tau), cfg.select).sort().values]
            report.selected.append(pick)
            if p == cfg.passes - 1:
                last.append(pick)
            xs, ys = x_all[pick], y_all[pick]
            if memory is not None:
                r = replay[(torch.arange(cfg.select) + step * cfg.select).to(replay.device) % len(replay)]
                xs, ys = torch.cat([xs, memory[0][r]]), torch.cat([ys, memory[1][r]])
            step += 1
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
    learner.report.accuracy.append([accuracy(model, test) for _, test in tasks[:t]])


def run(method: Method, cfg: Config, tasks: list[tuple[Split, Split]]) -> OCSReport:
    """All tasks in order from the same seeds: same data order, same initial model."""
    learner = start(cfg, method.name)
    for t in range(1, len(tasks) + 1):
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
    """Ghost-Gram scores (or ``scorer``), the engine under ``recipe``, fused SGD."""
    return Method(name or f"optimized (ghost Gram, {recipe.name})", scorer, train, sgd, recipe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.workloads.ocs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=3, help="3: smoke; 20: the original's full run")
    parser.add_argument("--passes", type=int, default=10, help="shuffled passes over each task's images")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mnist", metavar="PATH", help="local MNIST (torchvision layout) instead of digits")
    parser.add_argument("--ablation", action="store_true", help="all five rows, not only reference/optimized")
    args = parser.parse_args(argv)
    try:
        cfg = Config(tasks=args.tasks, passes=args.passes, device=args.device)
    except ValueError as e:
        parser.error(str(e))
    data = mnist(args.mnist) if args.mnist else digits(cfg.seed)
    tasks = rotated_tasks(data, cfg.tasks, cfg.degrees, cfg.device)
    print(f"OCS, rotated {'MNIST' if args.mnist else 'digits'}, {cfg.tasks} tasks x {cfg.passes} passes "
          f"({len(tasks[0][0][1]) // cfg.stream} stream batches of {cfg.stream} each) on {cfg.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    from kernels.workloads.ocs_ablation import ablation, format_rows

    if args.ablation:
        rows = ablation(cfg, tasks)
    else:
        from reference.workloads.ocs import REFERENCE

        rows = [run(m, cfg, tasks) for m in (REFERENCE, optimized(optimized_recipe(cfg, tasks)))]
    print("\n".join(format_rows(rows)))
    same = all(torch.equal(a, b) for a, b in zip(rows[0].selected, rows[-1].selected, strict=True))
    print(f"reference and {rows[-1].name} selected the same samples at every step: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
