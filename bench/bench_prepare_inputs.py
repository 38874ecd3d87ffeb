"""The executor's per-step input building (`ModelRunner.prepare_inputs`), alone, at a batch size.

    .venv/bin/python bench/bench_prepare_inputs.py                       # this tree
    .venv/bin/python bench/bench_prepare_inputs.py --trees /path/a /path/b --rounds 3

A tiny random Llama (the step's forward pass is not timed); `--requests` decodes of
`--context` tokens each (block size 16), plus one 256-token prefill chunk with `--with-prefill`.
Times `prepare_inputs` of the same plan many times; with several `--trees` (checkouts of
this repository, say before and after a change) it runs each in its own process, rounds
interleaved, and prints one table with the best round of each, so the ratio is side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(requests: int, context: int, with_prefill: bool, iters: int) -> dict:
    sys.path.insert(0, os.getcwd())
    import torch

    from bench.fuzz import tiny_model
    from executor_svc.model_runner import ModelRunner
    from pagoda.step import NewRequestData, SamplingParams, StepPlan

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        runner = ModelRunner(tiny_model(Path(tmp)), device="cpu", num_kv_blocks=requests * (context // 16 + 2) + 64)
        block = 1
        new = []
        for i in range(requests + with_prefill):
            length = 256 if i == requests else context
            nb = -(-(length + 1) // 16)
            new.append(NewRequestData(f"r{i}", list(range(3, 3 + length)), length, SamplingParams(), list(range(block, block + nb)),
                                      0 if i == requests else length - 1))
            block += nb
        runner.update_states(StepPlan(step_id=0, new_requests=new))
        plan = StepPlan(step_id=1, num_scheduled_tokens={n.req_id: (256 if n.num_computed_tokens == 0 else 1) for n in new})
        for _ in range(20):
            runner.prepare_inputs(plan)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.prepare_inputs(plan)
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_ms": 1e3 * times[len(times) // 2], "best_ms": 1e3 * times[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="*", default=[str(ROOT)])
    parser.add_argument("--requests", type=int, nargs="*", default=[1, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--with-prefill", action="store_true")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({n: measure(n, args.context, args.with_prefill, args.iters) for n in args.requests}))
        return 0
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--context", str(args.context), "--iters", str(args.iters),
                   "--requests", *map(str, args.requests)] + (["--with-prefill"] if args.with_prefill else [])
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            for n, figures in json.loads(out).items():
                key = (tree, int(n))
                best[key] = min(best.get(key, float("inf")), figures["median_ms"])
    print(f"prepare_inputs, median ms per step (best of {args.rounds} rounds), context {args.context}"
          + (", + one 256-token prefill" if args.with_prefill else ""))
    print("| tree | " + " | ".join(f"{n} requests" for n in args.requests) + " |")
    print("|---|" + "---|" * len(args.requests))
    for tree in args.trees:
        print(f"| {tree} | " + " | ".join(f"{best[(tree, n)]:.3f}" for n in args.requests) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
