"""For tests that run perf sessions inline (pytester's ``runpytest_inprocess``): pytester unloads,
at the end of each test, the modules first imported inside its sessions, and a C extension
(numpy.fft, which scipy.stats loads; matplotlib's) or an op library torch registers cannot load
twice in one process. ``preload()`` imports them once in the calling process, with perfgate's
lazily imported modules (a session would otherwise import and assertion-rewrite them anew, 2-5 s)."""

from __future__ import annotations

import contextlib


def preload() -> None:
    """Import what a perf session loads lazily; with torch, count one call's work, which loads
    torch.utils.flop_counter and, through it, dynamo and inductor modules (one registers an op
    library). Call it outside pytester's tests (at import, or from a session-scoped fixture):
    what a test imports first, pytester unloads at its end."""
    import numpy  # noqa: F401
    import scipy.stats  # noqa: F401

    with contextlib.suppress(ImportError):  # the charts extra
        import matplotlib.pyplot  # noqa: F401

    from . import case, floors, roofline, state, timing  # noqa: F401

    with contextlib.suppress(ImportError):  # perfgate runs without torch; where it is installed, load it once
        import torch

        roofline.count_work(lambda: torch.ones(2) @ torch.ones(2))
        timing.RoundTrip.open(2)  # the placement probe, perfgate's own C extension (where built)
