"""Reference standardization: scikit-learn's StandardScaler on the CPU, in numpy. Its inputs are
the kernel's valid ones: on bad input it does what scikit-learn does (NaN skipped in fit and kept
by transform, inf refused), where kernels.standardize refuses NaN too; not differentiable.
Half-precision inputs (bfloat16, which numpy lacks, and float16) are computed in float64 and
transformed back to their dtype."""

from __future__ import annotations

import torch
from torch import Tensor

HALF = (torch.bfloat16, torch.float16)  # computed in float64: numpy has no bfloat16


class Standardizer:
    """The kernel's API over ``sklearn.preprocessing.StandardScaler`` (tensors in, tensors out)."""

    def __init__(self) -> None:
        # imported here: every process that imports ``reference`` would load scikit-learn (~1 s)
        from sklearn.preprocessing import StandardScaler

        self._scaler = StandardScaler()

    def __getattr__(self, name: str):  # mean_, var_, scale_, n_samples_seen_ as tensors/ints
        if name.endswith("_") and not name.startswith("_"):
            value = getattr(self._scaler, name)
            return torch.from_numpy(value) if hasattr(value, "shape") and value.shape else int(value)
        raise AttributeError(name)

    def fit(self, X: Tensor) -> Standardizer:
        self._scaler.fit(_numpy(X))
        return self

    def partial_fit(self, X: Tensor) -> Standardizer:
        self._scaler.partial_fit(_numpy(X))
        return self

    def transform(self, X: Tensor) -> Tensor:
        return torch.from_numpy(self._scaler.transform(_numpy(X))).to(X.device, _dtype(X))

    def inverse_transform(self, X: Tensor) -> Tensor:
        return torch.from_numpy(self._scaler.inverse_transform(_numpy(X))).to(X.device, _dtype(X))

    def fit_transform(self, X: Tensor) -> Tensor:
        return self.fit(X).transform(X)


def _numpy(X: Tensor):
    """X as a numpy array scikit-learn reads: half precision in float64."""
    X = X.detach().cpu()
    return (X.double() if X.dtype in HALF else X).numpy()


def _dtype(X: Tensor) -> torch.dtype | None:
    """The dtype a transform returns: X's where half precision, else scikit-learn's."""
    return X.dtype if X.dtype in HALF else None
