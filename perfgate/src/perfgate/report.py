"""``python -m perfgate.report [JSON ...] [--png PATH] [--markdown PATH]``: tables and charts.

``python -m perfgate.report --merge shard*.json [--output merged.json]``: the shards of one
``--perf-shard K/N`` run as one table and one verdict (exit 1 when the gate fails, 2 when the
shards do not merge: another fingerprint, size, commit, baseline or plan, a shard missing or
repeated); ``--output`` writes the merged run, a JSON like one unsharded run's.

With no JSON given it reads every run saved under ``.benchmarks/`` (all fingerprints). It
prints the table of the newest run of each fingerprint and size; ``--markdown`` writes the same
tables as a markdown page (each headed by what it was measured on: device, threads, allocator,
torch, and the commit); ``--png`` draws the newest run, a panel per kernel: its speedups with
their intervals and floors, and with ``--perf-against`` REV's time over this tree's; under them
each row's speedup across the saved runs of that fingerprint and size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .floors import FloorPolicy, Unmeasured
from .roofline import COUNT_RULE, LIMITS_FILE, limits_line, now_line, placed_cells, placed_header
from .session import JSON_KEY
from .shard import MergeError, merge
from .stats import CONTENDED, TABLE_HEADER, format_table, gate, row_from_dict, table_cells, verdict
from .stored import BadRun, read_run


def against_lines(against: dict) -> list[tuple[str, str]]:
    """A run's ``--perf-against`` table and verdict, as the session printed them."""
    from .abrun import ABRow
    from .against import report_lines
    from .checkout import Revision

    label = Revision(against["rev"], sha=against.get("sha"), folder=against.get("folder")).label
    return report_lines([ABRow(**r) for r in against["rows"]], label, against["workers_per_side"],
                        against["seconds"], against["tolerance"], against.get("problem", ""),
                        against.get("notes", ()))


def load_runs(paths: list[Path]) -> list[dict]:
    """The whole perfgate runs among ``paths``, oldest first; each other file is skipped with a
    line on stderr naming it and what is wrong with it (stored.read_run)."""
    runs = []
    for path in paths:
        try:
            runs.append(read_run(path))
        except BadRun as exc:
            print(f"skipping {exc}", file=sys.stderr)
    return sorted(runs, key=lambda r: r.get("datetime", ""))


def _where(run: dict) -> tuple[str, str]:
    """Runs are comparable within one fingerprint and one size."""
    return run[JSON_KEY]["slug"], run[JSON_KEY]["size"]


def _label(run: dict) -> str:
    commit = (run.get("commit_info") or {}).get("id") or "?"
    return f"{run.get('datetime', '?')[:16]} {commit[:7]}"


COLORS = {"FAIL": "tab:red", "unresolved": "tab:orange", "faster": "tab:green"}  # else tab:blue


def _kernels(rows: list[dict], ab: list[dict]) -> list[str]:
    """Kernel names in the order the run measured them (speedup rows first, then A/B-only ones)."""
    return list(dict.fromkeys([r["kernel"] for r in rows] + [r["kernel"] for r in ab]))


def _outcome(row: dict) -> str:
    """A stored row's outcome (runs saved before rows carried one: from its failures)."""
    if row.get("outcome"):
        return row["outcome"]
    return "FAIL" if row.get("failures") else "unresolved" if row.get("unresolved") else "ok"


def _dots(ax: object, rows: list[tuple[str, float, float, float, str]]) -> None:
    """(name, point, low, high, outcome) as dots with their intervals, one line each, top down."""
    for y, (_, x, lo, hi, outcome) in enumerate(rows):
        ax.errorbar([x], [y], xerr=[[x - lo], [hi - x]], fmt="o", ms=4, capsize=2,
                    color=COLORS.get(outcome, "tab:blue"))
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)


class NothingToDraw(ValueError):
    """The newest run has no row a chart could show."""


