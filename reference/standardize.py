"""Reference standardization: scikit-learn's StandardScaler on the CPU, in numpy. Its inputs are
the kernel's valid ones: on bad input it does what scikit-learn does (NaN skipped in fit and kept
by transform, inf refused), where kernels.standardize refuses NaN too; not differentiable."""

from __future__ import annotations

import torch
from torch import Tensor


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
        self._scaler.fit(X.detach().cpu().numpy())
        return self

    def partial_fit(self, X: Tensor) -> Standardizer:
        self._scaler.partial_fit(X.detach().cpu().numpy())
        return self

    def transform(self, X: Tensor) -> Tensor:
        return torch.from_numpy(self._scaler.transform(X.detach().cpu().numpy())).to(X.device)

    def inverse_transform(self, X: Tensor) -> Tensor:
        return torch.from_numpy(self._scaler.inverse_transform(X.detach().cpu().numpy())).to(X.device)

    def fit_transform(self, X: Tensor) -> Tensor:
        return self.fit(X).transform(X)
