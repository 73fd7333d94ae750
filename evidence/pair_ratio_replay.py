"""--perf-against's two statistics replayed on the same blocks: the ratio of the two sides'
medians with a paired bootstrap (``speedup_interval``, the A/B's until 5a9c501) and the median of
the pairs' ratios with the sign test's interval (``pair_ratio_interval``, since), each widened by
the units' offsets (``clustered_interval``) and judged by ``abrun.judge``: a row timed again keeps
its two stretches, split where the second began.

Reads perfgate JSON files with a ``perfgate.against`` section (``make bench``'s bench.json, or the
runs ``python -m perfgate.fidelity --against ... --keep DIR`` keeps, named against-C-I.json:
condition C, 0 unchanged, else slowed) and prints, per condition, each statistic's outcomes and the
new interval's width over the old one's in the median row. A replay keeps the pairs the live
statistic's stopping rule chose.

usage: python -m evidence.pair_ratio_replay FILE_OR_DIR... [-v]
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from perfgate import abrun, stats


def _ratio_of_medians(rev, this, confidence: float) -> tuple[float, float, float]:
    return stats.speedup_interval(rev, this, confidence, paired=True)


STATISTICS = {"ratio of medians": _ratio_of_medians, "median pair ratio": stats.pair_ratio_interval}


def rejudge(fields: dict, base, tolerance: float, contended: float) -> abrun.ABRow:
    """The row judged again with ``base`` as the statistic of its pairs."""
    row = abrun.ABRow(**fields)
    if row.rev_times and not (row.reason or row.broken):
        def interval(lo: int, hi: int) -> tuple[float, float, float]:
            return stats.clustered_interval(row.rev_times[lo:hi], row.this_times[lo:hi], row.rev_units[lo:hi],
                                            row.this_units[lo:hi], base=base)

        n, first = len(row.rev_times), len(row.rev_times) - row.confirmed
        row.ratio, row.low, row.high = interval(0, n)
        if row.confirmed:
            row.first_high = interval(0, first)[2]
            row.confirm_ratio, row.confirm_low, row.confirm_high = interval(first, n)
    abrun.judge(row, tolerance, contended)
    return row


def main(paths: list[str], verbose: bool) -> None:
    files = [f for p in map(Path, paths) for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    tally: dict[str, dict] = {}
    moved: Counter = Counter()  # (old outcome, new outcome) of every row where they differ
    for path in files:
        run = json.loads(path.read_text())["perfgate"]
        against = run["against"]
        condition = path.stem.split("-")[1] if path.stem.startswith("against-") else "0"
        for fields in against["rows"]:
            slowed = condition != "0" and fields["impl"] == "optimized"
            where = path.parent.name if path.stem.startswith("against-") else path.name
            key = f"{where}: condition {condition}, {'slowed' if slowed else 'unchanged'} rows"
            got = {name: rejudge(fields, base, against["tolerance"], run["contended"])
                   for name, base in STATISTICS.items()}
            t = tally.setdefault(key, {"rows": 0, **{name: Counter() for name in STATISTICS}, "widths": []})
            t["rows"] += 1
            for name, row in got.items():
                t[name][row.outcome] += 1
            old, new = got.values()
            if old.outcome != new.outcome:
                moved[(f"{'slowed' if slowed else 'unchanged'}: {old.outcome}", new.outcome)] += 1
            if old.low and new.low and math.isfinite(old.high) and math.isfinite(new.high):
                t["widths"].append(math.log(new.high / new.low) / math.log(old.high / old.low))
            if verbose:
                print(f"  {condition} {fields['kernel'][:28]:28s} {fields['impl'][:18]:18s} "
                      f"{len(fields['rev_times']):3d} pairs: " + " | ".join(
                          f"{name} {row.outcome} {row.ratio:.3f} ({row.low:.3f}-{row.high:.3f})"
                          for name, row in got.items() if row.ratio is not None))
        if not path.stem.startswith("against-"):  # a make bench run: how much of the host's state a pair shares
            corr = [np.corrcoef(np.log(r["rev_times"]), np.log(r["this_times"]))[0, 1]
                    for r in against["rows"] if len(r["rev_times"]) > 2]
            print(f"{path.name}: the two sides' log block times correlate {min(corr):.2f}-{max(corr):.2f} "
                  f"across its {len(corr)} rows (median {np.median(corr):.2f})")
    for key, t in tally.items():
        outcomes = "; ".join(f"{name}: {dict(t[name])}" for name in STATISTICS)
        width = f"{np.median(t['widths']):.2f}" if t["widths"] else "-"
        print(f"{key}: {t['rows']}; {outcomes}; width new/old in the median row {width}")
    print(f"rows in all: {sum(t['rows'] for t in tally.values())}; outcome changed, old -> new: " +
          (", ".join(f"{a} -> {b} x{n}" for (a, b), n in sorted(moved.items())) or "none"))


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a != "-v"], "-v" in sys.argv)
