"""What the workloads share: their results as markdown tables (as in docs/measurements/) and the
checks of their configs."""

from __future__ import annotations

from collections.abc import Sequence


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a markdown table: ``header`` then one line per row of preformatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def mib(value: float | None) -> str:
    """A peak-memory cell: MiB, or '-' where the platform gives no measure."""
    return "-" if value is None else f"{value:.0f}"


def require_positive(config: object, names: Sequence[str]) -> None:
    """Refuse a config whose named fields are not >= 1, naming the field."""
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
