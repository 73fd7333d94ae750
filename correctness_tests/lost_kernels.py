"""A pytest plugin (``-p correctness_tests.lost_kernels``) that replaces three kernels by their
references' algorithms when it is imported, before any perf test imports them: what the gate must
catch as a lost kernel (``test_perfgate_suite.py``, ``python -m perfgate.fidelity --lost``)."""

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
for module, name, slow in LOST:
    setattr(module, name, slow)
    setattr(kernels, name, slow)
