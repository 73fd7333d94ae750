"""Launched by test_distributed.py: ``torchrun --nproc-per-node 2 ddp_worker.py OUT [fail]``.

Runs every case of ddp_cases.py data-parallel (gloo); each is saved by ``save_checkpoint`` (rank 0
writes), and each rank writes its losses and all-reduce counts to OUT/rank<r>.json. With ``fail``,
rank 1 raises in its second training step instead, to show the group ends without a hung rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from correctness_tests.ddp_cases import CASES, case_sgd
from kernels.distributed import process_group
from kernels.training import save_checkpoint


def main(out: Path, fail: bool) -> None:
    with process_group(timeout_s=60) as dp:
        if fail:
            calls = 0

            def failing(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                nonlocal calls
                calls += 1
                if dp.rank == 1 and calls == 2:
                    raise RuntimeError("rank 1 failed on purpose in its second step")
                return torch.nn.functional.cross_entropy(logits, y)

            import correctness_tests.ddp_cases as cases

            cases.F.cross_entropy, _ = failing, cases.F.cross_entropy
            case_sgd(dp)
            return
        report = {}
        for name, case in CASES.items():
            model, result, rounds = case(dp)
            save_checkpoint(out / f"{name}.safetensors", model, torch.optim.SGD(model.parameters(), lr=0.0))
            report[name] = {"losses": result.losses, "all_reduces": rounds}
        (out / f"rank{dp.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), fail=sys.argv[2:] == ["fail"])
