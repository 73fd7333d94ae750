"""The slow, obviously correct side: same names and signatures as ``kernels``."""

from reference.attention import RopeSelfAttention, rope_attention
from reference.coreset import ocs_scores, ocs_select
from reference.optim import adamw, sgd
from reference.per_sample import per_sample_grad_gram, per_sample_grad_norms, per_sample_grads
from reference.rope import RotaryEmbedding
from reference.spectral import spectral_features, topk_singular_values
from reference.standardize import Standardizer

__all__ = ["RopeSelfAttention", "RotaryEmbedding", "Standardizer", "adamw", "ocs_scores", "ocs_select",
           "per_sample_grad_gram", "per_sample_grad_norms", "per_sample_grads", "rope_attention", "sgd",
           "spectral_features", "topk_singular_values"]
