"""The LoRA spectral-feature probe (after weightspace-lora-for-diffusion), end to end.

Data: synthetic LoRA-like weight sets. Each sample has ``layers`` updates U diag(s) V^T + noise
(rank ``rank``, Haar-random U and V); its class (10) sets the spectral shape, s_i =
exp(-i / tau_c) with tau_c from 1.0 to 3.0 and +-30% jitter per sample and layer, so classes
overlap.
Features: the original's 32 spectral features per layer, concatenated; standardized; then the
original's classifier (3 x [Linear 512, BatchNorm1d, ReLU, Dropout 0.5] -> Linear), Adam lr 1e-3 wd
1e-4, ReduceLROnPlateau on the validation loss, early stopping after ``patience`` epochs.

Reference: exact singular values (svdvals), scikit-learn's StandardScaler, fp32, batch 64, the
plain loop. Optimized: randomized top-10 (kernels.spectral), kernels.Standardizer, batch 256, the
engine under Recipe.auto (AMP where it measures faster), features kept in a FeatureCache keyed
by the generating settings and code (a second run reads them back). By default the original's 128
LoRA layers of SD 1.5 are scaled to 16 square layers of 256 x 256 for a 2-core CPU; ``--shapes
sd15`` generates the real ones (``SD15_SHAPES``: 16 transformer blocks of width 320/640/1280, each
with self-attention q, k, v, out (d x d) and cross-attention q, out (d x d), k, v (d x 768)).
``sample_layers`` keeps a seeded fraction of the layers, as the original's ``--sample-layers``
does; the layers' weights come through a DataLoader (``num_workers`` generate them while the
main process computes features, as the original's workers load LoRA files).

    python -m workloads.cli.spectral_probe [--samples 400] [--layers 16] [--shapes sd15] [--ablation]
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from kernels.feature_cache import FeatureCache
from kernels.spectral import spectral_features
from kernels.standardize import Standardizer
from kernels.training import Recipe, train
from reference.workloads import spectral_probe as reference_run
from workloads.common import check_device, markdown, progress, require_positive


def _sd15_shapes() -> tuple[tuple[int, int], ...]:
    """(out, in) of the 128 attention projections of SD 1.5's UNet, in block order."""
    widths = [320] * 2 + [640] * 2 + [1280] * 2 + [1280] + [1280] * 3 + [640] * 3 + [320] * 3  # down, mid, up
    per_block = lambda d: [(d, d)] * 4 + [(d, d), (d, 768), (d, 768), (d, d)]  # attn1 q k v out, attn2 q k v out
    return tuple(shape for d in widths for shape in per_block(d))


SD15_SHAPES = _sd15_shapes()
SHAPES = ("square", "sd15")


@dataclass(frozen=True)
class Config:
    samples: int = 400
    layers: int = 16
    dim: int = 256
    rank: int = 8
    classes: int = 10
    noise: float = 0.02
    max_epochs: int = 60
    patience: int = 15
    seed: int = 0
    device: str = "cpu"
    shapes: str = "square"  # "square": layers x (dim, dim); "sd15": SD15_SHAPES (dim unused)
    sample_layers: float = 1.0  # the fraction of the layers whose features are used (seeded choice)
    num_workers: int = 0  # DataLoader workers generating the layers' weights

    def __post_init__(self) -> None:
        require_positive(self, ("samples", "layers", "dim", "rank", "classes", "max_epochs", "patience"))
        check_device(self.device)
        if not 0.0 < self.sample_layers <= 1.0:
            raise ValueError(f"sample_layers is a fraction of the layers in (0, 1], got {self.sample_layers}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0: generate in this process), got {self.num_workers}")
        if self.shapes not in SHAPES:
            raise ValueError(f"shapes must be one of {SHAPES}, got {self.shapes!r}")
        if self.shapes == "sd15" and self.layers != len(SD15_SHAPES):
            raise ValueError(f"shapes='sd15' has {len(SD15_SHAPES)} layers; got layers={self.layers}")
        smallest = min(min(shape) for shape in SD15_SHAPES) if self.shapes == "sd15" else self.dim
        if smallest < self.rank:  # a rank-r update needs r singular directions in every layer
            raise ValueError(f"dim ({smallest}) must be >= rank ({self.rank}): a rank-{self.rank} update needs "
                             f"{self.rank} singular directions in every layer")
        if self.samples < 5 * self.classes:
            raise ValueError(f"samples ({self.samples}) must be >= 5 per class for the 70/10/20 split")


