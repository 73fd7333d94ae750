"""``python -m workloads.cli.data_parallel``: time per step and peak memory per process of the
CIFAR ResNet and Meta-Weight-Net workloads on 1 process and on N (torchrun), one table.

    python -m workloads.cli.data_parallel --processes 1,2 --steps 10

launches one run per process count (1: a plain process; N > 1: ``torchrun --standalone
--nproc-per-node N``) of each workload, and prints their rows. The module docstring of
workloads/data_parallel.py says what the rows measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from workloads import data_parallel as workload
from workloads.cli.options import add_common, describe, parse_args, save
from workloads.common import check_device, markdown, mib


def worker(args: argparse.Namespace) -> int:
    """One run, inside the launched process(es); rank 0 writes its row to ``--row-file``."""
    if "RANK" not in os.environ:  # one plain process
        row = workload.measure(args.workload, args.batch, args.steps, args.device, None)
    else:
        from kernels.distributed import process_group

        with process_group("cuda" if args.device.startswith("cuda") else "cpu") as dp:
            row = workload.measure(args.workload, args.batch, args.steps, args.device, dp)
            if not dp.is_main:
                return 0
    Path(args.row_file).write_text(json.dumps(asdict(row)), encoding="utf8")
    return 0


def launch(args: argparse.Namespace, name: str, processes: int, row_file: Path) -> workload.Row:
    batch = args.batch or workload.DEFAULT_BATCH[name]
    cmd = [sys.executable, "-m", "workloads.cli.data_parallel", "--worker", "--workload", name, "--batch",
           str(batch), "--steps", str(args.steps), "--device", args.device, "--row-file", str(row_file)]
    if processes > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m",
                    "workloads.cli.data_parallel"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{name} on {processes} process(es) failed:\n{run.stderr[-4000:]}")
    return workload.Row(**json.loads(row_file.read_text(encoding="utf8")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli.data_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2", help="process counts, comma-separated (default 1,2)")
    parser.add_argument("--workloads", default=",".join(workload.WORKLOADS),
                        help=f"comma-separated, of {', '.join(workload.WORKLOADS)} (default: both)")
    parser.add_argument("--batch", type=int,
                        help="global batch, split over the processes (default: the workload's own, "
                             f"{workload.DEFAULT_BATCH})")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-up steps (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each workload and process count, "
                                                               "alternating (default 3)")
    add_common(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--row-file", help=argparse.SUPPRESS)
    args = parse_args(parser, argv)
    if args.worker:
        return worker(args)
    try:
        counts = [int(p) for p in args.processes.split(",")]
    except ValueError:
        parser.error(f"--processes must be comma-separated integers, got {args.processes!r}")
    names = args.workloads.split(",")
    unknown = sorted(set(names) - set(workload.WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {', '.join(workload.WORKLOADS)}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    try:  # before any run: a device this host lacks is one line, not a traceback from a launched process
        check_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    batches = {name: workload.DEFAULT_BATCH[name] if args.batch is None else args.batch for name in names}
    if any(n < 1 or b % n for n in counts for b in batches.values()) or args.steps < 1 or args.repeats < 1:
        parser.error(f"--processes must be >= 1, each dividing the global batch ({batches}); --steps and "
                     "--repeats >= 1")
    for name, batch in batches.items():  # a workload's own refusal, here rather than from a launched process
        try:
            workload.CONFIGS[name](batch, args.steps, args.device)
        except ValueError as e:
            parser.error(f"--batch {batch} for {name}: {e}")
    print(f"data parallel, global batches {batches}, {args.steps} timed steps, {args.repeats} run(s) each, "
          f"alternating; 1 process on {describe(args.device)}; N > 1: torchrun, 1 thread each")
    runs: dict[tuple[str, int], list[workload.Row]] = {(name, n): [] for name in names for n in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # 1, N, 1, N, ...: each process count meets the host's states alike
            for name, n in runs:
                runs[name, n].append(launch(args, name, n, Path(tmp) / f"{name}-{n}-{r}.json"))
                row = runs[name, n][-1]
                print(f"run {r + 1}: {name}, {n} process(es): {row.ms_per_step:.1f} ms/step, "
                      f"peak {mib(row.peak_mib)} MiB", flush=True)
    cells = [workload.summary(rs) for rs in runs.values()]
    print("\n".join(markdown(workload.HEADER, cells)))
    save(args, "data_parallel", workload.HEADER, cells, args, "ms/step (slowest rank)",
         names=[workload.run_name(rs[0]) for rs in runs.values()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
