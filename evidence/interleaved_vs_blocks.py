"""Does interleaving move the suite's speedups? Each row's interleaved speedup against the ratio
of its two impls' own blocks, from stored runs (no timing here).

    python -m evidence.interleaved_vs_blocks [RUN.json ...]   (default: the newest stored baseline
                                                                 of each fingerprint in .benchmarks/)

A perf session times each impl once as one long block of back-to-back calls (pytest-benchmark's
rounds, the previous result alive while the next is made), then every speedup row again as
interleaved ABBA blocks of a few calls of each side (the row's speedup). The two blocks of the
long-block ratio ran minutes apart, so host drift moves it; a row whose two readings part by more
than ``APART`` is listed. Per run: the median of interleaved / long-block over its rows.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APART = 0.15  # a row whose interleaved / long-block ratio is off 1 by more than this is listed


def newest_runs() -> list[Path]:
    """The newest saved run (highest NNNN_ prefix) of each fingerprint and size under .benchmarks/."""
    folders = {p.parent for p in (ROOT / ".benchmarks").glob("*/*/*/[0-9][0-9][0-9][0-9]_*.json")}
    return sorted(max(folder.glob("[0-9][0-9][0-9][0-9]_*.json")) for folder in folders)


def pairs(run: dict) -> list[tuple[str, str, float, float]]:
    """(kernel, impl, interleaved speedup, long-block ratio) of each speedup row whose two impls
    both have their own rounds in the run ("X vs Y": Y's median over X's; else the reference's).
    Where both impls declare their work (``perf(work_bytes=)``), the row's speedup is a ratio of
    throughputs, and so is its long-block ratio."""
    blocks = {(b["extra_info"]["kernel"], b["extra_info"]["impl"]): (b["stats"]["median"],
                                                                     b["extra_info"].get("work_bytes"))
              for b in run["benchmarks"] if "kernel" in b.get("extra_info", {})}
    found = []
    for row in run["perfgate"]["speedups"]:
        impl, over = row["impl"].split(" vs ", 1) if " vs " in row["impl"] else (row["impl"], "reference")
        slow, fast = blocks.get((row["kernel"], over)), blocks.get((row["kernel"], impl))
        if slow and fast:
            work = fast[1] / slow[1] if slow[1] and fast[1] else 1.0
            found.append((row["kernel"], row["impl"], row["speedup"], slow[0] / fast[0] * work))
    return found


for path in [Path(p) for p in sys.argv[1:]] or newest_runs():
    rows = pairs(json.loads(path.read_text()))
    if not rows:
        continue
    shares = [inter / blocks for _, _, inter, blocks in rows]
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {len(rows)} rows, interleaved / "
          f"long blocks median {statistics.median(shares):.3f} ({min(shares):.2f}-{max(shares):.2f})")
    for kernel, impl, inter, blocks in rows:
        if abs(inter / blocks - 1.0) > APART:
            print(f"    {kernel} [{impl}]: interleaved {inter:.2f}x, long blocks {blocks:.2f}x "
                  f"({inter / blocks:.2f})")