def draw(runs: list[dict], png: Path) -> None:
    """The newest run, one panel per kernel: each row's speedup over its reference (dot, 95%
    interval, floor as a red bar, 1x marked); with --perf-against, beside it REV's time over this
    tree's (1 and the tolerance line marked). Red: FAIL, orange: unresolved, green: faster. Under
    them, each row's speedup across the saved runs of that fingerprint and size, when there are
    two or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if _where(r) == _where(runs[-1])]
    section = runs[-1][JSON_KEY]
    rows, against = section["speedups"], section.get("against") or {}
    ab = [r for r in against.get("rows", []) if r.get("ratio") is not None]
    kernels = _kernels(rows, ab)
    if not kernels:
        raise NothingToDraw(f"{runs[-1]['_path']}: no speedup and no row compared with REV: no chart drawn")
    history = len(runs) > 1 and bool(rows)
    heights = [max(sum(r["kernel"] == k for r in rows), sum(r["kernel"] == k for r in ab), 1) + 1.0
               for k in kernels]
    if history:  # a spacer row for the last panels' axis label, then the history
        heights += [2.0, 0.4 * sum(heights)]
    cols = 2 if ab else 1
    tall = 0.25 * sum(heights) + 1.0
    fig = plt.figure(figsize=(6.0 * cols + 1, tall))
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights, hspace=1.0, wspace=0.45,
                            top=1.0 - 0.9 / tall, bottom=0.6 / tall)
    speed_ax = ab_ax = None
    for i, kernel in enumerate(kernels):
        ax = _speedup_panel(fig.add_subplot(grid[i, 0], sharex=speed_ax), kernel, rows)
        speed_ax = speed_ax or ax
        if ab:
            bx = _ab_panel(fig.add_subplot(grid[i, 1], sharex=ab_ax), kernel, ab, against.get("tolerance", 0.05))
            ab_ax = ab_ax or bx
    _label_axes(fig, speed_ax, cols, against if ab_ax is not None else None, runs)
    if history:
        _history_panel(fig.add_subplot(grid[-1, :]), runs)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _speedup_panel(ax: Any, kernel: str, rows: list[dict]) -> Any:
    """``kernel``'s rows on ``ax``: each speedup with its interval, its floor as a red bar."""
    mine = [r for r in rows if r["kernel"] == kernel]
    ax.set_title(kernel, loc="left", fontsize=8)
    ax.axvline(1.0, color="gray", lw=0.8)
    if mine:
        _dots(ax, [(r["impl"], r["speedup"], r["low"], r["high"], _outcome(r)) for r in mine])
        for y, r in enumerate(mine):
            if r["floor"] is not None:
                ax.plot([r["floor"]] * 2, [y - 0.35, y + 0.35], color="tab:red", lw=2)
    else:  # compared with REV only (make bench's --perf-gated-only): no frame to read
        ax.set_yticks([])
        ax.set_frame_on(False)
        ax.text(0.02, 0.5, "no speedup timed", transform=ax.transAxes, fontsize=7, va="center", color="gray")
    ax.set_xscale("log")
    return ax


def _ab_panel(bx: Any, kernel: str, ab: list[dict], tolerance: float) -> Any:
    """``kernel``'s rows compared with REV on ``bx``: REV's time over this tree's, the tolerance
    line dashed."""
    theirs = [(r["impl"], r["ratio"], r["low"], r["high"], r["outcome"]) for r in ab if r["kernel"] == kernel]
    bx.axvline(1.0, color="gray", lw=0.8)
    bx.axvline(1.0 / (1.0 + tolerance), color="tab:red", lw=0.8, ls="--")
    if theirs:
        _dots(bx, theirs)
    else:
        bx.set_yticks([])
        bx.text(0.02, 0.5, "not compared", transform=bx.transAxes, fontsize=7, va="center")
    return bx


def _label_axes(fig: Any, speed_ax: Any, cols: int, against: dict | None, runs: list[dict]) -> None:
    """x ticks as "2x" on every panel, labels under the last row of panels, and the title."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    panels = list(fig.axes)
    for a in panels:
        a.tick_params(axis="x", labelsize=7, labelbottom=False)
        a.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        a.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    speed_ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    for a in panels[-cols:]:
        a.tick_params(axis="x", labelbottom=True)
    panels[-cols].set_xlabel("speedup over reference (log; red bar: floor)", fontsize=8)
    section = runs[-1][JSON_KEY]
    title = f"{section['slug']}, {section['size']}, {_label(runs[-1])}"
    if against is not None:
        rev = against.get("sha") or against.get("rev")
        panels[-1].set_xlabel(f"REV time / this tree's (under 1: slower; dashed: the {against['tolerance']:.0%} "
                              "line)", fontsize=8)
        title += f"; against {against.get('rev')} ({str(rev)[:12]})"
    fig.suptitle(title, fontsize=9)


def _history_panel(hx: Any, runs: list[dict]) -> None:
    """Each row's speedup across the saved ``runs``."""
    series: dict[str, list[tuple[int, float]]] = {}
    for i, run in enumerate(runs):
        for r in run[JSON_KEY]["speedups"]:
            series.setdefault(f"{r['kernel']} [{r['impl']}]", []).append((i, r["speedup"]))
    for name, points in series.items():
        hx.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, lw=1, label=name)
    hx.set_xticks(range(len(runs)), [_label(r) for r in runs], rotation=30, ha="right", fontsize=6)
    hx.set_yscale("log")
    hx.set_ylabel("speedup", fontsize=8)
    hx.set_title("speedup across saved runs", loc="left", fontsize=8)
    hx.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(series) // 20)


