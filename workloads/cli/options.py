"""The options every workload CLI takes: where it runs and where its results go."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.feature_cache import read_safetensors
from kernels.training import CHECKPOINT_FORMAT
from workloads.common import EMULATED_BF16_NOTE, bf16_emulated
from workloads.output import described, machine, write_results


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


def check_checkpoint(parser: argparse.ArgumentParser, path: str | None, resume: bool, total_steps: int,
                     model: nn.Module | None = None) -> None:
    """``--checkpoint PATH`` checked before any run, a one-line error when it would fail only at
    the first save or at the resume (after the reference run's time): a file in a writable folder;
    an existing file must be a kernelgate checkpoint, and is refused without ``resume`` (an earlier
    run's state is not replaced unasked); with ``resume`` one with steps left of ``total_steps`` and,
    given ``model``, its weights' names and shapes."""
    if path is None:
        return
    where = Path(path)
    folder = where.parent
    if where.is_dir():
        parser.error(f"--checkpoint {path} is a directory: name a file in it, e.g. {where / 'run.safetensors'}")
    if not folder.exists():
        parser.error(f"--checkpoint {path}: its folder {folder} does not exist: create it, or name a file "
                     "in an existing folder")
    if not folder.is_dir():
        parser.error(f"--checkpoint {path}: {folder} is not a folder: name a file in a folder")
    # a file made and removed in the folder: what the atomic save does first (permissions, a read-only disk)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        parser.error(f"--checkpoint {path}: cannot write in {folder} ({e.strerror or e}): name a file in a "
                     "writable folder")
    if not where.exists():
        return
    try:
        tensors, meta = read_safetensors(where)
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        step = int(json.loads(meta["state"])["step"])
    except (ValueError, KeyError, OSError) as e:
        hint = ("resume from a checkpoint this workload saved" if resume
                else "name a new file (this one would be replaced)")
        parser.error(f"--checkpoint {path} is not a kernelgate checkpoint ({e}): {hint}")
    if not resume:  # a run's state is not replaced unasked: it may be a long run's
        parser.error(f"--checkpoint {path} holds an earlier run's checkpoint, at step {step}: pass --resume to "
                     "continue it, or name a new file (or remove this one) to start afresh")
    if step >= total_steps:
        parser.error(f"--checkpoint {path} is at step {step}: nothing left of {total_steps} steps to resume; "
                     "leave out --resume to start afresh, or ask for more --steps")
    if model is not None:
        # the weights the run would load: another --depth or width is refused now, not after the reference run
        saved = {k.removeprefix("model/"): tuple(v.shape) for k, v in tensors.items() if k.startswith("model/")}
        if saved != {k: tuple(v.shape) for k, v in model.state_dict().items()}:
            parser.error(f"--checkpoint {path} holds another model's weights: resume with the options it was "
                         "saved with (--depth), or leave out --resume to start afresh")


def save(args: argparse.Namespace, stem: str, header: Sequence[str], cells: Sequence[Sequence[str]], config: Any,
         time_column: str | Sequence[str], curves: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
         metric_column: str | None = None, names: Sequence[str] | None = None) -> None:
    """With ``--output-dir``: write the run's results there (workloads.output) and say where;
    ``names``: the runs' labels in the PNG (default: each row's first cell)."""
    if args.output_dir:
        folder = Path(args.output_dir)
        earlier = [stem + end for end in (".csv", ".json", ".png") if (folder / (stem + end)).exists()]
        paths = write_results(args.output_dir, stem, header, cells, config=config, device=config.device,
                              time_column=time_column, curves=curves, metric_column=metric_column, names=names)
        print("wrote " + ", ".join(str(p) for p in paths)
              + (f" (replacing an earlier run's {', '.join(earlier)})" if earlier else ""))


def describe(device: str) -> str:
    """Where a run's numbers come from: the device (the CPU's model), torch's threads and build, and
    the malloc mode (the CLIs leave glibc's default, as a user's training process does)."""
    return described(machine(device))
