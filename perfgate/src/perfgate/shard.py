"""The perf suite over N runners of one kind: ``--perf-shard K/N`` runs one shard, and
``python -m perfgate.report --merge shard*.json`` makes the shards one table and one verdict.

A shard's unit is a test function with all its parametrizations: a speedup row pairs the impls
of one test inside one session (reference, optimized, a peer), so they cannot run on different
runners. pytest-split splits parametrizations of one test apart and can leave a split empty
(its issues #95, #108), hence a split of perfgate's own. Units go to shards by longest
processing time first (each unit, heaviest first, to the lightest shard so far), weighted by the
seconds it took, setup to teardown, in this fingerprint's newest stored run (in a run saved
before perfgate recorded them: its benchmarks' timed rounds; equal weights when there is no run).
The later visits and extensions at a session's end are not in a unit's seconds. Every shard
computes the same plan from the same collection and stored run; its digest goes into the
shard's JSON, and the merge refuses shards of different plans, fingerprints, sizes, commits,
baselines or ``--perf-require-floors``, and a missing or repeated shard. Runners of one kind
must be alike in what the fingerprint records (GPU or CPU model, torch's threads, torch and
CUDA builds).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from statistics import median

from .stored import read_run

# What all shards of one merge must share, beyond the plan: a row is comparable only under these.
SHARED = ("fingerprint", "size", "tolerance", "contended", "floors_applied", "floors_off", "require_floors",
          "baseline")


class MergeError(ValueError):
    """Shards that cannot be merged into one verdict."""


def parse(value: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 1 <= K <= N."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"--perf-shard must be K/N with 1 <= K <= N (e.g. 1/2), got {value!r}")
    return int(match[1]), int(match[2])


def unit(nodeid: str) -> str:
    """The test function a collected item belongs to: its node id without the parameters."""
    return nodeid.split("[", 1)[0]


def stored_weights(folder: Path | None, section_key: str) -> tuple[dict[str, float], str | None]:
    """({unit: seconds}, the run's file name) from the newest stored run in ``folder`` (a
    fingerprint's and size's storage folder), or ({}, None) when there is none: each test
    function's seconds from setup to teardown as perfgate's section (``section_key``) records
    them, or in a run saved without them, the seconds of its benchmarks' timed rounds."""
    runs = sorted(folder.glob("*/*.json")) if folder is not None and folder.is_dir() else []
    if not runs:
        return {}, None
    newest = max(runs, key=lambda p: p.name)  # pytest-benchmark numbers its saves: 0001_..., 0002_...
    data = read_run(newest)  # BadRun when it is not a whole run: the caller names it
    if data.get(section_key, {}).get("durations"):
        return dict(data[section_key]["durations"]), newest.name
    weights: dict[str, float] = {}  # a run saved before perfgate recorded durations: the timed rounds
    for bench in data.get("benchmarks", []):
        name = unit(bench.get("fullname", ""))
        weights[name] = weights.get(name, 0.0) + float(bench.get("stats", {}).get("total", 0.0))
    return weights, newest.name


def plan(units: list[str], weights: dict[str, float], count: int) -> dict[str, int]:
    """{unit: shard 1..count}, longest processing time first; a unit the stored run lacks
    weighs the median known weight (1.0 when none is known). Ties break by name."""
    if len(units) < count:
        raise ValueError(f"--perf-shard over {count} shards: the selection has {len(units)} test function(s), "
                         "and a shard without tests would end its runner with pytest's 'no tests collected'; "
                         f"use at most {len(units)} shards")
    known = [weights[u] for u in units if u in weights]
    default = median(known) if known else 1.0
    load = [0.0] * count
    out: dict[str, int] = {}
    for u in sorted(units, key=lambda u: (-weights.get(u, default), u)):
        k = min(range(count), key=lambda i: (load[i], i))
        load[k] += weights.get(u, default)
        out[u] = k + 1
    return out


def digest(assignment: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(assignment.items())).encode()).hexdigest()[:16]


