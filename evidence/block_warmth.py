"""How noisy is the first call of a ``--perf-against`` block? An A/A comparison of one perf row
(the working tree on both sides) in perfgate's own worker processes, 2 a side, ABBA pairs as
``abrun`` times them, but each block times ``--calls`` calls with no warming call and keeps each
call's seconds. Per call position: the spread of the pairs' log ratios, and the sign test's 95%
interval of the pairs' median ratio on the first ``n`` pairs; so a block of one cold call (what a
slow row's block is: ``timing.block_calls``) is set against one warming call and one timed call,
at equal time spent. ``--duet`` adds, after each ABBA pair, a pair whose two blocks run at once
(one a vCPU), to see whether sharing the host's moment cancels more of its noise.

    python -m evidence.block_warmth perf_tests/test_meta_reweight.py::test_meta_reweight_step impl=optimized
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
from pathlib import Path

import numpy as np

from perfgate.abworker import Hello
from perfgate.stats import pair_ratio_interval
from perfgate.workers import Pool

LIBRARY = ("kernels", "reference", "workloads")


def _param(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, (value == "True" if value in ("True", "False") else value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test", help="path/to/test_file.py::test_function")
    parser.add_argument("params", nargs="*", type=_param, help="the test's parameters, name=value")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--calls", type=int, default=3, help="calls a block times, none untimed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duet", action="store_true", help="after each ABBA pair, a pair timed at once")
    args = parser.parse_args()
    path, _, function = args.test.partition("::")
    root = Path.cwd()
    hello = {side: Hello(side=side, root=str(root), library=LIBRARY, device="cpu", size="smoke",
                         threads=args.threads, malloc="cache") for side in ("rev", "this")}
    pool = Pool(hello, per_side=2)
    pool.start()
    rng = random.Random(args.seed)
    request = {"row": "row", "module": Path(path).stem, "path": str(root / path), "function": function,
               "params": dict(args.params), "kernel": function, "impl": "impl"}
    try:
        copies = {}
        for worker in pool.workers:
            reply = pool.ask(worker, "build", 600.0, builds=3, build_s=3.0, **request)
            assert reply["ok"], reply
            copies[(worker.side, worker.index)] = reply["builds"]
            warm_s = reply["warm_s"]

        def block(side: str) -> list[float]:
            worker = rng.choice(pool.side(side))
            copy = rng.randrange(copies[(side, worker.index)])
            reply = pool.ask(worker, "block", 600.0, row="row", calls=args.calls, warm=0, build=copy)
            assert reply["ok"], reply
            return reply["times"]

        def duet() -> dict[str, list[float]]:
            # both sides' blocks at once, one on each vCPU: they share the host's phase
            chosen = {}
            for side in ("rev", "this"):
                worker = rng.choice(pool.side(side))
                copy = rng.randrange(copies[(side, worker.index)])
                worker.conn.send(("block", {"row": "row", "calls": args.calls, "warm": 0, "build": copy}))
                chosen[side] = worker
            return {side: pool._answer(worker, 600.0)["times"] for side, worker in chosen.items()}

        rev, this, drev, dthis = [], [], [], []
        for i in range(args.pairs):
            order = ("rev", "this") if i % 2 == 0 else ("this", "rev")
            got = {side: block(side) for side in order}
            rev.append(got["rev"])
            this.append(got["this"])
            if args.duet:
                got = duet()
                drev.append(got["rev"])
                dthis.append(got["this"])
    finally:
        pool.close()
    report(args, rev, this, warm_s, "sequential (ABBA)")
    if args.duet:
        report(args, drev, dthis, warm_s, "at once (duet)")


def report(args: argparse.Namespace, rev: list, this: list, warm_s: float, how: str) -> None:
    """Per call position of a block: spreads and the sign test's intervals, then every pair's calls."""
    rev_a, this_a = np.array(rev), np.array(this)
    print(how)
    print(f"{args.test} {dict(args.params)}: {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s), malloc cache, 2 workers a side, {args.pairs} ABBA pairs of "
          f"{args.calls} calls (no warming call); a warm call {warm_s * 1e3:.1f} ms")
    print("call  median ms  sd log(block)  sd log(pair ratio)  sign-test 95% CI of the median pair ratio "
          "(first n pairs: width)")
    half = args.pairs // 2
    for k in range(args.calls):
        r, t = rev_a[:, k], this_a[:, k]
        logs = np.log(np.concatenate([r, t]))
        ratios = np.log(r / t)
        widths = []
        for n in (half, args.pairs):
            _, low, high = pair_ratio_interval(r[:n], t[:n])
            widths.append(f"n={n}: {low:.3f}-{high:.3f} ({high / low - 1:.3f})")
        print(f"{k:>4}  {statistics.median(np.concatenate([r, t])) * 1e3:9.1f}  {logs.std():13.3f}  "
              f"{ratios.std():18.3f}  {'; '.join(widths)}")
    if args.calls > 1:
        print("first call's share over the second's, median of blocks:",
              f"{statistics.median(np.concatenate([rev_a[:, 0] / rev_a[:, 1], this_a[:, 0] / this_a[:, 1]])):.3f}")
    print("per pair, ms (rev calls | this calls):")
    for r, t in zip(rev, this, strict=True):
        print("  " + " ".join(f"{x * 1e3:.0f}" for x in r) + " | " + " ".join(f"{x * 1e3:.0f}" for x in t))


if __name__ == "__main__":
    main()
