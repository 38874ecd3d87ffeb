"""Speculative decoding (prompt lookup) side by side: tokens/s with and without drafts.

    nice python bench/bench_spec_decode.py [--num-speculative-tokens 4] [--output-len 64]

Three workloads on the default model, `ignore_eos`, exact output lengths:
  * repeat: "repeat this paragraph with one change" chats, greedy: prompt lookup helps;
  * random: random token-id prompts (as loadgen's), greedy: the model tends to repeat
    itself on them, which prompt lookup also finds;
  * random-t1: the same prompts sampled at temperature 1 (seeded): text that prompt
    lookup cannot predict, where drafts are rejected and should cost next to nothing.
Each runs with 1 and 4 concurrent streams on two services up at once (a scheduler and a
CPU executor each, speculation off and on), alternating between them `--rounds` times;
the table prints median tokens/s, their ratio and the acceptance rate (accepted / draft
tokens, from the scheduler's metrics).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

from bench.common import machine_info, machine_line  # noqa: E402
from tests.service.harness import Service, chat_ids, collect, greedy_request  # noqa: E402

PARAGRAPHS = [
    "The scheduler owns every KV block and plans each step within a token budget. Running requests go first, "
    "then waiting ones fill what budget is left, and a request that cannot get a block preempts the latest one.",
    "Executors connect to the scheduler, register their model and their cache, and heartbeat. An executor that "
    "dies is detected within seconds and its requests resume on a survivor with the tokens generated so far.",
    "Prefix caching hashes each full block with its parent's hash, so a shared system prompt is computed once. "
    "A hit never covers the last prompt token, whose logits the executor must compute to sample the next one.",
    "Beam search keeps the best sequences by cumulative log probability and forks beams on shared blocks, "
    "copying only the last partial block when two beams diverge, exactly as copy-on-write memory does.",
]
CHANGES = ["the word 'every' removed", "'seconds' replaced by 'moments'", "'once' replaced by 'one time'", "'exactly' removed"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^pagoda:{name}_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _request(prompt: list[int], output_len: int, temperature: float, seed: int):
    request = greedy_request(prompt_ids=prompt, max_tokens=output_len, ignore_eos=True)
    if temperature:
        request.sampling.temperature, request.sampling.seed = temperature, seed
    return request


def _run(svc: Service, prompts: list[list[int]], output_len: int, streams: int, temperature: float = 0.0) -> tuple[float, float]:
    """(tokens/s, acceptance rate) of `prompts`, `streams` at a time."""
    url = f"http://127.0.0.1:{svc.metrics_port}/metrics"
    before = urllib.request.urlopen(url, timeout=10).read().decode()
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(
            pool.map(
                lambda ip: collect(svc.stub.Generate(_request(ip[1], output_len, temperature, ip[0]), timeout=900)),
                enumerate(prompts),
            )
        )
    elapsed = time.perf_counter() - start
    after = urllib.request.urlopen(url, timeout=10).read().decode()
    tokens = sum(len(r["outputs"][0]["token_ids"]) for r in results)
    drafts = _metric(after, "spec_decode_num_draft_tokens") - _metric(before, "spec_decode_num_draft_tokens")
    accepted = _metric(after, "spec_decode_num_accepted_tokens") - _metric(before, "spec_decode_num_accepted_tokens")
    return tokens / elapsed, (accepted / drafts if drafts else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--random-prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each case per mode (the table shows medians)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pagoda.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    repeat = [
        chat_ids(tokenizer, f"Repeat this paragraph word for word, with {change}:\n\n{paragraph}")
        for paragraph, change in zip(PARAGRAPHS, CHANGES)
    ]
    rng = random.Random(0)
    rand = [[rng.randrange(100, 40_000) for _ in range(args.random_prompt_len)] for _ in range(4)]
    workloads = {"repeat": (repeat, 0.0), "random": (rand, 0.0), "random-t1": (rand, 1.0)}

    spec = ["--speculative-method", "ngram", "--num-speculative-tokens", str(args.num_speculative_tokens)]
    runs: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    with Service() as off, Service(scheduler_args=spec) as on:
        services = {"off": off, "on": on}
        for svc in services.values():
            _run(svc, repeat[:1], 8, 1)  # warm-up
        for _ in range(args.rounds):  # alternate off / on, so that others' load hits both alike
            for name, (prompts, temperature) in workloads.items():
                for streams in (1, 4):
                    for mode, svc in services.items():
                        figures_of = runs.setdefault((name, streams, mode), [])
                        figures_of.append(_run(svc, prompts[:streams], args.output_len, streams, temperature))
    figures = {key: (statistics.median(r for r, _ in values), statistics.median(a for _, a in values)) for key, values in runs.items()}

    print(machine_line(machine_info()))
    print(f"model SmolLM2-135M-Instruct (default), {args.output_len} tokens per request, "
          f"ngram drafts k={args.num_speculative_tokens}, one CPU executor per service, median of {args.rounds} alternated runs")
    print(f"{'workload':8} {'streams':>7} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'acceptance':>10}")
    for (name, streams, mode), (rate, _) in figures.items():
        if mode != "off":
            continue
        on_rate, acceptance = figures[(name, streams, "on")]
        print(f"{name:8} {streams:7d} {rate:10.1f} {on_rate:10.1f} {on_rate / rate:6.2f} {acceptance:10.2f}")


if __name__ == "__main__":
    main()
