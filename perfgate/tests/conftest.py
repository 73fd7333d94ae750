"""pytester's inline runs unload the modules first imported inside them, and a C extension
(torch, numpy.fft, matplotlib's) cannot load twice in one process: import them once here. The
same holds for what each inline session would otherwise import, assertion-rewrite and unload
again: perfgate's lazily imported modules (a session cost 2-5 s of rewriting before)."""

import contextlib
import copy
import functools

import matplotlib.pyplot  # noqa: F401
import numpy  # noqa: F401
import pytest
import scipy.stats  # noqa: F401

import perfgate.case  # noqa: F401
import perfgate.floors  # noqa: F401
import perfgate.roofline  # noqa: F401
import perfgate.state  # noqa: F401
import perfgate.timing  # noqa: F401

with contextlib.suppress(ImportError):  # perfgate runs without torch; where it is installed, load it once
    import torch  # noqa: F401

    # the roofline's count loads torch.utils.flop_counter and, through it, dynamo and inductor
    # modules, one of which registers an op library: a second load fails. Count once here.
    perfgate.roofline.count_work(lambda: torch.ones(2) @ torch.ones(2))

# pytest-benchmark reads the CPU with py-cpuinfo, which runs CPUID in a fresh Python process (0.2 s)
# in every session that saves a run or writes JSON: one reading serves this process's sessions.
with contextlib.suppress(ImportError):
    import cpuinfo

    _cpu_info = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(_cpu_info())



@pytest.fixture
def pytester(pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester whose sessions (inline or in a fresh process) run without hypothesis's plugin: they
    hold no hypothesis test, and the plugin imports hypothesis in each fresh process (0.75 s)."""
    pytester.plugins.append("no:hypothesispytest")
    return pytester
