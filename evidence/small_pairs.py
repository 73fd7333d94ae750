"""How often the gate's paired interval misses a row's true speedup, on a few pairs and on many.

Simulated interleaved pairs (no timing): pair i reads ref_i = R * exp(c_i + a_i), opt_i = O *
exp(c_i + b_i), c_i the host state both blocks of a pair share, a_i and b_i each block's own noise.
The true speedup is R / O. For each pair count and confidence, the share of trials whose interval's
low is above the truth (a row exactly on its floor decided "met") and whose high is under it (such
a row failed), each nominally (1 - confidence) / 2, and the interval's mean width (log of high /
low; inf where unbounded). "bootstrap" is the percentile bootstrap of the
ratio of medians alone (scipy.stats.bootstrap, paired, as perfgate computed it before the sign
test's bound); "perfgate" is ``perfgate.stats.speedup_interval`` as it is now.

    PYTHONPATH=perfgate/src python evidence/small_pairs.py > evidence/small-pairs-coverage.txt
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from perfgate.stats import speedup_interval

TRIALS = 1000
CASES = ((4, 0.99), (5, 0.99), (7, 0.99), (8, 0.99), (7, 0.95), (10, 0.95), (20, 0.95), (40, 0.95), (100, 0.95))


def lognormal(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's own noise 5% (log-normal), the shared host state 10%."""
    c = rng.normal(0.0, 0.10, n)
    return 3.0 * np.exp(c + rng.normal(0.0, 0.05, n)), np.exp(c + rng.normal(0.0, 0.05, n))


def heavy(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's own noise Student's t with 3 degrees of freedom, scale 3%."""
    c = rng.normal(0.0, 0.10, n)
    return 3.0 * np.exp(c + 0.03 * rng.standard_t(3, n)), np.exp(c + 0.03 * rng.standard_t(3, n))


def outliers(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """2% noise, and one block in ten slowed by 30% (a neighbour's burst), either side alike."""
    c = rng.normal(0.0, 0.10, n)
    hit = rng.random((2, n)) < 0.1
    a, b = rng.normal(0.0, 0.02, (2, n)) + np.log1p(0.3 * hit)
    return 3.0 * np.exp(c + a), np.exp(c + b)


def bootstrap(ref: np.ndarray, opt: np.ndarray, confidence: float) -> tuple[float, float]:
    def ratio(r: np.ndarray, o: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(r, axis=axis) / np.median(o, axis=axis)

    res = stats.bootstrap((ref, opt), ratio, n_resamples=2000, confidence_level=confidence, paired=True,
                          method="percentile", vectorized=True, rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def main() -> None:
    rng = np.random.default_rng(20261202)
    print(f"# {TRIALS} trials a case; true speedup 3.0; each rule: low above the truth / high under it "
          "(nominal: (1 - confidence) / 2 each), then the mean log width")
    print("| pairs | confidence | nominal | model | bootstrap | perfgate |")
    print("|---|---|---|---|---|---|")
    for n, confidence in CASES:
        for model in (lognormal, heavy, outliers):
            counts, widths = np.zeros((2, 2), dtype=int), np.zeros(2)
            for _ in range(TRIALS):
                ref, opt = model(rng, n)
                for k, (low, high) in enumerate((bootstrap(ref, opt, confidence),
                                                 speedup_interval(ref, opt, confidence, paired=True)[1:])):
                    counts[k] += (low > 3.0, high < 3.0)
                    widths[k] += np.log(high / low) if low > 0.0 else np.inf
            cells = [f"{a / TRIALS:.1%} / {b / TRIALS:.1%}, {w / TRIALS:.3f}"
                     for (a, b), w in zip(counts, widths, strict=True)]
            print(f"| {n} | {confidence:.0%} | {(1 - confidence) / 2:.1%} | {model.__name__} | "
                  f"{cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
