"""--perf-against's interval on a row built on one copy a worker (2 units a side), extended on the
same 2 units (before c0ac6f4) or on 4 (one more copy a worker from the extension on: abrun.MIN_UNITS),
simulated with perfgate.stats.clustered_interval: unchanged code, 14 planned pairs then 42 more, each
pair's log ratio at the noise of vit_rope_step's pairs at 1 thread on the Zen 3 (sd 0.06), each unit
off by a lasting offset drawn at each of three sizes. Per condition, of 400 seeded rows: how many
straddle the 5% line (no verdict), how many intervals miss the truth (the code is unchanged: 1.0;
a unit's offset is noise to the comparison), and the median width.

    python -m evidence.few_units
"""

import numpy as np

from perfgate.stats import clustered_interval

LINE = 1 / 1.05  # the default --perf-against-tolerance's line
PLANNED, TOTAL, ROWS, NOISE = 14, 56, 400, 0.06


def row(seed: int, extra_units: bool, offset_sd: float) -> tuple[float, float, float]:
    """One simulated row's (ratio, low, high): 2 workers a side, one copy each for the planned
    pairs, and for the rest on the same copies or (``extra_units``) on those and a second each."""
    rng = np.random.default_rng(seed)
    offsets = {u: rng.normal(0, offset_sd) for u in range(8)}  # REV's units 0-3, this tree's 4-7
    rev, this, rev_units, this_units = [], [], [], []
    for k in range(TOTAL):
        units = (0, 1) if k < PLANNED or not extra_units else (0, 1, 2, 3)
        a, b = int(rng.choice(units)), int(rng.choice(units)) + 4
        rev.append(float(np.exp(rng.normal(0, NOISE / np.sqrt(2)) + offsets[a])))
        this.append(float(np.exp(rng.normal(0, NOISE / np.sqrt(2)) + offsets[b])))
        rev_units.append(a)
        this_units.append(b)
    return clustered_interval(rev, this, rev_units, this_units)


print(f"# {ROWS} rows a condition, {PLANNED} planned pairs then {TOTAL - PLANNED} more, pairs' log sd {NOISE}")
for offset_sd in (0.0, 0.01, 0.03):
    for extra in (False, True):
        found = [row(seed, extra, offset_sd) for seed in range(ROWS)]
        straddle = np.mean([low < LINE <= high for _, low, high in found])
        miss = np.mean([not low <= 1.0 <= high for _, low, high in found])
        width = np.median([np.log(high / low) for _, low, high in found])
        units = "4 units a side (one more copy a worker)" if extra else "2 units a side"
        print(f"units' offsets sd {offset_sd:.2f}, {units:40s} straddling {straddle:6.1%}  missing 1.0 {miss:5.1%}"
              f"  median width (log) {width:.3f}")
