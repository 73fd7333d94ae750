"""One switch for reproducible runs: ``with deterministic(seed) as generator: ...``.

Inside the block torch, Python and NumPy are seeded, ``torch.use_deterministic_algorithms`` is on
(an op with no deterministic implementation raises, or warns with ``warn_only=True``), cuDNN runs
its deterministic algorithms without autotuning, and cuBLAS gets the fixed workspace it needs
(``CUBLAS_WORKSPACE_CONFIG``). The block yields a seeded ``torch.Generator`` for a DataLoader:
shuffling and each worker's base seed derive from it, and ``seed_worker`` (its ``worker_init_fn``)
seeds Python and NumPy in each worker from that base seed. Leaving the block puts every setting
back as it was (the RNG states are left where the run got them).

Two runs of the same code and data in such blocks give bitwise equal parameters on the same
machine and software; across machines, kernels still differ (vector widths, thread counts).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kernels import checks

CUBLAS_WORKSPACE = ":4096:8"  # one of the two settings cuBLAS documents as deterministic


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: Python's and NumPy's RNGs seeded from the worker's torch seed
    (torch seeds each worker from the loader's generator; the other two it leaves alone)."""
    checks.integer(worker_id, "worker_id", low=0)
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


@contextmanager
def deterministic(seed: int = 0, *, warn_only: bool = False) -> Iterator[torch.Generator]:
    """Reproducible runs inside the block (module docstring); yields a generator seeded with
    ``seed`` for ``DataLoader(generator=..., worker_init_fn=seed_worker)``."""
    seed = checks.integer(seed, "seed", low=0, high=2**32 - 1)  # a Python int: random.seed takes no numpy one
    checks.flag(warn_only, "warn_only")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:  # whatever raises from here on, the settings are put back
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.manual_seed(seed)  # every device's generator
        random.seed(seed)
        np.random.seed(seed)
        yield torch.Generator().manual_seed(seed)
    finally:
        enabled, only_warn, cudnn_det, cudnn_bench, workspace = before
        torch.use_deterministic_algorithms(enabled, warn_only=only_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
