"""A pytest plugin (``-p correctness_tests.lost_kernels``) that replaces three kernels by their
references' algorithms when its session is configured, before any perf test imports them: what the
gate must catch as a lost kernel (``python -m perfgate.fidelity --lost``). ``lose`` does the same
with any setter (``test_perfgate_suite.py`` passes a monkeypatch's, so the swap is undone)."""

from collections.abc import Callable
from typing import Any

import pytest

import kernels
import kernels.per_sample
import kernels.spectral
import kernels.standardize
import reference.per_sample
import reference.spectral
import reference.standardize

LOST = [
    (kernels.per_sample, "per_sample_grads", reference.per_sample.per_sample_grads),
    (kernels.spectral, "topk_singular_values", reference.spectral.topk_singular_values),
    (kernels.standardize, "Standardizer", reference.standardize.Standardizer),
]


def lose(assign: Callable[[Any, str, Any], None] = setattr) -> None:
    """Each LOST kernel replaced by its reference, in its module and in ``kernels``."""
    for module, name, slow in LOST:
        assign(module, name, slow)
        assign(kernels, name, slow)


def pytest_configure(config: pytest.Config) -> None:
    lose()
