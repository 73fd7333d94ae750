"""The library's C parts (kernels/_nontemporal.c, kernels/_rope.c, kernels/_softmax.c,
kernels/_standardize.c): each is built where there is a compiler, and its threads are torch's
OpenMP team."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from perfgate.timing import openmp_runtime, torch_openmp_runtime

MODULES = ["kernels._nontemporal", "kernels._rope", "kernels._softmax", "kernels._standardize"]


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@pytest.mark.parametrize("name", MODULES)
def test_the_c_part_is_built_where_there_is_a_compiler(name: str) -> None:
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    if not sys.platform.startswith("linux") or shutil.which("cc") is None or not headers:
        pytest.skip("no C compiler or no Python headers on this Linux: the install may leave the C part out")
    source = name.replace(".", "/") + ".c"
    assert _module(name) is not None, f"make install (pip install -e .) should have compiled {source} in place"


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loader's dlsym and dladdr")
def test_the_c_parts_threads_are_torchs_openmp_team(name: str) -> None:
    # the module's OpenMP calls resolve to torch's runtime: its team is torch's intra-op pool, not a
    # second pool whose threads contend with torch's spinning workers for the same cores (a process
    # may hold other runtimes: scikit-learn brings a libgomp of its own, under another name)
    module = _module(name)
    if module is None:
        pytest.skip(f"{name} is not built (no C compiler at install)")
    runtime = openmp_runtime(module.__file__)
    assert runtime is not None, "built without -fopenmp (pyproject.toml)"
    assert runtime == torch_openmp_runtime(), runtime


# The parts whose results are the same bits on every x86-64 CPU: kernels/_rope.c rounds as torch's
# complex multiply, kernels/_standardize.c's statistics are one computation whatever clone the loader
# picks. A fused multiply-add (the AVX-512 clone's, where -ffp-contract=off is missing) rounds once
# where the other clones round twice.
@pytest.mark.parametrize("name", ["kernels._rope", "kernels._standardize"])
def test_the_same_bits_parts_fuse_no_multiply_add(name: str) -> None:
    module = _module(name)
    if module is None:
        pytest.skip(f"{name} is not built (no C compiler at install)")
    if shutil.which("objdump") is None or not sys.platform.startswith("linux"):
        pytest.skip("no objdump to read the machine code with")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", module.__file__], capture_output=True,
                          text=True, check=True).stdout
    fused = sorted({line.split()[1] for line in code.splitlines()
                    if re.search(r"\tv?f(n?)m(add|sub)\w*\s", line)})
    assert not fused, f"{name} has fused multiply-adds {fused}: build it with -ffp-contract=off (pyproject.toml)"
