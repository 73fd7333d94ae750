"""The workloads' results as a markdown table (the README's format)."""

from __future__ import annotations

from collections.abc import Sequence


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a markdown table: ``header`` then one line per row of preformatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def mib(value: float | None) -> str:
    """A peak-memory cell: MiB, or '-' where the platform gives no measure."""
    return "-" if value is None else f"{value:.0f}"