def merge(runs: list[dict], section_key: str) -> dict:
    """One run (pytest-benchmark JSON with perfgate's section under ``section_key``) from the shards'
    runs, rows in shard order; the caller gates its rows again. Raises ``MergeError`` naming
    what differs."""
    if not runs:
        raise MergeError("no shards given")
    sections = [r[section_key] for r in runs]
    unsharded = [r["_path"] for r, s in zip(runs, sections, strict=True) if not s.get("shard")]
    if unsharded:
        raise MergeError(f"not written by a sharded run (--perf-shard K/N): {', '.join(unsharded)}")
    _check_alike(runs, sections)
    order = sorted(range(len(runs)), key=lambda i: sections[i]["shard"]["index"])
    rows = [row for i in order for row in sections[i]["speedups"]]
    keys = [(r["kernel"], r["impl"], r["size"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise MergeError(f"a row was measured in two shards: {sorted({k for k in keys if keys.count(k) > 1})[:3]}")
    first, merged = sections[0], dict(runs[order[0]])
    merged.pop("_path", None)
    merged["datetime"] = max(r.get("datetime", "") for r in runs)
    merged["benchmarks"] = [b for i in order for b in runs[i].get("benchmarks", [])]
    durations = {u: t for i in order for u, t in (sections[i].get("durations") or {}).items()}
    # each shard lists the unmeasured floors of its own test functions, and every shard those of a test
    # function no shard ran (all of it deselected): each once, none whose row a shard measured
    measured = {(r["kernel"], r["impl"]) for r in rows}
    unmeasured = [u for i in order for u in sections[i].get("unmeasured_floors", [])
                  if (u["kernel"], u["impl"]) not in measured]
    unmeasured = [u for k, u in enumerate(unmeasured) if u not in unmeasured[:k]]
    merged[section_key] = {**{k: first.get(k) for k in ("slug", *SHARED)}, "speedups": rows,
                           "tests_failed": sum(s.get("tests_failed", 0) for s in sections), "durations": durations,
                           "merged_from": [{"shard": sections[i]["shard"]["index"], "path": runs[i]["_path"],
                                            "tests_failed": sections[i].get("tests_failed", 0)} for i in order],
                           "shard": None, "unmeasured_floors": unmeasured, "roofline": _roofline(sections, order)}
    return merged


def _roofline(sections: list[dict], order: list[int]) -> dict:
    """The shards' roofline sections as one: each impl placed under its own runner's limits, so
    each entry names its shard and ``shard_limits`` holds every shard's; ``limits`` is theirs where
    all that measured limits read alike (the same figures), None where they differ."""
    from .roofline import limits_line

    shard_limits, impls, rules = [], [], set()
    for i in order:
        roofline, index = sections[i].get("roofline") or {}, sections[i]["shard"]["index"]
        shard_limits.append({"shard": index, "limits": roofline.get("limits")})
        impls += [{**e, "shard": index} for e in roofline.get("impls", [])]
        rules.add(roofline.get("count_rule"))
    present = [s["limits"] for s in shard_limits if s["limits"]]  # a shard whose impls did no work has none
    alike = len({limits_line(v) for v in present}) <= 1
    # the shards ran one commit (_check_alike), so one counting rule; a shard without one: the earliest
    rule = None if None in rules else min(rules)
    return {"limits": present[0] if present and alike else None, "shard_limits": shard_limits, "impls": impls,
            "count_rule": rule}


def _check_alike(runs: list[dict], sections: list[dict]) -> None:
    """Raise ``MergeError`` unless the shards were measured alike, from one commit and one plan,
    and are each of 1..count once."""
    first = sections[0]
    for run, section in zip(runs[1:], sections[1:], strict=True):
        for key in SHARED:
            if section.get(key) != first.get(key):
                raise MergeError(f"{run['_path']} has another {key} than {runs[0]['_path']}: "
                                 f"{section.get(key)!r} vs {first.get(key)!r}; shards merge only when measured "
                                 "alike (one runner kind, one size, one baseline)")
        if _commit(run) != _commit(runs[0]):
            raise MergeError(f"{run['_path']} measured commit {_commit(run)}, {runs[0]['_path']} "
                             f"{_commit(runs[0])}: shards of different code do not make one verdict")
        if [section["shard"][k] for k in ("count", "plan")] != [first["shard"][k] for k in ("count", "plan")]:
            raise MergeError(f"{run['_path']} was split by another plan than {runs[0]['_path']} (shard count, "
                             "collection or stored durations differ): rerun every shard from one checkout")
    count = first["shard"]["count"]
    indices = sorted(s["shard"]["index"] for s in sections)
    if indices != list(range(1, count + 1)):
        missing = sorted(set(range(1, count + 1)) - set(indices))
        repeated = sorted({i for i in indices if indices.count(i) > 1})
        raise MergeError(f"a merge of {count} shards needs each of 1..{count} once: missing {missing or 'none'}, "
                         f"repeated {repeated or 'none'}")


def _commit(run: dict) -> str:
    info = run.get("commit_info") or {}
    return f"{info.get('id')}{' (dirty)' if info.get('dirty') else ''}"
