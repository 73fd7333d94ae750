"""``python -m perfgate.fidelity``: how often the gate cries wolf, and how often it bites.

Runs a subset of the perf suite once to save a baseline (into a scratch folder, never
``.benchmarks/``), then ``--runs`` times unchanged (every alarm is false), ``--runs`` times
with the optimized side slowed by each ``--factors``, and with ``--lost PLUGIN`` ``--runs`` times
with that pytest plugin loaded, which replaces kernels by their references (every alarm is a
detection). The
slowdown is the harness's test-only ``--perf-slowdown``: the optimized callables are timed, then
spun for (factor - 1) x their duration; no kernel has a slow switch.

Each optimized row of each run is one trial for every rule, all computed from the same rounds:

- perfgate: the gate's own verdict (its floors where they apply, and the speedup more than
  ``tolerance`` under the baseline's with its whole interval under it), as in the run's JSON;
- pytest-benchmark ``median:10%``: the optimized median more than 10% over the baseline's;
- asv: new/old median ratio over 1.1 and a one-sided Mann-Whitney U test at p < 0.05 (asv's
  factor plus its significance test);
- 10% of the speedup: the speedup's point estimate more than 10% under the baseline's;
- perfgate: unresolved: not an alarm but the gate's third outcome, a row left unjudged (its interval
  still straddling its floor after ``--perf-extend``, or a verdict the host's contention could
  explain) (counted, so a rule that hides behind it shows).
- perfgate before: the baseline rule as it was until the baseline's interval was used (the
  speedup more than ``tolerance`` under the baseline's, the whole interval under its point), or
  a floor's failure.

With ``--against REV`` it measures ``--perf-against``'s rule instead, with no baseline: every
run compares this tree with REV (on a clean tree against HEAD, an alarm in an unchanged run is
false), and in a slowed run this tree's optimized impls are spun in their workers; each row is
judged by perfgate's A/B verdict, by asv continuous's rule (this tree's median over 1.1 x REV's
and a one-sided Mann-Whitney U test at p < 0.002, on the same blocks) and by the point estimate
alone past the tolerance.

The first two judge the optimized side against itself across runs, so anything that slows the
whole host (a neighbour, a clock change) reads as a regression; the speedup rules compare
reference and optimized measured side by side in one run. Runs are single-threaded by default
(``--threads``): where torch's default is more threads, CPU floors are then not applied and
the baseline rule alone is measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from .session import JSON_KEY

RULES = ("perfgate", "pytest-benchmark median:10%", "asv (x1.1 + Mann-Whitney)", "10% of the speedup",
         "perfgate: unresolved", "perfgate before: under the baseline's point")


def _pytest(tests: list[str], storage: Path, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-p", "perfgate.slowdown",
           "--perf-size", "smoke",
           f"--benchmark-storage=file://{storage}", f"--benchmark-json={out}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not out.exists():
        raise RuntimeError(f"perf run wrote no JSON (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text(encoding="utf8"))


def _rounds(run: dict) -> dict[tuple[str, str], list[float]]:
    return {(b["extra_info"]["kernel"], b["extra_info"]["impl"]): b["stats"]["data"] for b in run["benchmarks"]}


def verdicts(base: dict, run: dict, p: float = 0.05) -> dict[str, dict[str, bool]]:
    """{kernel: {rule: alarm}} for every optimized row of ``run`` against ``base``."""
    from scipy.stats import mannwhitneyu

    old, new = _rounds(base), _rounds(run)
    base_speedup = {r["kernel"]: r["speedup"] for r in base[JSON_KEY]["speedups"] if r["impl"] == "optimized"}
    tolerance = run[JSON_KEY]["tolerance"]
    out = {}
    for row in run[JSON_KEY]["speedups"]:
        kernel = row["kernel"]
        if row["impl"] != "optimized" or kernel not in base_speedup:
            continue
        before, after = old[(kernel, "optimized")], new[(kernel, "optimized")]
        ratio = median(after) / median(before)
        out[kernel] = {
            RULES[0]: bool(row["failures"]),
            RULES[1]: ratio > 1.10,
            RULES[2]: ratio > 1.10 and mannwhitneyu(after, before, alternative="greater").pvalue < p,
            RULES[3]: row["speedup"] < 0.90 * base_speedup[kernel],
            RULES[4]: row.get("outcome") == "unresolved",  # left unjudged: not an alarm
            RULES[5]: any("under the floor" in f for f in row["failures"])
            or (row["speedup"] < (1.0 - tolerance) * base_speedup[kernel] and row["high"] < base_speedup[kernel]),
        }
    return out


UNCHANGED = "false alarms, unchanged"
LOST = "caught, kernels lost"


def conditions(factors: list[float], lost: str | None) -> list[tuple[str, list[str]]]:
    """(column, extra pytest arguments) of each condition: unchanged, each slowdown factor, and with
    ``lost`` (a pytest plugin module that swaps kernels for their references when its session is
    configured) lost kernels."""
    out = [(UNCHANGED, [])] + [(f"caught at x{f:g}", [f"--perf-slowdown={f}"]) for f in factors]
    return out + ([(LOST, ["-p", lost])] if lost else [])


def measure(tests: list[str], runs: int, factors: list[float], extra: list[str],
            keep: Path | None = None, lost: str | None = None) -> dict[str, list[dict]]:
    """{condition: [verdicts of each run]} (``conditions``); each run also records its wall seconds
    under ``"seconds"``. With ``keep``, the baseline's and every run's JSON stay there (to try
    other rules on the same rounds)."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        storage = Path(scratch) / "baselines"
        base = _pytest(tests, storage, tmp / "base.json", ["--benchmark-save=fidelity", *extra])
        results: dict[str, list[dict]] = {}
        for n, (name, args) in enumerate(conditions(factors, lost)):
            for i in range(runs):
                out = tmp / f"run-{n}-{i}.json"
                start = time.perf_counter()
                run = _pytest(tests, storage, out, ["--benchmark-compare", *args, *extra])
                results.setdefault(name, []).append(verdicts(base, run))
                results.setdefault("seconds", []).append(time.perf_counter() - start)
                results.setdefault("about", [about(run)])
                print(f"{name} run {i + 1}/{runs}: " + ", ".join(
                    f"{k} {''.join('X' if v[r] else '.' for r in RULES)}" for k, v in results[name][-1].items()),
                    file=sys.stderr, flush=True)
    return results


