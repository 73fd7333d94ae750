"""How far apart --perf-against's workers of one side run a row: in the JSON files a fidelity study
kept (``python -m perfgate.fidelity ... --against REV --keep DIR``), for each compared row, side and
stretch (the first pairs, and those timed again on fresh workers), the ratio of its two workers'
median blocks (each with 10 blocks or more). Identical code on every worker: a ratio over 1 is a
worker's lasting offset plus the medians' own noise.

    python -m evidence.worker_gaps DIR [DIR ...]
"""

import glob
import json
import sys

import numpy as np


def gaps(folder: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for path in sorted(glob.glob(f"{folder}/against-*.json")):
        with open(path, encoding="utf8") as fh:
            rows = json.load(fh)["perfgate"]["against"]["rows"]
        for r in rows:
            if not r.get("rev_times"):
                continue
            name = r["nodeid"].split("::")[1].split("[")[0] + (" out=" if "out=" in r["impl"] else "")
            for side in ("rev", "this"):
                times, units = np.array(r[f"{side}_times"]), np.array(r[f"{side}_units"])
                for stretch in (0, 1):  # a unit: (generation x 100 + worker) x 100 + copy (abrun.Comparer)
                    here = units // 10000 == stretch
                    worker = units % 10000 // 100
                    medians = [np.median(times[here & (worker == w)]) for w in np.unique(worker[here])
                               if (here & (worker == w)).sum() >= 10]
                    if len(medians) == 2:
                        found.setdefault(name, []).append(max(medians) / min(medians))
    return found


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        found = gaps(folder)
        every = [g for row in found.values() for g in row]
        print(f"{folder}: {len(every)} pairs of workers, their medians' ratio: median {np.median(every):.3f}, "
              f"90th percentile {np.percentile(every, 90):.3f}, largest {max(every):.3f}; over 1.05: "
              f"{sum(g > 1.05 for g in every)}, over 1.10: {sum(g > 1.10 for g in every)}")
        for name, row in found.items():
            print(f"  {name:32s} {len(row):2d}: " + " ".join(f"{g:.3f}" for g in sorted(row)))
