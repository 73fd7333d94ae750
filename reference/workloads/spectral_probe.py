"""Reference run of the spectral-probe workload: exact singular values (torch.linalg.svdvals,
reference.spectral), scikit-learn's StandardScaler (reference.standardize), fp32, the plain loop
over batches of 64."""

from __future__ import annotations

from reference.spectral import spectral_features as features
from reference.standardize import Standardizer as scaler
from reference.training import train

NAME = "reference (svdvals, sklearn, fp32, batch 64)"
BATCH = 64
__all__ = ["BATCH", "NAME", "features", "scaler", "train"]
