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
