"""pytester's inline runs unload the modules first imported inside them, and a C extension
(torch, numpy.fft, matplotlib's) cannot load twice in one process: import them once here."""

import contextlib

import matplotlib.pyplot  # noqa: F401
import numpy  # noqa: F401
import scipy.stats  # noqa: F401

with contextlib.suppress(ImportError):  # perfgate runs without torch; where it is installed, load it once
    import torch  # noqa: F401
