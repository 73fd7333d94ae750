"""--perf-against's extension budget spent two ways, replayed on the rows of recorded runs.

Each row's pairs are drawn at random (with their units) from the pairs its run recorded (its first
stretch), on a clock that advances by the pair's two blocks (``timing.block_calls``' shape at the
row's median call). perfgate's own ``abrun.Comparer`` times each row's planned pairs and extends a
row whose interval straddles the line:
- **at once**: right after its planned pairs, with its share of what is left of the budget by the
  rows left in the suite (the rule until 3437dab);
- **after every row's planned pairs**: the straddling rows only, the cheapest pair first, each with
  its share of what the rows before it left (since; ``against.Against._compare``).
Prints, per policy, the rows left unresolved in each replayed run and which rows end so most often.
Both policies draw from the same recorded pairs and units (a row built again gets new units live;
not here), so the replay sets the budget's allocation apart from the host.

usage: python -m evidence.budget_replay RUN.json... [--runs 200] [--budget 240] [--extend 60]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import types
from collections import Counter
from pathlib import Path

from perfgate import abrun
from perfgate.timing import block_calls

BLOCK_OVERHEAD_S = 0.002  # a block's request and answer over the workers' pipes


class Replayed(abrun.Comparer):
    """A Comparer whose pairs are drawn from recorded ones, each advancing ``clock``."""

    def __init__(self, recorded: dict[str, dict], budget: abrun.Budget, rng: random.Random, clock: list[float]):
        super().__init__(None, 0.05, budget)
        self.recorded, self.rng, self.clock = recorded, rng, clock

    def pairs(self, row: abrun.ABRow, count: int, into: abrun.Stretch, loads: list) -> None:
        r = self.recorded[row.nodeid]
        calls, warm = block_calls(statistics.median(r["rev_times"] + r["this_times"]))
        for _ in range(count):
            i = self.rng.randrange(len(r["rev_times"]))
            into.rev.append(r["rev_times"][i])
            into.this.append(r["this_times"][i])
            into.rev_units.append(r["rev_units"][i])
            into.this_units.append(r["this_units"][i])
            wall = (calls + warm) * (r["rev_times"][i] + r["this_times"][i]) + 2 * BLOCK_OVERHEAD_S
            loads.append((wall, 0.0))
            self.clock[0] += wall


def replay(recorded: dict[str, dict], policy: str, budget: abrun.Budget, seed: int) -> list[abrun.ABRow]:
    """One run of every recorded row under ``policy`` ("at once" or "after"), judged."""
    clock = [0.0]
    abrun.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    comparer = Replayed(recorded, budget, random.Random(seed), clock)
    rows = [abrun.ABRow(r["kernel"], r["impl"], r["size"], nodeid) for nodeid, r in recorded.items()]
    straddling = []
    for n, row in enumerate(rows):
        if comparer.time_row(row):
            if policy == "at once":
                comparer.extend(row, rows_left=len(rows) - n)
            else:
                straddling.append(row)
    straddling.sort(key=lambda row: comparer.planned[row.nodeid].pair_s)
    for k, row in enumerate(straddling):
        if comparer.extension_s(len(straddling) - k) >= comparer.planned[row.nodeid].pair_s:
            comparer.extend(row, len(straddling) - k)
    for row in rows:
        abrun.judge(row, 0.05)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_json", nargs="+", help="perfgate JSON files with a perfgate.against section")
    parser.add_argument("--runs", type=int, default=200, help="replayed runs of each recorded run, each policy")
    parser.add_argument("--budget", type=float, default=240.0, help="--perf-against-budget, seconds")
    parser.add_argument("--extend", type=float, default=60.0, help="--perf-extend, seconds")
    parser.add_argument("--max-time", type=float, default=1.0, help="--benchmark-max-time, seconds")
    args = parser.parse_args()
    budget = abrun.Budget(seconds=args.max_time, extend_s=args.extend, total_s=args.budget)
    print(f"budget {args.budget:.0f} s, --perf-extend {args.extend:.0f} s, --benchmark-max-time "
          f"{args.max_time} s, {args.runs} replayed runs of each file a policy")
    for path in map(Path, args.runs_json):
        against = json.loads(path.read_text())["perfgate"]["against"]
        recorded = {}
        for r in against["rows"]:
            if r["rev_times"] and not (r["reason"] or r["broken"]):
                first = len(r["rev_times"]) - r["confirmed"]
                recorded[r["nodeid"]] = {k: (r[k][:first] if isinstance(r[k], list) else r[k])
                                         for k in ("kernel", "impl", "size", "rev_times", "this_times",
                                                   "rev_units", "this_units")}
        live = Counter(r["outcome"] for r in against["rows"])
        print(f"\n{path.name}: {against['sha'][:12]}, {len(recorded)} rows; live: {dict(live)}")
        for policy in ("at once", "after"):
            counts, often, outcomes, pairs = [], Counter(), Counter(), Counter()
            for seed in range(args.runs):
                rows = replay(recorded, policy, budget, seed)
                unresolved = [f"{r.kernel} [{r.impl}]" for r in rows if r.outcome == "unresolved"]
                counts.append(len(unresolved))
                often.update(unresolved)
                outcomes.update(r.outcome for r in rows)
                pairs.update({f"{r.kernel} [{r.impl}]": len(r.rev_times)
                              for r in rows if r.outcome == "unresolved"})
            q = statistics.quantiles(counts, n=10)
            print(f"  {policy:8}: unresolved a run median {statistics.median(counts):.0f} "
                  f"(10-90%: {q[0]:.0f}-{q[-1]:.0f}), mean {statistics.mean(counts):.2f}; "
                  f"outcomes {dict(outcomes)}")
            print("            most often: " + "; ".join(
                f"{name} {n / args.runs:.0%} ({pairs[name] / n:.0f} pairs)" for name, n in often.most_common(8)))


if __name__ == "__main__":
    main()
