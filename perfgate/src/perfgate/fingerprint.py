"""Machine fingerprint: baselines are only comparable between machines with the same one."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from collections.abc import Callable


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


# nvidia-smi's names for what a GPU's timings depend on beyond its model (--query-gpu)
SMI_FIELDS = {"driver": "driver_version", "mig": "mig.mode.current",
              "app_clock_mhz": "clocks.applications.graphics", "power_limit_w": "power.limit"}


def _run_smi(args: list[str], attempts: int = 2) -> str | None:
    """nvidia-smi's output; None where there is no nvidia-smi (its facts then read None on every
    run alike). One that is there but fails or hangs on every attempt raises: its facts would read
    None this time only, and the fingerprint's folder change with them, so the stored baseline
    would go unfound and the session pass ungated."""
    why = ""
    for _ in range(attempts):
        try:
            out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=False)
        except FileNotFoundError:
            return None
        except (OSError, subprocess.SubprocessError) as e:
            why = f"{type(e).__name__}: {e}"
            continue
        if out.returncode == 0:
            return out.stdout
        why = f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    raise RuntimeError(f"nvidia-smi is installed but failed {attempts} times ({why}): this GPU's fingerprint "
                       "(driver, MIG, clocks, power limit) cannot be read, and without it the session would not "
                       "find this machine's baselines; rerun once nvidia-smi answers")


def smi_facts(uuid: str, run: Callable[[list[str]], str | None] = _run_smi) -> dict[str, str | None]:
    """Driver, MIG mode, application clock and power limit of the GPU with ``uuid`` (torch's
    ``get_device_properties().uuid``), from nvidia-smi; None for what it cannot read. A MIG slice
    has its own uuid: on a host with one physical GPU the slice's parent is that GPU."""
    unknown = dict.fromkeys(SMI_FIELDS)
    text = run([f"--query-gpu=uuid,{','.join(SMI_FIELDS.values())}", "--format=csv,noheader,nounits"])
    rows = [[v.strip() for v in line.split(",")] for line in (text or "").splitlines() if line.strip()]
    rows = [r for r in rows if len(r) == 1 + len(SMI_FIELDS)]
    mine = [r for r in rows if r[0].removeprefix("GPU-") == uuid.removeprefix("GPU-")]
    row = mine[0] if mine else (rows[0] if len(rows) == 1 else None)
    if row is None:
        return unknown
    readable = lambda v: None if v.strip("[]") in ("N/A", "Not Supported", "Unknown Error", "") else v
    return {key: readable(value) for key, value in zip(SMI_FIELDS, row[1:], strict=True)}


def gpu_facts(device: str) -> dict[str, str | int | bool | None]:
    """What a CUDA timing depends on beyond the GPU's name and the CUDA version: the driver, MIG
    mode, clocks (the SM's maximum, the application clock) and power limit, SMs and L2, cuDNN,
    and whether fp32 matmuls and convolutions may run as TF32 (a several-fold difference)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return {
        **smi_facts(str(props.uuid)),
        "max_clock_mhz": props.clock_rate // 1000,
        "memory_clock_mhz": props.memory_clock_rate // 1000,
        "sms": props.multi_processor_count,
        "l2_mib": round(props.L2_cache_size / 2**20, 1),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cudnn": torch.backends.cudnn.version(),
        "fp32_matmul": torch.get_float32_matmul_precision(),
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }


def fingerprint(device: str, threads: int | None, malloc: str, *, l2_flush: bool = False,
                gpu: dict | None = None) -> dict:
    """The facts that make timings comparable: device model, threads, torch/CUDA, Python, and
    on CPU how memory is allocated (``--perf-malloc``; torch's THP_MEM_ALLOC_ENABLE); on CUDA the
    GPU's facts (``gpu_facts``, or ``gpu`` when given) and whether the L2 is flushed before each
    timed call. Without torch installed, ``threads`` and ``torch`` are None."""
    from .timing import torch_or_none

    torch = torch_or_none()
    is_cuda = device.startswith("cuda")
    fp = {
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
    if is_cuda:  # CPU fingerprints keep their keys: stored CPU baselines stay comparable
        fp["gpu"] = gpu_facts(device) if gpu is None else gpu
        fp["l2_flush"] = l2_flush
    return fp


def slug(fp: dict) -> str:
    """A folder name for a fingerprint, e.g. ``cpu-AMD_EPYC-t2-torch2.14.1-py3.11`` or
    ``cuda-NVIDIA_H100_80GB_HBM3-t16-torch2.14.1-cuda12.8-drv570.86.15-py3.11-fp1a2b3c4d`` (on CUDA a
    digest of the whole fingerprint ends it: GPUs of one name differ in MIG, clocks, TF32)."""
    parts = [fp["device_type"], fp["device_name"]]
    parts += [f"t{fp['threads']}"] if fp.get("threads") is not None else []
    parts += [f"torch{fp['torch']}"] if fp.get("torch") is not None else []
    if fp.get("cuda"):
        parts.append(f"cuda{fp['cuda']}")
    driver = (fp.get("gpu") or {}).get("driver")
    parts += [f"drv{driver}"] if driver else []
    parts.append(f"py{fp['python']}")
    if fp.get("malloc") not in (None, "n/a"):
        parts.append(f"malloc_{fp['malloc']}")
    if fp.get("thp_alloc"):
        parts.append("thp")
    if fp.get("l2_flush"):
        parts.append("l2flush")
    if fp.get("gpu") is not None:  # MIG, clocks, power, TF32 differ within one GPU name: one folder each
        parts.append("fp" + hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:8])
    return "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", str(p)).strip("_") for p in parts)
