"""Add one perf run's speedups to floor-evidence.json, the measurements the CPU floors are set
from (correctness_tests/test_perfgate_suite.py checks every floor against them).

    python docs/measurements/floor_evidence.py bench.json --commit abc1234 [--source "make test, clean clone"]

The CPU model, thread count and size come from the run's own fingerprint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EVIDENCE = Path(__file__).with_name("floor-evidence.json")


def run_entry(run: dict, commit: str, source: str) -> dict:
    """One evidence entry: the CPU model, threads, size and each row's point speedup."""
    gate = run["kernelgate"]
    return {
        "cpu": gate["fingerprint"]["device_name"],
        "threads": gate["fingerprint"]["threads"],
        "size": gate["size"],
        "commit": commit,
        "source": source,
        "speedups": {f"{r['kernel']}::{r['impl']}": round(r["speedup"], 3) for r in gate["speedups"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="benchmark JSON files written by a perf run")
    parser.add_argument("--commit", required=True, help="the commit that was measured")
    parser.add_argument("--source", default="perf run", help="how the run was made")
    args = parser.parse_args(argv)
    evidence = json.loads(EVIDENCE.read_text(encoding="utf8"))
    for path in args.runs:
        evidence["runs"].append(run_entry(json.loads(path.read_text(encoding="utf8")), args.commit, args.source))
    EVIDENCE.write_text(json.dumps(evidence, indent=1) + "\n", encoding="utf8")
    print(f"{EVIDENCE}: {len(evidence['runs'])} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
