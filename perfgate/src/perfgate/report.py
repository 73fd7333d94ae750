"""``python -m perfgate.report [JSON ...] [--png PATH]``: the speedup table and charts.

With no JSON given it reads every run saved under ``.benchmarks/`` (all fingerprints). It
prints the table of the newest run of each fingerprint and size and, with ``--png``, draws the
newest run's speedups with their intervals and floors, and each kernel's speedup across the
saved runs of that fingerprint and size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .session import JSON_KEY
from .stats import format_table


def load_runs(paths: list[Path]) -> list[dict]:
    """Runs that carry a perfgate section, oldest first. Plain JSON only (never pickle)."""
    runs = []
    for path in paths:
        data = json.loads(path.read_text(encoding="utf8"))
        if JSON_KEY not in data:
            print(f"skipping {path}: no perfgate section (not written by the perfgate plugin)",
                  file=sys.stderr)
            continue
        data["_path"] = str(path)
        runs.append(data)
    return sorted(runs, key=lambda r: r.get("datetime", ""))


def _where(run: dict) -> tuple[str, str]:
    """Runs are comparable within one fingerprint and one size."""
    return run[JSON_KEY]["slug"], run[JSON_KEY]["size"]


def _label(run: dict) -> str:
    commit = (run.get("commit_info") or {}).get("id") or "?"
    return f"{run.get('datetime', '?')[:16]} {commit[:7]}"


def draw(runs: list[dict], png: Path) -> None:
    """Left: newest run's speedups (95% CI, floor). Right: its fingerprint's runs over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if _where(r) == _where(runs[-1])]
    latest = runs[-1][JSON_KEY]["speedups"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.5 * max(len(latest), 4) + 2))
    names = [f"{r['kernel']} [{r['impl']}, {r['label'] or r['size']}]" for r in latest]
    ys = range(len(latest))
    err = [[r["speedup"] - r["low"] for r in latest], [r["high"] - r["speedup"] for r in latest]]
    ax1.barh(ys, [r["speedup"] for r in latest], xerr=err, color="tab:blue", capsize=3)
    for y, r in zip(ys, latest, strict=True):
        if r["floor"] is not None:
            ax1.plot([r["floor"]] * 2, [y - 0.4, y + 0.4], color="tab:red", lw=2)
    ax1.set_yticks(list(ys), names, fontsize=8)
    ax1.set_xscale("log")
    ax1.axvline(1.0, color="gray", lw=0.8)
    ax1.set_xlabel("speedup over reference (log; red: floor)")
    ax1.set_title(f"{runs[-1][JSON_KEY]['slug']}, {runs[-1][JSON_KEY]['size']}\n{_label(runs[-1])}",
                  fontsize=9)
    history: dict[str, list[tuple[int, float]]] = {}
    for i, run in enumerate(runs):
        for r in run[JSON_KEY]["speedups"]:
            history.setdefault(f"{r['kernel']} [{r['impl']}]", []).append((i, r["speedup"]))
    for name, points in history.items():
        ax2.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax2.set_xticks(range(len(runs)), [_label(r) for r in runs], rotation=30, ha="right", fontsize=7)
    ax2.set_yscale("log")
    ax2.set_ylabel("speedup")
    ax2.set_title("speedup across saved runs", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perfgate.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="*", type=Path, help="benchmark JSON files (default: .benchmarks/**)")
    parser.add_argument("--png", type=Path, help="write the charts to this PNG")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    args = parser.parse_args(argv)
    paths = args.json or sorted(Path(".benchmarks").rglob("*.json"))
    missing = [p for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(map(str, missing))}")
    runs = load_runs(paths)
    if not runs:
        print("no perfgate runs found: save one with `pytest --benchmark-save=NAME` (or --benchmark-json=FILE)",
              file=sys.stderr)
        return 1
    newest: dict[tuple[str, str], dict] = {}
    for run in runs:
        newest[_where(run)] = run
    if not args.quiet:
        for run in newest.values():
            slug, size = _where(run)
            print(f"{slug}  size {size}  {_label(run)}  ({run['_path']})")
            print("\n".join(format_table(run[JSON_KEY]["speedups"])))
            print()
    if args.png:
        draw(runs, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
