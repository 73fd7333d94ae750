"""A workload run's results as files (``--output-dir``): the table as CSV, everything as JSON (the
rows, the config, the machine it ran on) and one PNG a person would rather look at than read.

Files for a run named ``stem``, in ``output_dir`` (created if missing):

- ``stem.csv``: the table the CLI prints, one line per run, each with a last ``machine`` column
  (``described``: the CPU or GPU model, torch's threads and build, malloc);
- ``stem.json``: ``{"workload", "machine", "config", "header", "rows", "curves"}``, the rows as
  ``{column: cell}``; ``machine`` is perfgate's fingerprint of this process (CPU model, torch
  threads, torch build, malloc mode) so a number says what it was measured on;
- ``stem.png``: one panel per curve set (e.g. validation loss per epoch, reference against
  optimized), where each run's time went, and the quality (e.g. accuracy) each run kept, under a
  title naming the machine.

The three are written under temporary names and renamed over the previous run's together.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def machine(device: str) -> dict:
    """What the numbers were measured on. The CLIs leave glibc's malloc as it is (``default``),
    as a user's own training process does."""
    from perfgate.fingerprint import fingerprint

    return fingerprint(device, torch.get_num_threads(), "default")


def _number(cell: str) -> float:
    """A table cell as a number: '12.3', '4.50x', '81.0%' ('-' and text are NaN)."""
    try:
        return float(cell.rstrip("x%"))
    except ValueError:
        return float("nan")


