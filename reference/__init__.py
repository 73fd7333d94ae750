"""The slow, obviously correct side: same names and signatures as ``kernels``."""

from reference.coreset import ocs_scores, ocs_select
from reference.optim import adamw, sgd
from reference.per_sample import per_sample_grad_gram, per_sample_grad_norms, per_sample_grads

__all__ = ["adamw", "ocs_scores", "ocs_select", "per_sample_grad_gram", "per_sample_grad_norms",
           "per_sample_grads", "sgd"]