def markdown(runs: list[dict], title: str = "Speedups") -> list[str]:
    """A markdown page: one table per run, headed by its fingerprint and commit."""
    lines = [f"# {title}", "",
             "Generated by `python -m perfgate.report --markdown` from the stored runs; speedup = "
             "median(reference) / median(optimized), both measured in the same run, with its 95% interval.", ""]
    for run in runs:
        section, fp = run[JSON_KEY], run[JSON_KEY]["fingerprint"]
        lines += [f"## {fp['device_name']}, {section['size']}", "",
                  f"{fp['device_type']}, {fp['threads']} thread(s), malloc {fp['malloc']}, torch {fp['torch']}, "
                  f"Python {fp['python']}; {_label(run)} (`{run['_path']}`)", "",
                  "| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
        lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in table_cells(section["speedups"])]
        lines += [""] + _roofline_markdown(section.get("roofline") or {})
    return lines


def _roofline_markdown(roofline: dict) -> list[str]:
    """A run's roofline table, headed by the limits it was measured against (none in older runs);
    a merge of shards whose limits differ, by each shard's."""
    entries, limits = roofline.get("impls") or [], roofline.get("limits")
    differ = [s for s in roofline.get("shard_limits") or [] if s["limits"]] if limits is None else []
    if not (limits or differ) or not any(e["fraction"] is not None for e in entries):
        return []
    where = f"this machine's {limits_line(limits)}" if limits else \
        "the shards' runners' limits differ, " + "; ".join(_shard_limits(s, entries) for s in differ)
    rule = roofline.get("count_rule")
    if rule is not None and rule > COUNT_RULE:
        rule_note = [f"Counted under rule {rule}, a later rule than this perfgate's ({COUNT_RULE}): a newer "
                 "perfgate's report says what it changed.", ""]
    elif rule != COUNT_RULE:
        rule_note = [f"Counted under an earlier rule ({f'rule {rule}' if rule else 'a run that predates rule 2'}; "
                 f"this perfgate counts by rule {COUNT_RULE}): the bytes, FLOPs and roofline figures of this run, "
                 "here and in its speedup table, are as that rule counted them; a baseline saved now counts them "
                 "again (the CHANGELOG says what each rule changed).", ""]
    else:
        rule_note = []
    # rule 6 added the write-rate term: an earlier run's figures were made without it
    written = ", bytes written at the write rate" if rule is not None and rule >= 6 else ""
    now = now_line(limits, roofline.get("now")) if limits else None  # a merge of shards keeps no one reading
    now_note = [f"Read against the best this machine has shown: {now}.", ""] if now else []
    return [f"Roofline: {where}; each impl's least time (bytes moved at the "
            f"stream bandwidth{written}, FLOPs at the GEMM peak) over its median "
            "([how to read it](perfgate.md#the-roofline-column)).", "", *now_note, *rule_note,
            "| " + " | ".join(placed_header(entries)) + " |", "|" + "---|" * len(placed_header(entries)),
            *("| " + " | ".join(cells) + " |" for cells in placed_cells(entries)), ""]


def _shard_limits(shard: dict, entries: list[dict]) -> str:
    """"shard 2 (alpha, beta): stream 34.1 GB/s, ...": a shard's limits and the kernels it placed."""
    kernels = dict.fromkeys(e["kernel"] for e in entries if e.get("shard") == shard["shard"])
    return f"shard {shard['shard']} ({', '.join(kernels)}): {limits_line(shard['limits'])}"