def write_results(output_dir: str | Path, stem: str, header: Sequence[str], cells: Sequence[Sequence[str]], *,
                  config: object, device: str, time_column: str | Sequence[str],
                  curves: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
                  metric_column: str | None = None, names: Sequence[str] | None = None) -> list[Path]:
    """Write ``stem``.csv, .json and .png into ``output_dir``; returns their paths.

    ``cells``: the table's rows (as printed); ``time_column``: the column of ``header`` plotted per
    run, or several that add up to a run's time (stacked: where it went); ``metric_column``: the
    quality each run kept (its own panel, e.g. accuracy); ``curves``: panel title -> {run name:
    values per step or epoch}; ``names``: each run's label in the PNG (default: its row's first
    cell), for a table whose first column alone does not tell its runs apart."""
    times = [time_column] if isinstance(time_column, str) else list(time_column)
    for name, column in [*(("time_column", c) for c in times), ("metric_column", metric_column)]:
        if column is not None and column not in header:
            raise ValueError(f"{name} {column!r} is not a column of {list(header)}")
    names = [row[0] for row in cells] if names is None else list(names)
    if len(names) != len(cells):
        raise ValueError(f"names must give one label per row of cells ({len(cells)}), got {len(names)}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = curves or {}
    paths = [out / f"{stem}.csv", out / f"{stem}.json", out / f"{stem}.png"]
    # each written beside its final name, then all three renamed over it: an interrupted run leaves
    # the previous run's set whole, never its JSON beside this run's table
    parts = [p.with_name(f".{p.stem}.{os.getpid()}{p.suffix}") for p in paths]
    on = machine(device)
    try:
        with parts[0].open("w", newline="", encoding="utf8") as fh:
            writer = csv.writer(fh)
            # each line names its machine: a CSV is read apart from the JSON beside it
            where = described(on)
            writer.writerow([*header, "machine"])
            writer.writerows([*row, where] for row in cells)
        record = {"workload": stem, "machine": on,
                  "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config)),
                  "header": list(header), "rows": [dict(zip(header, row, strict=True)) for row in cells],
                  "curves": {title: {name: list(v) for name, v in runs.items()} for title, runs in curves.items()}}
        parts[1].write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf8")
        _plot(parts[2], f"{stem}\n{described(on)}", header, cells, names, times, metric_column, curves)
        for part, path in zip(parts, paths, strict=True):
            os.replace(part, path)
    finally:
        for part in parts:
            part.unlink(missing_ok=True)
    return paths


def described(on: dict) -> str:
    """``machine``'s fingerprint in a line: the device's model, torch's threads and build, malloc."""
    return (f"{on['device_type']} ({on['device_name']}), {on['threads']} threads, torch {on['torch']}, "
            f"malloc {on['malloc']}")


def _plot(path: Path, stem: str, header: Sequence[str], cells: Sequence[Sequence[str]], runs: list[str],
          times: list[str], metric_column: str | None,
          curves: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
    """One panel per curve set (its legend under it, off the curves), then where each run's time
    went (a bar per run, stacked when ``times`` has parts, each labelled with its total), then the
    metric each run kept (a dot per run against the first run's, on an axis that shows the
    difference). ``runs``: the runs' labels, wrapped so none is cut off; four panels or more go two a row."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = [textwrap.fill(run, 28) for run in runs]
    panels = len(curves) + 1 + (metric_column is not None)
    cols = 2 if panels >= 4 else panels
    rows = -(-panels // cols)
    height = max(4.0, 1.5 + 0.3 * sum(n.count("\n") + 1 for n in names))  # every wrapped label line fits
    fig, grid = plt.subplots(rows, cols, figsize=(6.0 * cols, height * rows), squeeze=False, layout="constrained")
    axes = list(grid.flat)
    for ax, (title, runs) in zip(axes, curves.items(), strict=False):
        for name, values in runs.items():  # None: a step the run did not take (before a resume)
            ax.plot(range(1, len(values) + 1), [math.nan if v is None else v for v in values], label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(next((unit for unit in ("step", "task") if unit in title), "epoch"))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    _bars(axes[len(curves)], names, [[_number(row[list(header).index(c)]) for c in times] for row in cells],
          times, f"where the time went ({', '.join(times)})" if len(times) > 1 else f"{times[0]} per run")
    if metric_column is not None:
        col = list(header).index(metric_column)
        _dots(axes[len(curves) + 1], names, [_number(row[col]) for row in cells], metric_column,
              percent=cells[0][col].endswith("%"))
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.suptitle(stem, fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax: Any, names: list[str], values: list[list[float]], parts: list[str], title: str) -> None:
    """Horizontal bars, one per run in the table's order, ``parts`` stacked, each run's total at its end."""
    left = [0.0] * len(names)
    for k, part in enumerate(parts):
        widths = [row[k] for row in values]
        ax.barh(range(len(names)), widths, left=left, label=part)
        left = [a + (b if b == b else 0.0) for a, b in zip(left, widths, strict=True)]  # NaN ('-') adds nothing
    for y, total in enumerate(left):
        label = f"{total:,.0f}" if abs(total) >= 100 else f"{total:.3g}"  # 1,230 not 1.23e+03
        ax.annotate(label, (total, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.margins(x=0.18)  # room for the totals
    ax.set_title(title, fontsize=10)
    if len(parts) > 1:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(parts), frameon=False)


def _dots(ax: Any, names: list[str], values: list[float], column: str, percent: bool) -> None:
    """A dot per run, its value beside it, the first run's value as a dashed line: what was kept."""
    ax.scatter(values, range(len(names)), zorder=3)
    for y, value in enumerate(values):
        ax.annotate(f"{value:.1f}%" if percent else f"{value:.3g}", (value, y), xytext=(5, 0),
                    textcoords="offset points", va="center", fontsize=7)
    if values and values[0] == values[0]:
        ax.axvline(values[0], color="grey", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_ylim(len(names) - 0.5, -0.5)  # the table's order, top to bottom
    known = [v for v in values if v == v]
    if known:  # at least 1 point (percent) or 1% either side, so a small difference looks small
        pad = max(0.3 * (max(known) - min(known)), 1.0 if percent else 0.01 * abs(sum(known) / len(known)), 1e-9)
        ax.set_xlim(min(known) - pad, max(known) + 1.6 * pad)  # the right side holds the labels
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{column} per run (dashed: the first run's)", fontsize=10)
