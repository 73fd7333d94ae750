"""What the kernels read of the CPU they run on, for the choices measured per CPU (kernels.attention)."""

from __future__ import annotations

import functools

CPUINFO = "/proc/cpuinfo"


@functools.cache
def vendor() -> str:
    """The first processor's ``vendor_id`` in Linux's /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"),
    "" where there is none (another OS, another architecture)."""
    try:
        with open(CPUINFO, encoding="utf8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
                if not line.strip():  # the first processor's fields end at a blank line
                    break
    except OSError:
        pass
    return ""
