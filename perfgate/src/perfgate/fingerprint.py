"""Machine fingerprint: baselines are only comparable between machines with the same one."""

from __future__ import annotations

import os
import platform
import re


def _cpuinfo_first() -> dict[str, str]:
    """The fields /proc/cpuinfo gives for its first processor ({} off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf8") as fh:
            for line in fh:
                if not line.strip():
                    break  # first processor only
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def bf16_instructions() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16): without them bf16
    autocast is converted in software, and a floor set on a bf16 recipe does not hold."""
    return bool({"avx512_bf16", "amx_bf16"} & set(_cpuinfo_first().get("flags", "").split()))


def _cpu_model() -> str:
    """Model name plus family/model/stepping: hypervisors often show only "AMD EPYC"."""
    fields = _cpuinfo_first()
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = [f"{k.split()[-1]} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields]
    return f"{name} ({', '.join(ids)})" if ids else name


def fingerprint(device: str, threads: int | None, malloc: str) -> dict[str, str | int | None]:
    """The facts that make timings comparable: device model, threads, torch/CUDA, Python, and
    on CPU how memory is allocated (``--perf-malloc``; torch's THP_MEM_ALLOC_ENABLE). Without
    torch installed, ``threads`` and ``torch`` are None."""
    from .timing import torch_or_none

    torch = torch_or_none()
    is_cuda = device.startswith("cuda")
    return {
        "device_type": "cuda" if is_cuda else "cpu",
        "device_name": torch.cuda.get_device_name(device) if is_cuda else _cpu_model(),
        "threads": threads,
        "torch": None if torch is None else torch.__version__,
        "cuda": torch.version.cuda if is_cuda else None,
        "python": ".".join(platform.python_version_tuple()[:2]),
        # Huge pages for torch's CPU allocator change fresh-allocation cost several-fold.
        "malloc": malloc,
        "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and not is_cuda,
    }


def slug(fp: dict[str, str | int | None]) -> str:
    """A folder name for a fingerprint, e.g. ``cpu-AMD_EPYC-t2-torch2.14.1-py3.11``."""
    parts = [fp["device_type"], fp["device_name"]]
    parts += [f"t{fp['threads']}"] if fp.get("threads") is not None else []
    parts += [f"torch{fp['torch']}"] if fp.get("torch") is not None else []
    if fp.get("cuda"):
        parts.append(f"cuda{fp['cuda']}")
    parts.append(f"py{fp['python']}")
    if fp.get("malloc") not in (None, "n/a"):
        parts.append(f"malloc_{fp['malloc']}")
    if fp.get("thp_alloc"):
        parts.append("thp")
    return "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", str(p)).strip("_") for p in parts)
