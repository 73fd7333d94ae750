"""kernels.cpu: the vendor read from /proc/cpuinfo, on which kernels.attention's path lengths depend, and the
hypervisor flag, on which kernels.hugepages' prefault does."""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from unittest import mock

import pytest

from kernels import cpu

FIRST = ("processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\nflags\t\t: {flags}\n\n"
         "processor\t: 1\nvendor_id\t: Other\nflags\t\t: fpu hypervisor\n")


@pytest.fixture
def cpuinfo(tmp_path: Path):
    """Write a /proc/cpuinfo of one's own; kernels.cpu reads it afresh (its cache cleared around)."""
    path = tmp_path / "cpuinfo"

    def write(text: str | None) -> None:
        if text is not None:
            path.write_text(text, encoding="utf8")
        cpu.first_processor.cache_clear()

    with mock.patch.object(cpu, "CPUINFO", str(path)):
        yield write
    cpu.first_processor.cache_clear()


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_the_vendor_is_the_first_processors(cpuinfo, vendor: str) -> None:
    cpuinfo(FIRST.format(vendor=vendor, flags="fpu avx2"))
    assert cpu.vendor() == vendor


def test_virtual_is_the_first_processors_hypervisor_flag(cpuinfo) -> None:
    cpuinfo(FIRST.format(vendor="AuthenticAMD", flags="fpu hypervisor avx2"))
    assert cpu.virtual()
    cpuinfo(FIRST.format(vendor="AuthenticAMD", flags="fpu avx2 hypervisor_lite"))  # a flag, not a substring
    assert not cpu.virtual()


def test_no_vendor_where_cpuinfo_names_none(cpuinfo) -> None:
    """An arm64 cpuinfo (no vendor_id: its first processor's fields end at the blank line), and none at all."""
    cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n\n"
            "vendor_id\t: Late\nflags\t: hypervisor\n")
    assert cpu.vendor() == "" and not cpu.virtual()
    cpuinfo(None)  # the file was never written: another OS
    assert cpu.vendor() == "" and not cpu.virtual()


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="/proc/cpuinfo names a vendor on x86-64 Linux only")
def test_this_x86_linux_names_its_vendor() -> None:
    assert cpu.vendor()
