"""The Standardizer's C passes (kernels/_standardize.c) built for AVX2 + FMA only, against its torch
ops, interleaved in one process: a stand-in for a CPU without AVX-512 (Zen 3), whose build runs
the AVX2 clone of the passes.

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m evidence.standardize_avx2

(torch's own kernels held to AVX2 as well). The source is compiled into a temporary folder with
the `CLONES` attribute dropped and `-mavx2 -mfma`, so no AVX-512 instruction is in it (checked
with objdump where there is one); fit + transform of 10000 x 512 fp32, 2 and 1 threads, torch
ops / C as point (95% CI) and the two medians of 15 interleaved ABBA pairs (evidence/ab.py).
"""

import importlib.util
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from unittest import mock

import torch

from evidence.ab import versus
from kernels import standardize
from kernels.standardize import Standardizer
from perfgate.fingerprint import _cpu_model
from perfgate.timing import timer_for

root = Path(__file__).resolve().parent.parent
build = Path(tempfile.mkdtemp())
source = (root / "kernels" / "_standardize.c").read_text().replace('#include "_clones.h"', "#define CLONES")
(build / "std_avx2.c").write_text(source)
library = build / "_standardize.so"
headers = f"-I{sysconfig.get_paths()['include']}"
subprocess.run(["cc", "-O3", "-fopenmp", "-mavx2", "-mfma", "-fPIC", "-shared", headers, str(build / "std_avx2.c"),
                "-o", str(library)], check=True)
if shutil.which("objdump"):
    assert "zmm" not in subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True).stdout
spec = importlib.util.spec_from_file_location("_standardize", library)
avx2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(avx2)

timer = timer_for("cpu")
print(f"{_cpu_model()}, torch {torch.__version__} (its kernels: {torch.backends.cpu.get_cpu_capability()}), "
      "the C passes built for AVX2 + FMA only; glibc's default malloc")
x = 5.0 + 3.0 * torch.randn(10_000, 512, generator=torch.Generator().manual_seed(0))


def with_c(module):
    def run() -> torch.Tensor:
        with mock.patch.object(standardize, "_c", module):
            return Standardizer().fit(x).transform(x)

    return run


torch_ops, c_avx2, c_installed = with_c(None), with_c(avx2), with_c(standardize._c)
torch.testing.assert_close(c_avx2(), torch_ops())
for threads in (2, 1):
    torch.set_num_threads(threads)
    print(f"{threads} thread(s), fit + transform 10000 x 512 fp32, torch ops / AVX2 C: "
          f"{versus(timer, torch_ops, c_avx2)}; torch ops / the installed C (its widest clone): "
          f"{versus(timer, torch_ops, c_installed)}", flush=True)
shutil.rmtree(build)
