"""Machine fingerprint: baselines are only comparable between machines with the same one."""

from __future__ import annotations

import platform
import re


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(device: str, threads: int, thp_alloc: bool) -> dict[str, str | int | None]:
    """The facts that make timings comparable: device model, threads, torch/CUDA, Python, and
    whether torch's CPU allocator uses transparent huge pages (THP_MEM_ALLOC_ENABLE=1)."""
    import torch

    is_cuda = device.startswith("cuda")
    return {
        "device_type": "cuda" if is_cuda else "cpu",
        "device_name": torch.cuda.get_device_name(device) if is_cuda else _cpu_model(),
        "threads": threads,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if is_cuda else None,
        "python": ".".join(platform.python_version_tuple()[:2]),
        # Huge pages for torch's CPU allocator change fresh-allocation cost several-fold.
        "thp_alloc": thp_alloc and not is_cuda,
    }


def slug(fp: dict[str, str | int | None]) -> str:
    """A folder name for a fingerprint, e.g. ``cpu-AMD_EPYC-t2-torch2.14.1-py3.11``."""
    parts = [fp["device_type"], fp["device_name"], f"t{fp['threads']}", f"torch{fp['torch']}"]
    if fp.get("cuda"):
        parts.append(f"cuda{fp['cuda']}")
    parts.append(f"py{fp['python']}")
    if fp.get("thp_alloc"):
        parts.append("thp")
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", "-".join(str(p) for p in parts).replace("+", "_"))