def labels(cfg: Config) -> Tensor:
    return torch.arange(cfg.samples) % cfg.classes


def layer_shape(cfg: Config, layer: int) -> tuple[int, int]:
    return SD15_SHAPES[layer] if cfg.shapes == "sd15" else (cfg.dim, cfg.dim)


def layer_weights(cfg: Config, layer: int) -> Tensor:
    """Layer ``layer`` of every sample: (samples, m, n) = (samples, *layer_shape), deterministic
    in (seed, layer). The noise's spectral norm is about 2 * noise at every shape."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + layer)
    (m, k), n, r = layer_shape(cfg, layer), cfg.samples, cfg.rank
    jitter = 1 + 0.3 * (2 * torch.rand(n, generator=g) - 1)
    tau = torch.linspace(1.0, 3.0, cfg.classes)[labels(cfg)] * jitter
    s = torch.exp(-torch.arange(r) / tau[:, None])  # (n, r)
    u = torch.linalg.qr(torch.randn(n, m, r, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, k, r, generator=g)).Q
    return (u * s[:, None, :]) @ v.mT + cfg.noise * 2 / (m**0.5 + k**0.5) * torch.randn(n, m, k, generator=g)


def layer_indices(cfg: Config) -> list[int]:
    """The layers whose features are used, in order: all of them, or a seeded
    ``round(sample_layers * layers)`` of them (at least one)."""
    if cfg.sample_layers == 1.0:
        return list(range(cfg.layers))
    keep = max(1, round(cfg.sample_layers * cfg.layers))
    order = torch.randperm(cfg.layers, generator=torch.Generator().manual_seed(cfg.seed + 3))
    return sorted(order[:keep].tolist())


class LayerWeights(Dataset):
    """Item i: (layer, its weights (samples, m, n)) for the i-th used layer."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.layers = cfg, layer_indices(cfg)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> tuple[int, Tensor]:
        return self.layers[i], layer_weights(self.cfg, self.layers[i])


def features(cfg: Config, values: Callable[..., Tensor]) -> tuple[Tensor, float]:
    """(samples, used layers * 32) and the seconds ``values`` took (generating the weights, which
    the original loads from disk, is not counted): ``values`` maps one layer (samples, m, n) to its
    features. With ``num_workers`` the next layers are generated while this one's are computed."""
    cuda = torch.device(cfg.device).type == "cuda"
    loader = DataLoader(LayerWeights(cfg), batch_size=None, num_workers=cfg.num_workers, pin_memory=cuda)
    out, seconds = [], 0.0
    for layer, w in progress(loader, desc="features", unit="layer"):
        w = w.to(cfg.device, non_blocking=True)
        gen = torch.Generator(device=w.device).manual_seed(cfg.seed * 1009 + layer)  # same features every run
        t0 = time.perf_counter()
        out.append(values(w, generator=gen))
        seconds += time.perf_counter() - t0
    return torch.cat(out, dim=1), seconds