def merged_verdict(runs: list[dict], output: Path | None) -> int:
    """Merge the shards, gate every row again by the one rule, print the table and the verdict."""
    run = merge(runs, JSON_KEY)
    section = run[JSON_KEY]
    rows = [row_from_dict(r) for r in section["speedups"]]
    for row in rows:
        gate(row, section["tolerance"], section.get("contended", CONTENDED))
    section["speedups"] = [r.as_dict() for r in rows]
    shards = ", ".join(f"{m['shard']}: {m['path']}" for m in section["merged_from"])
    print(f"{section['slug']}  size {section['size']}  {_label(run)}  merged from {len(runs)} shards ({shards})")
    print("\n".join(format_table(section["speedups"])))
    if section["baseline"]:
        matched = sum(r.baseline is not None for r in rows)
        print(f"compared against baseline {section['baseline']}: {matched} of {len(rows)} row(s) have a "
              "stored speedup")
    off = section.get("floors_off", "" if section["floors_applied"] else "(why: not recorded)")
    # the declared floors no shard measured, as an unsharded run names them: under --perf-require-floors
    # those that apply for certain fail the merge
    unmeasured = [Unmeasured.from_dict(u) for u in section.get("unmeasured_floors", [])]
    required = [u for u in unmeasured if u.required]
    for u in unmeasured:
        if not u.required or not section.get("require_floors"):
            print(f"{'NOT MEASURED: ' if u.required else 'perfgate: '}{u.line()}")
    missed = [f"{u.line()} (--perf-require-floors)" for u in required] if section.get("require_floors") else []
    lines = verdict(rows, FloorPolicy(off).held_to(), "as measured in its shard", missed)
    if required and not missed:
        lines.append(("warn", f"perfgate: {len(required)} declared floor(s) not checked (NOT MEASURED above): the "
                              "verdict covers the rows measured only; --perf-require-floors fails a run on them"))
    for m in section["merged_from"]:
        if m["tests_failed"]:  # an assertion in a perf test: the rows alone would pass it
            lines.append(("fail", f"TESTS FAILED in shard {m['shard']} ({m['path']}): {m['tests_failed']} "
                                  "test(s); its pytest log names them"))
    print("\n".join(text for _, text in lines))
    if output is not None:
        output.write_text(json.dumps(run, indent=2), encoding="utf8")
        print(f"wrote {output}")
    return 1 if any(style == "fail" for style, _ in lines) else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perfgate.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="*", type=Path, help="benchmark JSON files (default: .benchmarks/**)")
    parser.add_argument("--png", type=Path, help="write the charts to this PNG")
    parser.add_argument("--markdown", type=Path, help="write the newest run of each fingerprint and size "
                                                      "as a markdown page to this path")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    parser.add_argument("--merge", action="store_true",
                        help="the JSON files are the shards of one --perf-shard run: print one table and gate it "
                             "(exit 1 on failure)")
    parser.add_argument("--output", type=Path, help="with --merge: write the merged run to this JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.output and not args.merge:
        parser.error("--output writes a merged run: give it with --merge")
    if args.merge and not args.json:
        parser.error("--merge needs the shards' JSON files (each shard's --benchmark-json)")
    # every stored run; a fingerprint's roofline limits (roofline.LIMITS_FILE) are not a run
    paths = args.json or sorted(p for p in Path(".benchmarks").rglob("*.json") if p.name != LIMITS_FILE)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(map(str, missing))}")
    runs = load_runs(paths)
    if args.merge:
        if len(runs) != len(paths):
            parser.error("--merge: every file must be a perfgate run (see the skipped ones above)")
        try:
            return merged_verdict(runs, args.output)
        except MergeError as exc:
            print(f"perfgate.report --merge: {exc}", file=sys.stderr)
            return 2
    if not runs:
        print("no perfgate runs found: save one with `pytest --benchmark-save=NAME` (or --benchmark-json=FILE)",
              file=sys.stderr)
        return 1
    _report(runs, args)
    return 0


def _report(runs: list[dict], args: argparse.Namespace) -> None:
    """The newest run of each fingerprint and size as a table (unless --quiet), a markdown page
    and the charts, as asked."""
    newest = {_where(run): run for run in runs}
    if not args.quiet:
        for run in newest.values():
            slug, size = _where(run)
            print(f"{slug}  size {size}  {_label(run)}  ({run['_path']})")
            print("\n".join(format_table(run[JSON_KEY]["speedups"])))
            if run[JSON_KEY].get("against"):
                print("\n".join(text for _, text in against_lines(run[JSON_KEY]["against"])))
            print()
    if args.markdown:
        args.markdown.write_text("\n".join(markdown(list(newest.values()))), encoding="utf8")
        print(f"wrote {args.markdown}")
    if args.png:
        try:
            draw(runs, args.png)
            print(f"wrote {args.png}")
        except NothingToDraw as exc:
            print(exc, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