AB_RULES = ("perfgate --perf-against", "asv continuous (x1.1 + Mann-Whitney p < 0.002)",
            "point over the tolerance", "perfgate --perf-against: unresolved")


def verdicts_ab(run: dict) -> dict[str, dict[str, bool]]:
    """{"kernel [impl]": {rule: alarm}} for every comparable row of a ``--perf-against`` run, each
    rule on the same block medians: the gate's verdict, asv continuous's (this tree's median over
    1.1 x REV's and a one-sided Mann-Whitney U test at p < 0.002, on the blocks), and the point
    estimate alone more than the tolerance slower."""
    from scipy.stats import mannwhitneyu

    against = run[JSON_KEY]["against"]
    line = 1.0 / (1.0 + against["tolerance"])
    out = {}
    for row in against["rows"]:
        if row["outcome"] == "not comparable":
            continue
        rev, this = row["rev_times"], row["this_times"]
        out[f"{row['kernel']} [{row['impl']}]"] = {
            AB_RULES[0]: row["outcome"] == "FAIL",
            AB_RULES[1]: median(this) > 1.1 * median(rev)
            and mannwhitneyu(this, rev, alternative="greater").pvalue < 0.002,
            AB_RULES[2]: row["ratio"] < line,
            AB_RULES[3]: row["outcome"] == "unresolved",
        }
    return out


def measure_against(tests: list[str], runs: int, factors: list[float], extra: list[str], rev: str,
                    keep: Path | None = None) -> dict[str, list[dict]]:
    """{condition: [verdicts_ab of each run]}: ``runs`` runs against ``rev`` unchanged, and
    ``runs`` with this tree's optimized impls slowed by each factor. In a slowed run the
    optimized rows are detections and every other row (an ablation) is one more unchanged trial."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        storage = Path(scratch) / "baselines"
        results: dict[str, list[dict]] = {}
        for n, (name, args) in enumerate(conditions(factors, None)):
            for i in range(runs):
                start = time.perf_counter()
                out = tmp / f"against-{n}-{i}.json"
                run = _pytest(tests, storage, out, ["--perf-against", rev, *args, *extra])
                found = verdicts_ab(run)
                slowed = {k: v for k, v in found.items() if k.endswith("[optimized]")} if args else {}
                results.setdefault(name, []).append(slowed if args else found)
                if args:
                    results.setdefault(UNCHANGED, []).append({k: v for k, v in found.items() if k not in slowed})
                results.setdefault("seconds", []).append(time.perf_counter() - start)
                results.setdefault("about", [about(run)])
                print(f"{name} run {i + 1}/{runs}: " + ", ".join(
                    f"{k} {''.join('X' if v[r] else '.' for r in AB_RULES)}" for k, v in found.items()),
                    file=sys.stderr, flush=True)
    return results


# the keys of a measure's results that are not conditions: each run's seconds, what was measured
META = ("seconds", "about")


def about(run: dict) -> dict:
    """What a run measured: the fingerprint, this tree's commit (and whether it was dirty), and
    with --perf-against REV's name and commit."""
    against = run[JSON_KEY].get("against") or {}
    commit = run.get("commit_info") or {}
    return {"fingerprint": run[JSON_KEY]["fingerprint"], "commit": commit.get("id"), "dirty": commit.get("dirty"),
            "rev": against.get("rev"), "rev_sha": against.get("sha")}


