"""kernels.deterministic: two runs in its block are bitwise equal, loader workers included; it
puts every setting back; bad seeds are refused."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from kernels.determinism import deterministic, seed_worker
from kernels.training import train


class _Noisy(TensorDataset):
    """Each item draws from torch's, Python's and NumPy's RNGs (augmentation as users write it)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x) + random.random() + float(np.random.rand()), y


def _run(seed: int) -> torch.Tensor:
    with deterministic(seed) as generator:
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        data = _Noisy(torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) / 100, torch.arange(64) % 4)
        batches = DataLoader(data, batch_size=16, shuffle=True, num_workers=2, generator=generator,
                             worker_init_fn=seed_worker)
        train(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), batches)
        return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_two_runs_are_bitwise_equal_and_another_seed_differs() -> None:
    first = _run(0)
    assert torch.equal(first, _run(0))
    assert not torch.equal(first, _run(1))


def test_the_block_switches_on_and_puts_back() -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic(3):
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not torch.backends.cudnn.benchmark
        assert bool(torch.empty(4).isnan().all())  # uninitialized memory is filled: part of the cost
        assert torch.initial_seed() == 3
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with pytest.raises(RuntimeError), deterministic(0):
        raise RuntimeError("an error inside the block")
    assert not torch.are_deterministic_algorithms_enabled()  # put back on the way out of an error too


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True, "0"])
def test_bad_seeds_are_refused(seed) -> None:
    with pytest.raises(ValueError, match="seed must be an int"), deterministic(seed):
        pass


def test_a_numpy_or_tensor_seed_seeds_as_its_int() -> None:
    """random.seed takes no numpy integer: the validated int is used (it raised on entry, after
    deterministic algorithms were switched on, and left them on for the rest of the process)."""
    import numpy as np

    with deterministic(7):
        want = (torch.rand(2), np.random.rand())
    for seed in (np.int64(7), np.uint32(7), torch.tensor(7)):
        with deterministic(seed):
            assert torch.equal(torch.rand(2), want[0]) and np.random.rand() == want[1]
        assert not torch.are_deterministic_algorithms_enabled()


def test_the_block_seeds_python_and_yields_a_generator_of_the_seed() -> None:
    with deterministic(5) as generator:
        assert random.random() == random.Random(5).random()
        assert generator.initial_seed() == 5


def test_seed_worker_seeds_python_and_numpy_from_the_workers_torch_seed() -> None:
    """A worker's torch seed, modulo 2**32, seeds its Python and NumPy streams (one stream per worker)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(2**40 + 123)
        seed_worker(0)
        assert random.random() == random.Random(123).random()
        assert np.random.rand() == np.random.RandomState(123).rand()
    finally:
        torch.random.set_rng_state(state)


@pytest.mark.parametrize("warn_only", [False, True])
def test_warn_only_reaches_torch_and_the_mode_before_is_put_back(warn_only: bool) -> None:
    """Inside: deterministic algorithms in the warn_only asked; after: the mode set before the block,
    warn-only included."""
    try:
        torch.use_deterministic_algorithms(True, warn_only=not warn_only)
        with deterministic(0, warn_only=warn_only):
            assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() == (not warn_only)
    finally:
        torch.use_deterministic_algorithms(False)


def test_cudnn_benchmark_and_a_users_cublas_workspace_are_kept() -> None:
    """cuDNN autotuning switched on before the block is on again after it; a CUBLAS_WORKSPACE_CONFIG
    the user set (":16:8", cuBLAS's other deterministic setting) is left as it is, inside and after."""
    benchmark, workspace = torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        torch.backends.cudnn.benchmark = True
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        with deterministic(0):
            assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
