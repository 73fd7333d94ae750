"""Stored runs: the one reader of a perfgate run's JSON (a saved baseline, a ``--benchmark-json``
file, a shard) and the one check of its shape, for the session's baseline folder, the shard
weights, the report and the merge. Plain JSON only, never pickle."""

from __future__ import annotations

import json
import math
from pathlib import Path

JSON_KEY = "perfgate"  # perfgate's section in pytest-benchmark's JSON and its machine_info

SECTION_FIELDS = {"fingerprint": dict, "slug": str, "size": str, "speedups": list}
ROW_FIELDS = {"kernel": str, "impl": str, "size": str, "speedup": (int, float)}


class BadRun(ValueError):
    """A stored run that cannot be read, or is not a whole perfgate run; the message names the file."""


def problem(data: object) -> str | None:
    """Why ``data`` (a parsed JSON) is not a whole perfgate run, or None when it is one."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if not isinstance(data.get("benchmarks"), list):
        return "no 'benchmarks' list: not a pytest-benchmark JSON"
    section = data.get(JSON_KEY)
    if not isinstance(section, dict):
        return f"no '{JSON_KEY}' section: not written by the perfgate plugin"
    for key, kind in SECTION_FIELDS.items():
        if not isinstance(section.get(key), kind):
            return f"its '{JSON_KEY}' section has no valid {key!r} (a {kind.__name__})"
    if section.get("interrupted"):
        return "saved by an interrupted session (Ctrl-C): its rows are partial"
    if not isinstance((data.get("machine_info") or {}).get(JSON_KEY), dict):
        return f"machine_info has no '{JSON_KEY}' fingerprint"
    for i, row in enumerate(section["speedups"]):
        if not isinstance(row, dict):
            return f"speedup row {i} is not an object"
        for key, kind in ROW_FIELDS.items():
            value = row.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                return f"speedup row {i} has no valid {key!r}"
        if not math.isfinite(row["speedup"]) or row["speedup"] <= 0:
            return f"speedup row {i} ({row['kernel']} [{row['impl']}]) has speedup {row['speedup']!r}"
    return None


def read_run(path: Path) -> dict:
    """The run stored at ``path`` (with ``_path`` set), or BadRun saying what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BadRun(f"{path}: not readable as JSON ({exc})") from exc
    why = problem(data)
    if why is not None:
        raise BadRun(f"{path}: {why}")
    data["_path"] = str(path)
    return data
