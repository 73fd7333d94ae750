"""Launched by test_distributed.py: ``torchrun --nproc-per-node 2 ddp_worker.py OUT [fail]``.

Runs every case of ddp_cases.py data-parallel (gloo); each is saved by ``save_checkpoint`` (rank 0
writes), and each rank writes its losses, all-reduce counts and whether rank 0's checkpoint
reloads into a fresh wrapped model as its own replica to OUT/rank<r>.json. Then rank 0 cannot
write a checkpoint (a missing folder), and every rank must raise: each writes what it raised to
OUT/unwritable<r>.txt. With ``fail``, rank 1 raises in its second training step instead, to show
the group ends without a hung rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import correctness_tests.ddp_cases as cases
from kernels.distributed import process_group
from kernels.training import Recipe, load_checkpoint, save_checkpoint, train


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1


def main(out: Path, scenario: str) -> int:
    """Runs the scenario; returns this rank."""
    with process_group("cpu", timeout_s=120) as dp:
        if scenario == "fail":  # rank 1 raises in its second step; rank 0 is in that step's all-reduce
            calls, original = 0, cases.F.cross_entropy

            def failing(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                nonlocal calls
                calls += 1
                if dp.rank == 1 and calls == 2:
                    raise RuntimeError("rank 1 failed on purpose in its second step")
                return original(logits, y)

            cases.F.cross_entropy = failing
            cases.case_sgd(dp)
            return dp.rank
        report = {}
        for name, case in cases.CASES.items():
            model, result, rounds = case(dp)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            path = out / f"{name}.safetensors"
            save_checkpoint(path, model, opt)
            report[name] = {"losses": result.losses, "all_reduces": rounds}
        # every rank resumes from rank 0's file into a fresh wrapped model: the replica it holds
        model, _, _ = cases.case_sgd(dp)
        fresh = dp.wrap(cases.MLP((12, 32, 5)))
        load_checkpoint(out / "sgd.safetensors", fresh, torch.optim.SGD(fresh.parameters(), lr=0.0))
        report["reloaded_equal"] = all(torch.equal(a, b) for a, b in
                                       zip(model.parameters(), fresh.parameters(), strict=True))
        (out / f"rank{dp.rank}.json").write_text(json.dumps(report))
        # the ranks' shares unequal (6 and 2 of a global 8): every rank refuses the step alike
        x, y = cases._data(8, seed=9)
        mine = (x[:6], y[:6]) if dp.rank == 0 else (x[6:], y[6:])
        uneven = dp.wrap(cases.MLP((12, 32, 5)))
        try:
            train(uneven, cases.F.cross_entropy, torch.optim.SGD(uneven.parameters(), lr=0.1), [mine])
        except ValueError as e:
            (out / f"uneven{dp.rank}.txt").write_text(str(e))
        # equal shares whose micro-batches differ (3 + 1 and 1 + 3 of a global 8, accumulation 2): refused alike
        mine = [(x[:3], y[:3]), (x[3:4], y[3:4])] if dp.rank == 0 else [(x[4:5], y[4:5]), (x[5:], y[5:])]
        skewed = dp.wrap(cases.MLP((12, 32, 5)))
        try:
            train(skewed, cases.F.cross_entropy, torch.optim.SGD(skewed.parameters(), lr=0.1), mine,
                  Recipe(accumulation=2))
        except ValueError as e:
            (out / f"skewed{dp.rank}.txt").write_text(str(e))
        # a loss module's parameter only rank 0's batch reaches: every rank steps it alike
        gated, loss = dp.wrap(cases.MLP((12, 32, 5))), cases.RankZeroTemperedCE(dp.rank)
        train(gated, loss, torch.optim.SGD([*gated.parameters(), *loss.parameters()], lr=0.1),
              [(x[:4], y[:4]) if dp.rank == 0 else (x[4:], y[4:])])
        (out / f"temperature{dp.rank}.txt").write_text(repr(loss.log_t.item()))
        # rank 0 cannot write: every rank raises, none waits for the file
        try:
            save_checkpoint(out / "missing-folder" / "x.safetensors", model, torch.optim.SGD(model.parameters()))
        except (OSError, RuntimeError) as e:
            (out / f"unwritable{dp.rank}.txt").write_text(f"{type(e).__name__}: {e}")
    return dp.rank


if __name__ == "__main__":
    before = _threads()
    rank = main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cases")
    # the group left and its models freed (main returned), its gloo threads must be gone: one left
    # running can abort the process at interpreter exit
    Path(sys.argv[1], f"threads{rank}.json").write_text(json.dumps({"before": before, "after": _threads()}))
