"""What the kernels read of the CPU they run on, for the choices measured per CPU: its vendor
(kernels.attention's path lengths) and whether it runs under a hypervisor (kernels.hugepages)."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping

CPUINFO = "/proc/cpuinfo"


@functools.cache
def first_processor() -> Mapping[str, str]:
    """The first processor's fields in Linux's /proc/cpuinfo (read-only: the one cached copy), empty
    where there is none (another OS)."""
    fields: dict[str, str] = {}
    try:
        with open(CPUINFO, encoding="utf8") as f:
            for line in f:
                if not line.strip():  # the first processor's fields end at a blank line
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return types.MappingProxyType(fields)


def vendor() -> str:
    """The first processor's ``vendor_id`` ("AuthenticAMD", "GenuineIntel"), "" where cpuinfo names
    none (another OS, another architecture)."""
    return first_processor().get("vendor_id", "")


def virtual() -> bool:
    """Whether the CPU says it runs under a hypervisor (x86's ``hypervisor`` flag); False where
    cpuinfo does not say (another OS, another architecture)."""
    return "hypervisor" in first_processor().get("flags", "").split()