class Probe(nn.Module):
    """The original's classifier: 3 x [Linear 512, BatchNorm1d, ReLU, Dropout 0.5] -> Linear."""

    def __init__(self, d_in: int, classes: int, hidden: int = 512) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for i in range(3):
            blocks += [nn.Linear(d_in if i == 0 else hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                       nn.Dropout(0.5)]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


@dataclass(frozen=True)
class Method:
    name: str
    values: Callable[..., Tensor]  # (one layer's weights, *, generator) -> its 32 features per sample
    scaler: Callable[[], object]  # kernels.Standardizer or reference.standardize.Standardizer
    batch: int
    train_fn: Callable
    recipe: Recipe | None = None
    cache: FeatureCache | None = None


@dataclass
class ProbeReport:
    name: str
    feature_s: float  # computing the features, or on a cache hit reading them back
    train_s: float
    epochs: int
    accuracy: float
    features_from: str = "computed"  # or "cache"
    val_loss: list[float] = field(default_factory=list)  # per epoch
    val_accuracy: list[float] = field(default_factory=list)  # per epoch


def _split(cfg: Config) -> tuple[Tensor, Tensor, Tensor]:
    perm = torch.randperm(cfg.samples, generator=torch.Generator().manual_seed(cfg.seed + 1))
    a, b = int(0.7 * cfg.samples), int(0.8 * cfg.samples)
    return perm[:a], perm[a:b], perm[b:]


def _features(cfg: Config, method: Method) -> tuple[Tensor, float, bool]:
    """The features, the seconds they took, and whether they were read from the cache."""
    if method.cache is None:
        return *features(cfg, method.values), False
    data = {f: getattr(cfg, f) for f in ("samples", "layers", "dim", "rank", "classes", "noise", "seed",
                                   "shapes")}
    data["used_layers"] = layer_indices(cfg)
    code = {name: hashlib.sha256(inspect.getsource(sys.modules[name]).encode()).hexdigest()
            for name in (method.values.__module__, __name__)}  # the features' code and the data generator's
    # the device: its generator draws other test matrices, so the randomized features differ by device
    key = {"workload": "spectral_probe", "data": data, "features": f"{method.values.__module__}."
           f"{method.values.__qualname__}", "code": code, "torch": torch.__version__,
           "device": torch.device(cfg.device).type}
    t0, spent = time.perf_counter(), []

    def compute() -> dict[str, Tensor]:
        x, seconds = features(cfg, method.values)
        spent.append(seconds)
        return {"x": x}

    x = method.cache.get_or_compute(key, compute)["x"].to(cfg.device)
    return x, spent[0] if spent else time.perf_counter() - t0, not spent  # a hit: the time to read the file


@torch.no_grad()
def _evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    model.eval()
    out = model(x)
    return F.cross_entropy(out.float(), y).item(), (out.argmax(1) == y).float().mean().item()


def run(method: Method, cfg: Config) -> ProbeReport:
    """Features (timed apart), standardization, then epochs until early stopping."""
    (x, feature_s, hit), y = _features(cfg, method), labels(cfg).to(cfg.device)
    tr, va, te = _split(cfg)
    t1 = time.perf_counter()
    scaler = method.scaler().fit(x[tr])
    x = scaler.transform(x).float().to(cfg.device)
    torch.manual_seed(cfg.seed)
    model = Probe(x.shape[1], cfg.classes).to(cfg.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=5)
    best, best_state, since, epochs = float("inf"), None, 0, 0
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    history: tuple[list[float], list[float]] = ([], [])
    bar = progress(total=cfg.max_epochs, desc=method.name, unit="epoch")
    while epochs < cfg.max_epochs:
        epochs += 1
        bar.update()
        order = tr[torch.randperm(len(tr), generator=gen)].to(cfg.device)
        batches = [(x[i], y[i]) for i in order.split(method.batch) if len(i) > 1]  # BatchNorm needs 2 rows
        method.train_fn(model, F.cross_entropy, opt, batches, method.recipe, device=cfg.device)
        val_loss, val_acc = _evaluate(model, x[va], y[va])
        history[0].append(val_loss)
        history[1].append(val_acc)
        plateau.step(val_loss)
        if val_loss < best:
            best, best_state, since = val_loss, copy.deepcopy(model.state_dict()), 0
        elif (since := since + 1) >= cfg.patience:
            break
    bar.close()
    if best_state is None:
        raise FloatingPointError("the validation loss was never finite: training diverged (check the features "
                                 "for inf after standardization, or lower the learning rate)")
    model.load_state_dict(best_state)
    _, acc = _evaluate(model, x[te], y[te])
    return ProbeReport(method.name, feature_s, time.perf_counter() - t1, epochs, acc,
                       "cache" if hit else "computed", *history)


def reference_method() -> Method:
    """The reference run (reference/workloads/spectral_probe.py)."""
    return Method(reference_run.NAME, reference_run.features, reference_run.scaler, reference_run.BATCH,
                  reference_run.train)


def optimized_method(cfg: Config, cache: FeatureCache | None, amp: bool = True) -> Method:
    """``amp``: the engine's recipe by ``Recipe.auto`` (AMP where it measures faster); False: fp32."""
    x = torch.randn(256, len(layer_indices(cfg)) * 32, device=cfg.device)
    y = torch.randint(0, cfg.classes, (256,), device=cfg.device)
    model = Probe(x.shape[1], cfg.classes).to(cfg.device)
    recipe = Recipe.auto(cfg.device, model=model, loss_fn=F.cross_entropy, batch=(x, y)) if amp else Recipe()
    return Method(f"optimized (top-k, Standardizer, batch 256, {recipe.name})", spectral_features, Standardizer,
                  256, train, recipe, cache)


def ablation(cfg: Config, cache_dir: str, amp: bool = True) -> list[ProbeReport]:
    """reference / + top-k / + Standardizer / + batch 256 (engine) / optimized, then its cached
    rerun; ``cache_dir`` should be empty, so the optimized row computes its features."""
    ref = reference_method()
    opt = optimized_method(cfg, FeatureCache(cache_dir), amp)
    rows = [ref, replace(ref, name="+ top-k (randomized)", values=spectral_features),
            replace(ref, name="+ Standardizer", values=spectral_features, scaler=Standardizer),
            Method("+ batch 256 (engine, fp32)", spectral_features, Standardizer, 256, train, Recipe()), opt,
            replace(opt, name=opt.name + ", cached features")]
    return [run(m, cfg) for m in progress(rows, desc="ablation", unit="run")]


def compare_seeds(cfg: Config, seeds: int, amp: bool = True) -> list[tuple[float, float]]:
    """(reference, optimized) test accuracy for data and training seeds 0 .. seeds - 1: the
    accuracy claim needs more than one draw (early stopping alone moves a run by points)."""
    pairs = []
    for seed in range(seeds):
        c = replace(cfg, seed=seed)
        pairs.append((run(reference_method(), c).accuracy, run(optimized_method(c, None, amp), c).accuracy))
    return pairs


def accuracy_claim(pairs: list[tuple[float, float]], margin: float = 0.01) -> str:
    """The paired per-seed differences optimized - reference (accuracy points), their t 95%
    interval, and a one-sided t test of non-inferiority: H0 "the optimized run is worse by
    ``margin`` or more"."""
    from scipy import stats

    diffs = [o - r for r, o in pairs]
    mean = sum(diffs) / len(diffs)
    pts = lambda v: f"{100 * v:+.1f}"
    head = f"optimized - reference: mean {pts(mean)} points over {len(diffs)} paired seeds"
    if len(diffs) < 2 or len(set(diffs)) == 1:
        return head + " (no spread to test: run more seeds)"
    ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    p = stats.ttest_1samp(diffs, -margin, alternative="greater").pvalue
    verdict = (f"'optimized worse by {100 * margin:g} point(s) or more' rejected at p = {p:.2g}" if p < 0.05 else
               f"not shown to be within {100 * margin:g} point(s) (p = {p:.2g})")
    return f"{head}, 95% CI [{pts(ci.low)}, {pts(ci.high)}]; {verdict}"


HEADER = ["run", "features", "features s", "train s", "total speedup", "epochs", "test accuracy"]


def table(rows: list[ProbeReport]) -> list[list[str]]:
    """The cells of ``HEADER``, one list per run."""
    base = rows[0].feature_s + rows[0].train_s
    return [[r.name, r.features_from, f"{r.feature_s:.2f}", f"{r.train_s:.2f}",
             f"{base / (r.feature_s + r.train_s):.2f}x", str(r.epochs), f"{r.accuracy:.1%}"] for r in rows]


def format_rows(rows: list[ProbeReport]) -> list[str]:
    return markdown(HEADER, table(rows))
