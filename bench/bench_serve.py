"""Executor start-up time and output tokens/s for N concurrent greedy chat requests.

    .venv/bin/python bench/bench_serve.py [--concurrency 16] [--max-tokens 128]

Starts the real services (scheduler + one CPU executor, default model), times the executor
from process start to registered (health SERVING with one healthy executor), then sends N
greedy chat requests at once and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.service.harness import Service, greedy_request  # noqa: E402

QUESTIONS = [
    "Explain how a refrigerator works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Describe the water cycle.", "How do vaccines work?",
    "Give advice for a first job interview.", "Explain recursion to a child.", "What is a black hole?",
    "Describe the history of the bicycle.", "How does a compiler work?", "What makes a good team leader?",
    "Explain the rules of chess briefly.", "Why is the sky blue?", "How do plants grow?",
    "What is machine learning?", "Describe a healthy breakfast.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    svc = Service(num_executors=0)
    svc.start()
    try:
        started = time.monotonic()
        svc.add_executor()
        svc.wait_serving(1)
        startup_s = time.monotonic() - started

        def run(i: int):
            req = greedy_request(chat=[("user", QUESTIONS[i % len(QUESTIONS)])], max_tokens=args.max_tokens)
            t0, ttft, n = time.monotonic(), None, 0
            for response in svc.stub.Generate(req, timeout=1800):
                for out in response.outputs:
                    if out.token_ids and ttft is None:
                        ttft = time.monotonic() - t0
                    n += len(out.token_ids)
            return n, ttft, time.monotonic() - t0

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(run, range(args.concurrency)))
        wall = time.monotonic() - t0
    finally:
        svc.stop()
    tokens = sum(r[0] for r in results)
    ttfts = sorted(r[1] for r in results)
    row = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (float32, CPU)",
        "executor_startup_s": round(startup_s, 2),
        "concurrency": args.concurrency,
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_max_s": round(ttfts[-1], 3),
    }
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
