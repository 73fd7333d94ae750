"""The options every workload CLI takes: where it runs and where its results go."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from workloads.common import EMULATED_BF16_NOTE, bf16_emulated
from workloads.output import machine, write_results


def add_common(parser: argparse.ArgumentParser, amp_rows: bool = False, accuracy: bool = False) -> None:
    """``--device`` (checked by each workload's Config: a bad one is a one-line error) and
    ``--output-dir`` (workloads.output: JSON, CSV and a PNG); with ``amp_rows``, ``--emulated-bf16``
    (run AMP rows on a CPU without bf16 instructions too); with ``accuracy``, ``--eval-images``
    (the held-out images a run's accuracy is measured on)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="also write the results here: NAME.json (rows, config, machine), NAME.csv, NAME.png")
    if amp_rows:
        parser.add_argument("--emulated-bf16", action="store_true",
                            help="run the AMP rows on a CPU without bf16 instructions too (software bf16: slow)")
    if accuracy:
        parser.add_argument("--eval-images", type=int, default=1000, metavar="N",
                            help="held-out images the accuracy is measured on (1000)")


def leaves_out_amp(args: argparse.Namespace, device: str) -> bool:
    """Whether this run leaves its AMP rows out (bf16 emulated on ``device`` and no ``--emulated-bf16``),
    said on stdout when it does."""
    left_out = bf16_emulated(device) and not args.emulated_bf16
    if left_out:
        print(EMULATED_BF16_NOTE)
    return left_out


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with ``--output-dir`` created now: a folder that cannot be
    written is a one-line error before the run, not a traceback after it."""
    args = parser.parse_args(argv)
    if args.output_dir:
        out = Path(args.output_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--output-dir {out}: {e.strerror or e}")
        if not os.access(out, os.W_OK):
            parser.error(f"--output-dir {out}: not writable")
    return args


def save(args: argparse.Namespace, stem: str, header: Sequence[str], cells: Sequence[Sequence[str]], config: Any,
         time_column: str | Sequence[str], curves: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
         metric_column: str | None = None) -> None:
    """With ``--output-dir``: write the run's results there (workloads.output) and say where."""
    if args.output_dir:
        paths = write_results(args.output_dir, stem, header, cells, config=config, device=config.device,
                              time_column=time_column, curves=curves, metric_column=metric_column)
        print("wrote " + ", ".join(str(p) for p in paths))


def describe(device: str) -> str:
    """Where a run's numbers come from: the device (the CPU's model), torch's threads and build, and
    the malloc mode (the CLIs leave glibc's default, as a user's training process does)."""
    m = machine(device)
    return f"{device} ({m['device_name']}), {m['threads']} threads, torch {m['torch']}, malloc {m['malloc']}"
