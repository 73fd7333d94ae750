"""What the workloads share: their results as markdown tables (as in evidence/), the
checks of their configs, their progress bars, the median of timed steps, and torch.func's
per-sample-gradient recipe and the per-sample problem their ablations, the perf suite and evidence/
time ours against."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a markdown table: ``header`` then one line per row of preformatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def mib(value: float | None) -> str:
    """A peak-memory cell: MiB, or '-' where the platform gives no measure."""
    return "-" if value is None else f"{value:.0f}"


def require_positive(config: object, names: Sequence[str]) -> None:
    """Refuse a config whose named fields are not >= 1, naming the field."""
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")


def check_device(device: str) -> None:
    """Refuse a device this process cannot run on, naming what would work."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: no CUDA device is available here; use cpu")
        if d.index is not None and d.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    elif d.type != "cpu":
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def amp_recipe(device: str, accumulation: int = 1):  # -> kernels.training.Recipe
    """The ablations' AMP row: fp16 + GradScaler on CUDA (the seeds' --fp16), bf16 on CPU."""
    import torch

    from kernels.training import Recipe

    if device.startswith("cuda"):
        return Recipe(torch.float16, grad_scaler=True, accumulation=accumulation)
    return Recipe(torch.bfloat16, accumulation=accumulation)


def bf16_emulated(device: str) -> bool:
    """Whether bf16 autocast on ``device`` runs in software: a CPU without AVX512-BF16 or AMX-BF16
    (there the ablations' AMP rows ran 9-20x slower than fp32, on a Zen 3), or a GPU before compute
    capability 8.0."""
    from kernels.training import native_bf16

    return not native_bf16(device)


EMULATED_BF16_NOTE = ("bf16 is emulated on this CPU (no avx512_bf16 or amx_bf16): the AMP rows are left out "
                      "(9-20x slower than fp32 where measured); --emulated-bf16 runs them")


def progress(items: Iterable[T] | None = None, **kwargs: Any) -> Any:
    """A tqdm bar on stderr for work that runs longer than a few seconds; off when stderr is not a
    terminal (logs and tests), and gone when done."""
    from tqdm import tqdm

    return tqdm(items, disable=None, leave=False, dynamic_ncols=True, **kwargs)


def median_step_ms(calls: Iterable[Callable[[], object]], warmup: int, device: str) -> float:
    """Median milliseconds of the calls after the first ``warmup``, each synchronized on CUDA.
    ``calls`` yields each step ready to run (its batch already bound), so fetching it is untimed."""
    import torch

    times = []
    for i, call in enumerate(calls):
        t0 = time.perf_counter()
        call()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if not times:
        raise ValueError(f"no timed step: the calls must outnumber warmup={warmup}")
    return 1e3 * sorted(times)[len(times) // 2]


def per_sample_problem(batch: int, device: Any = "cpu") -> tuple:
    """The perf suite's per-sample problem, seeded: the OCS MLP 784-256-256-10 (no dropout) on
    ``device``, a synthetic batch ``x`` (batch, 784) and labels ``y`` (batch,) of 10 classes, as
    ``(model, F.cross_entropy, x, y)``, the arguments of ``per_sample_grads`` and ``vmap_grads``."""
    import torch
    import torch.nn.functional as F

    from kernels.models import MLP

    torch.manual_seed(0)
    model = MLP((784, 256, 256, 10)).to(device)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, F.cross_entropy, x, y


def vmap_grads(model: Any, loss_fn: Callable, x: Any, y: Any) -> dict:
    """torch.func's per-sample-gradient recipe for every layer: vmap over the samples of the grad
    of a one-sample loss (no Linear identity). ``{name: Tensor(B, *param.shape)}`` of the
    parameters that require grad; the others and the buffers held fixed."""
    from torch.func import functional_call, grad, vmap

    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {**{n: p.detach() for n, p in model.named_parameters() if not p.requires_grad},
             **dict(model.named_buffers())}

    def sample_loss(params: dict, xi: Any, yi: Any) -> Any:
        return loss_fn(functional_call(model, (params, fixed), (xi[None],)), yi[None])

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(trained, x, y)
