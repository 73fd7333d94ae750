"""The slow, obviously correct side: same names and signatures as ``kernels``."""

from reference.optim import adamw, sgd
from reference.per_sample import per_sample_grad_gram, per_sample_grad_norms, per_sample_grads

__all__ = ["adamw", "per_sample_grad_gram", "per_sample_grad_norms", "per_sample_grads", "sgd"]
