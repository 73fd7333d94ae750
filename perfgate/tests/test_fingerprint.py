"""perfgate.fingerprint without the machine: the CPU's facts read from a canned /proc/cpuinfo, a
fingerprint's keys, and the folder name a stored baseline is found by. (The GPU's facts, read from
canned nvidia-smi output, are checked in test_timing.py.)"""

from __future__ import annotations

import io
import subprocess

import pytest

import perfgate.fingerprint as fingerprint_module
from perfgate.fingerprint import _cpu_model, _run_smi, bf16_instructions, fingerprint, slug

# two processors of a CPU whose first reads as a hypervisor shows it; the second differs only to
# tell which one was read
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx2 avx512f

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
"""


def _cpuinfo(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """/proc/cpuinfo, as fingerprint.py opens it, reads ``text``."""
    monkeypatch.setattr(fingerprint_module, "open", lambda path, encoding: io.StringIO(text), raising=False)


def test_the_cpu_is_named_by_its_first_processor_with_family_model_and_stepping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _cpuinfo(monkeypatch, CPUINFO)
    assert _cpu_model() == "AMD EPYC (family 25, model 1, stepping 1)"
    assert not bf16_instructions()  # the first processor's flags: no avx512_bf16 or amx_bf16
    _cpuinfo(monkeypatch, "model name\t: Some CPU\nflags\t\t: sse2 amx_bf16\n")
    assert _cpu_model() == "Some CPU" and bf16_instructions()  # no ids: the name alone


def test_a_cpu_fingerprints_folder_name_is_the_stored_baselines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed baselines' folder names (.benchmarks/cpu-AMD_EPYC_family_25_model_1_...) are
    slugs: a slug spelled otherwise finds none of them."""
    fp = {"device_type": "cpu", "device_name": "AMD EPYC (family 25, model 1, stepping 1)", "threads": 2,
          "torch": "2.14.1+cu130", "cuda": None, "python": "3.11", "malloc": "cache", "thp_alloc": False}
    assert slug(fp) == "cpu-AMD_EPYC_family_25_model_1_stepping_1-t2-torch2.14.1_cu130-py3.11-malloc_cache"
    assert slug({**fp, "threads": None, "malloc": "n/a", "thp_alloc": True}) == (
        "cpu-AMD_EPYC_family_25_model_1_stepping_1-torch2.14.1_cu130-py3.11-thp")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    cpu = fingerprint("cpu", 2, "cache")
    assert cpu["thp_alloc"] is True and cpu["python"].count(".") == 1  # 3.11: a patch release keeps the folder


def test_huge_pages_for_torchs_cpu_allocator_are_no_fact_of_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fp = fingerprint("cuda", 16, "n/a", gpu={"driver": "570.86.15"})
    assert fp["thp_alloc"] is False and "thp" not in slug(fp).split("-")


def test_an_nvidia_smi_that_answers_nothing_has_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 0 with no output (no GPU listed) is its answer, read as unknown facts: no retry, no error."""
    calls = []

    def empty(*args: object, **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", empty)
    assert _run_smi(["-L"]) == "" and len(calls) == 1