def counts(results: dict[str, list[dict]], rules: tuple[str, ...]) -> dict[str, dict[str, list[int]]]:
    """{rule: {condition: [alarms, trials]}} over every row of every run."""
    names = [name for name in results if name not in META]
    return {rule: {name: [sum(map(bool, trials)), len(trials)]
                   for name in names for trials in [[v[rule] for run in results[name] for v in run.values()]]}
            for rule in rules}


def summary(results: dict[str, list[dict]], rules: tuple[str, ...], argv: list[str]) -> dict:
    """The study as data (``--json``): the command, what it measured, the counts per rule and
    condition, each run's seconds and each run's per-row alarms."""
    return {"command": ["python", "-m", "perfgate.fidelity", *argv],
            "about": (results.get("about") or [None])[0], "rules": list(rules), "counts": counts(results, rules),
            "seconds": results.get("seconds", []),
            "runs": {name: [{row: {rule: bool(alarm) for rule, alarm in alarms.items()}
                             for row, alarms in run.items()} for run in runs]
                     for name, runs in results.items() if name not in META}}


def table(results: dict[str, list[dict]], rules: tuple[str, ...] = RULES) -> list[str]:
    """Markdown: per rule, the false alarms (unchanged) and the detection rate of each condition,
    then the median seconds a run took."""
    names = [name for name in results if name not in META]
    lines = ["| " + " | ".join(["rule", *names]) + " |", "|" + "---|" * (len(names) + 1)]
    for rule, by_name in counts(results, rules).items():
        cells = [rule] + [f"{a}/{n} ({a / max(n, 1):.0%})" for a, n in (by_name[name] for name in names)]
        lines.append("| " + " | ".join(cells) + " |")
    if results.get("seconds"):
        lines.append(f"\nseconds a run, median of {len(results['seconds'])}: {median(results['seconds']):.1f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perfgate.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="+", help="perf test node ids (a fast subset: every run times them all)")
    parser.add_argument("--runs", type=int, default=20, help="runs per condition (default 20)")
    parser.add_argument("--factors", type=float, nargs="+", default=[1.2, 1.5, 2.0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (--perf-threads; default 1: on a shared 2-vCPU host a 2-thread "
                             "speedup moves with the other vCPU's neighbours)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '--perf-device cuda'")
    parser.add_argument("--keep", type=Path, default=None, help="keep every run's JSON in this folder")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the study as data to this file: the command, the fingerprint and "
                             "commits, the counts per rule and condition, and every run's per-row alarms")
    parser.add_argument("--against", default=None, metavar="REV",
                        help="measure --perf-against REV's rule instead of the baseline's: unchanged runs (on a "
                             "clean tree against HEAD, every alarm is false) and runs with the optimized impls "
                             "slowed")
    parser.add_argument("--lost", default=None,
                        help="a pytest plugin module (an import name) that replaces kernels by their "
                             "references when imported: --runs more runs with it loaded")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.threads < 1 or any(f <= 1.0 for f in args.factors):
        parser.error("--runs and --threads must be >= 1 and every factor > 1")
    extra = [f"--perf-threads={args.threads}", *args.pytest_args.split()]
    if args.against is not None:
        results = measure_against(args.tests, args.runs, args.factors, extra, args.against, args.keep)
        rules = AB_RULES
    else:
        results = measure(args.tests, args.runs, args.factors, extra, args.keep, args.lost)
        rules = RULES
    print("\n".join(table(results, rules)))
    if args.json is not None:
        args.json.write_text(json.dumps(summary(results, rules, sys.argv[1:] if argv is None else argv), indent=1)
                             + "\n", encoding="utf8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
