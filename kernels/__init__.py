"""kernelgate: optimized PyTorch training kernels, each beside a reference in ``reference``.

Public API (loaded on first use, so ``import kernels`` stays light):

- ``per_sample_grads``, ``per_sample_grad_gram``, ``per_sample_grad_norms`` (kernels.per_sample)
- ``ocs_scores``, ``ocs_select``: Online Coreset Selection from Gram products (kernels.coreset)
- ``RotaryEmbedding``, ``rope_attention``, ``RopeSelfAttention``: cached RoPE + SDPA (kernels.rope,
  kernels.attention)
- ``topk_singular_values``, ``spectral_features``: randomized top-k singular values with an error
  bound, and the spectral probe's 32 features per matrix (kernels.spectral)
- ``Standardizer``: scikit-learn StandardScaler semantics on any device (kernels.standardize)
- ``FeatureCache``: tensors computed once per input, safetensors on disk (kernels.feature_cache)
- ``adamw``, ``sgd``: torch optimizers with the implementation that measured fastest (kernels.optim)
- ``Recipe``, ``train``, ``save_checkpoint``, ``load_checkpoint``: the shared training-loop engine
  and its checkpoints (kernels.training)
- ``deterministic``, ``seed_worker``: one switch for reproducible runs, and the DataLoader
  worker seeding that goes with it (kernels.determinism)
- ``darts_hypergradient``, ``reweighted_loss``: the finite-difference hypergradient of one
  unrolled inner step, and Meta-Weight-Net's weighted loss (kernels.hypergrad)
- ``models``: model definitions shared by kernels, references and workloads

The import name ``kernels`` is also that of Hugging Face's ``kernels`` distribution: installed in
one environment, the two overwrite each other's files (pip does not detect it), so importing this
package warns when that distribution is present (``KernelsConflictWarning``). Use a separate
environment for one of them.
"""

from __future__ import annotations

import importlib
import warnings
from importlib import metadata
from typing import Any

OWN_DISTRIBUTION = "kernelgate"
CONFLICTING_DISTRIBUTION = "kernels"  # Hugging Face's hub-kernel loader


class KernelsConflictWarning(UserWarning):
    """Another distribution installs the import package ``kernels`` into this environment."""


def _check_conflict() -> None:
    """Warn when Hugging Face's ``kernels`` is installed beside kernelgate: one of the two has
    overwritten the other's files, whichever was installed last."""
    try:
        other = metadata.distribution(CONFLICTING_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return
    summary = other.metadata.get("Summary") or "Hugging Face kernels"
    warnings.warn(
        f"the '{CONFLICTING_DISTRIBUTION}' distribution ({summary}, "
        f"version {other.version}) is installed in this environment beside {OWN_DISTRIBUTION}: both install the "
        "import package 'kernels', so whichever was installed last has overwritten the other's files and neither "
        f"is reliable here. Install {OWN_DISTRIBUTION} and '{CONFLICTING_DISTRIBUTION}' in separate virtual "
        f"environments (or `pip uninstall {CONFLICTING_DISTRIBUTION}` and reinstall {OWN_DISTRIBUTION}).",
        KernelsConflictWarning, stacklevel=2)


_check_conflict()

_EXPORTS = {
    "adamw": "kernels.optim",
    "sgd": "kernels.optim",
    "Recipe": "kernels.training",
    "train": "kernels.training",
    "save_checkpoint": "kernels.training",
    "load_checkpoint": "kernels.training",
    "deterministic": "kernels.determinism",
    "seed_worker": "kernels.determinism",
    "darts_hypergradient": "kernels.hypergrad",
    "reweighted_loss": "kernels.hypergrad",
    "per_sample_grads": "kernels.per_sample",
    "per_sample_grad_gram": "kernels.per_sample",
    "per_sample_grad_norms": "kernels.per_sample",
    "RotaryEmbedding": "kernels.rope",
    "rope_attention": "kernels.attention",
    "RopeSelfAttention": "kernels.attention",
    "topk_singular_values": "kernels.spectral",
    "spectral_features": "kernels.spectral",
    "Standardizer": "kernels.standardize",
    "FeatureCache": "kernels.feature_cache",
    "ocs_scores": "kernels.coreset",
    "ocs_select": "kernels.coreset",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
