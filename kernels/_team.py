"""How many of torch's OpenMP threads a C pass of kernels/ takes (kernels/_rope.c, _softmax.c,
_standardize.c): their teams are torch's intra-op pool."""

from __future__ import annotations

import torch

GRAIN = 32768  # torch's own grain for elementwise ops (at::internal::GRAIN_SIZE)


def c_team(numel: int, most: int) -> int:
    """Threads of torch's team a C pass over ``numel`` elements takes: at most ``most`` (the C
    part's own limit), and one per GRAIN elements: fewer a thread cost more in the team's start
    than they save."""
    return max(1, min(torch.get_num_threads(), most, numel // GRAIN))
