"""A workload run's results as files (``--output-dir``): the table as CSV, everything as JSON (the
rows, the config, the machine it ran on) and one PNG a person would rather look at than read.

Files for a run named ``stem``, in ``output_dir`` (created if missing):

- ``stem.csv``: the table the CLI prints, one line per run;
- ``stem.json``: ``{"workload", "machine", "config", "header", "rows", "curves"}``, the rows as
  ``{column: cell}``; ``machine`` is perfgate's fingerprint of this process (CPU model, torch
  threads, torch build, malloc mode) so a number says what it was measured on;
- ``stem.png``: one panel per curve set (e.g. validation loss per epoch, reference against
  optimized) and a bar chart of the table's time column per run.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

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
                  config: object, device: str, time_column: str,
                  curves: Mapping[str, Mapping[str, Sequence[float]]] | None = None) -> list[Path]:
    """Write ``stem``.csv, .json and .png into ``output_dir``; returns their paths.

    ``cells``: the table's rows (as printed), ``time_column`` one of ``header`` (plotted per run);
    ``curves``: panel title -> {run name: values per step or epoch}."""
    if time_column not in header:
        raise ValueError(f"time_column {time_column!r} is not a column of {list(header)}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = curves or {}
    paths = [out / f"{stem}.csv", out / f"{stem}.json", out / f"{stem}.png"]
    with paths[0].open("w", newline="", encoding="utf8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(cells)
    record = {"workload": stem, "machine": machine(device),
              "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config)),
              "header": list(header), "rows": [dict(zip(header, row, strict=True)) for row in cells],
              "curves": {title: {name: list(v) for name, v in runs.items()} for title, runs in curves.items()}}
    paths[1].write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf8")
    _plot(paths[2], stem, header, cells, time_column, curves)
    return paths


def _plot(path: Path, stem: str, header: Sequence[str], cells: Sequence[Sequence[str]], time_column: str,
          curves: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = len(curves) + 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    for ax, (title, runs) in zip(axes[0], curves.items(), strict=False):
        for name, values in runs.items():
            ax.plot(range(1, len(values) + 1), values, label=name)
        ax.set_title(title)
        ax.set_xlabel("step" if "step" in title else "epoch")
        ax.legend(fontsize=7, loc="best")
    ax = axes[0][-1]
    names = [row[0] for row in cells]
    col = list(header).index(time_column)
    ax.barh(range(len(names)), [_number(row[col]) for row in cells])
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel(time_column)
    ax.set_title(f"{stem}: {time_column} per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
