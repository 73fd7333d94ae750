"""Add one perf run's speedups to floor-evidence.json, the measurements the CPU floors are set
from (correctness_tests/test_perfgate_suite.py checks every floor against them).

    python evidence/floor_evidence.py add bench.json --commit abc1234 [--source "make test, clean clone"]
    python evidence/floor_evidence.py table    # floors.md's table: each floor beside its evidence
    python evidence/floor_evidence.py supersede "per_sample_grads::optimized vs vmap" --before 16c6a29 \
        --why "measured before the streaming stores" [--size smoke]

A row's points measured on code older than a change to what the row times are kept, but marked
superseded (the run's "superseded" map: key -> why), and no floor is held to them: they measured
another kernel. The change's own commit and its descendants stay. ``--size`` limits it to one
size's runs.

The CPU model, thread count and size come from the run's own fingerprint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

EVIDENCE = Path(__file__).with_name("floor-evidence.json")
ROOT = Path(__file__).resolve().parents[1]  # the checkout: the floors are read from its perf tests


def run_entry(run: dict, commit: str, source: str) -> dict:
    """One evidence entry: the CPU model, threads, size, each row's point speedup and, where the
    impl reported one, the variant it ran (a floor keyed to a variant is held to those runs only);
    rows timed with torch's threads apart and too few pairs near are left out, under "apart"."""
    gate = run["perfgate"]
    if gate["fingerprint"]["device_type"] != "cpu" or not gate.get("floors_applied", True):
        raise SystemExit(f"not CPU floor evidence: {gate['slug']} (CPU floors are set at torch's default "
                         "threads; `make bench` runs at BENCH_THREADS=1: add `make test`'s runs, or "
                         "`make bench BENCH_THREADS=0`)")
    key = lambda r: f"{r['kernel']}::{r['impl']}"
    # a row timed with torch's threads apart counts by its pairs timed near, as a baseline perfgate
    # saved is held to them; with too few near (perfgate: it does not "stand for this machine") it
    # measured the host's placement (floors.md, "Not evidence"): left out, and named under "apart"
    placed = [r for r in gate["speedups"] if not (r.get("apart") and r.get("near_speedup") is None)]
    point = lambda r: r["near_speedup"] if r.get("apart") else r["speedup"]
    entry = {
        "cpu": gate["fingerprint"]["device_name"],
        "threads": gate["fingerprint"]["threads"],
        "size": gate["size"],
        "commit": commit,
        "source": source,
        "speedups": {key(r): round(point(r), 3) for r in placed},
        "variants": {key(r): r["variant"] for r in placed if r.get("variant")},
    }
    apart = [key(r) for r in gate["speedups"] if r not in placed]
    return entry | ({"apart": apart} if apart else {})


def table() -> list[str]:
    """Markdown: every CPU floor the perf tests declare beside its row's speedups per CPU model."""
    sys.path.insert(0, str(ROOT))
    from correctness_tests.test_perfgate_suite import FLOORS, speedups_measured

    models = sorted({run["cpu"] for run in json.loads(EVIDENCE.read_text(encoding="utf8"))["runs"]})
    lines = ["| row | size | floor | " + " | ".join(models) + " |", "|---|---|---|" + "---|" * len(models)]
    for kernel, impl, size, floor, variant in FLOORS:
        values = speedups_measured(kernel, impl, size, variant)
        cells = [f"{min(v):.2f}-{max(v):.2f}x (n={len(v)})" if len(v) > 1 else f"{v[0]:.2f}x"
                 if v else "-" for v in (values.get(m, []) for m in models)]
        keyed = f" ({variant})" if variant else ""
        lines.append(f"| {kernel} [{impl}] | {size} | {floor:g}{keyed} | " + " | ".join(cells) + " |")
    return lines


def _older(commit: str, change: str) -> bool:
    """``commit`` is an ancestor of ``change`` and not ``change`` itself (git, in the checkout)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)

    found = [git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}") for rev in (commit, change)]
    for rev, result in zip((commit, change), found, strict=True):
        if result.returncode != 0:
            raise SystemExit(f"git does not know commit {rev!r} in {ROOT}: a full clone is needed")
    same = found[0].stdout == found[1].stdout
    return not same and git("merge-base", "--is-ancestor", commit, change).returncode == 0


def supersede(evidence: dict, row: str, before: str, why: str, size: str | None = None) -> int:
    """Mark ``row`` ("kernel::impl"; a kernel without its parametrization matches every one) in
    every run of a commit older than ``before`` (of ``size`` only, where given) as superseded;
    returns how many points it marked."""
    kernel, impl = row.rsplit("::", 1)
    marked = 0
    for run in evidence["runs"]:
        keys = [k for k in run["speedups"] if k.rsplit("::", 1)[1] == impl
                and (k.rsplit("::", 1)[0] == kernel or k.split("[")[0] == kernel)]
        if keys and (size is None or run["size"] == size) and _older(run["commit"], before):
            for key in keys:
                run.setdefault("superseded", {})[key] = f"{why} ({before})"
                marked += 1
    return marked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add runs to floor-evidence.json")
    add.add_argument("runs", nargs="+", type=Path, help="benchmark JSON files written by a perf run")
    add.add_argument("--commit", required=True, help="the commit that was measured")
    add.add_argument("--source", default="perf run", help="how the run was made")
    sub.add_parser("table", help="print floors.md's table")
    old = sub.add_parser("supersede", help="no floor is held to a row's points measured before a change")
    old.add_argument("row", help="'kernel::impl' as the runs key it, e.g. 'per_sample_grads::optimized vs vmap'")
    old.add_argument("--before", required=True, help="the commit that changed what the row times")
    old.add_argument("--why", required=True, help="what that commit changed")
    old.add_argument("--size", choices=("smoke", "full"), help="only that size's runs (default: every size)")
    args = parser.parse_args(argv)
    if args.command == "table":
        print("\n".join(table()))
        return 0
    evidence = json.loads(EVIDENCE.read_text(encoding="utf8"))
    if args.command == "supersede":
        marked = supersede(evidence, args.row, args.before, args.why, args.size)
        if not marked:
            raise SystemExit(f"no point of {args.row!r} was measured before {args.before}"
                             + (f" at size {args.size}" if args.size else ""))
        EVIDENCE.write_text(json.dumps(evidence, indent=1) + "\n", encoding="utf8")
        print(f"{EVIDENCE}: {marked} point(s) of {args.row} superseded")
        return 0
    for path in args.runs:
        evidence["runs"].append(run_entry(json.loads(path.read_text(encoding="utf8")), args.commit, args.source))
    EVIDENCE.write_text(json.dumps(evidence, indent=1) + "\n", encoding="utf8")
    print(f"{EVIDENCE}: {len(evidence['runs'])} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
