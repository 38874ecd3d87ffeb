"""The added cost of OpenAI's Responses API and Anthropic's Messages API over chat completions,
through one gateway on one service (issue 41's Measure; aim: within 5%).

    python bench/bench_agent_apis.py [--rounds 20] [--num-requests 48] [--model DIR]

Spawns a scheduler + executor (the default model, prefix caching off so that no API reuses
another's prompts) and a gateway, then sends the same messages through `/v1/chat/completions`,
`/v1/responses` and `/v1/messages` (not streamed, greedy):

1. one short request (a one-line question, 16 output tokens at most): p50 latency of `--rounds`
   requests per API, the APIs taking turns;
2. W48: `--num-requests` requests at once (prompts of 32-384 words, max tokens 16-160, seeded),
   one API after the other, `--w48-rounds` times with the order rotated each round (a noisy
   machine then slows every API alike); output tokens/s from each reply's usage, the median of
   the rounds per API.

Each API's tokens must equal chat's (the same greedy answers), else the run stops.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import httpx2 as httpx  # noqa: E402

from bench.common import format_table, machine_info, machine_line, percentile  # noqa: E402

APIS = ("chat", "responses", "messages")
WORDS = ("river stone cloud garden lamp window music paper orange violet bridge forest winter coffee engine "
         "planet signal harbor candle market silver thunder meadow lantern compass ribbon").split()


def request_of(api: str, model: str, text: str, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one greedy request of `text` as a user message."""
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": max_tokens, "temperature": 0}
    if api == "responses":
        return "/v1/responses", {"model": model, "input": text, "max_output_tokens": max_tokens, "temperature": 0,
                                 "store": False}
    return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                            "temperature": 0}


def output_tokens(api: str, reply: dict) -> int:
    usage = reply["usage"]
    return usage["completion_tokens"] if api == "chat" else usage["output_tokens"]


async def send(client: httpx.AsyncClient, api: str, model: str, text: str, max_tokens: int) -> int:
    path, body = request_of(api, model, text, max_tokens)
    reply = await client.post(path, json=body)
    reply.raise_for_status()
    return output_tokens(api, reply.json())


def w48(num_requests: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(32, 384))), rng.randint(16, 160))
            for _ in range(num_requests)]


async def measure(url: str, model: str, rounds: int, num_requests: int, w48_rounds: int) -> tuple[dict, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        for api in APIS:  # warm: each route once
            await send(client, api, model, "Hello.", 4)
        latency: dict[str, list[float]] = {api: [] for api in APIS}
        question = "What is the capital of France? Answer in one sentence."
        tokens: dict[str, set[int]] = {api: set() for api in APIS}
        for i in range(rounds):
            for api in APIS[i % 3:] + APIS[: i % 3]:
                t0 = time.perf_counter()
                tokens[api].add(await send(client, api, model, question, 16))
                latency[api].append(time.perf_counter() - t0)
        assert len({frozenset(t) for t in tokens.values()}) == 1, f"APIs answered differently: {tokens}"
        load = w48(num_requests)
        rates: dict[str, list[float]] = {api: [] for api in APIS}
        counts = {}
        for r in range(w48_rounds):
            for api in APIS[r % 3:] + APIS[: r % 3]:
                t0 = time.perf_counter()
                counts[api] = await asyncio.gather(*(send(client, api, model, text, n) for text, n in load))
                rates[api].append(sum(counts[api]) / (time.perf_counter() - t0))
                print(f"W{num_requests} round {r + 1} {api}: {rates[api][-1]:.1f} out tok/s", flush=True)
            assert all(counts[api] == counts["chat"] for api in APIS), "APIs answered W48 with different lengths"
    return latency, {api: statistics.median(rates[api]) for api in APIS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="short requests per API")
    parser.add_argument("--num-requests", type=int, default=48, help="requests of the W48 load")
    parser.add_argument("--w48-rounds", type=int, default=3, help="W48 runs per API, the order rotated each round")
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    parser.add_argument("--executor-args", default="--num-kv-blocks 2048", help="extra executor flags")
    args = parser.parse_args()

    from tests.client.services import target
    from tests.gateway.gateway import Gateway
    from tests.service.harness import Service

    info = machine_info()
    with Service(args.model, ["--no-enable-prefix-caching"], args.executor_args.split()) as svc, \
            Gateway(target(svc)) as gw:
        model = httpx.get(f"{gw.url}/v1/models", timeout=60).json()["data"][0]["id"]
        latency, throughput = asyncio.run(measure(gw.url, model, args.rounds, args.num_requests, args.w48_rounds))
    p50 = {api: percentile(latency[api], 50) * 1000 for api in APIS}
    rows = [[api, p50[api], p50[api] / p50["chat"], throughput[api], throughput[api] / throughput["chat"]]
            for api in APIS]
    print(machine_line(info))
    print(f"model {model}; short request: {args.rounds} per API, 16 tokens at most; "
          f"W{args.num_requests}: prompts 32-384 words, 16-160 tokens, all at once, median of {args.w48_rounds} rotated rounds; "
          "not streamed, greedy")
    print(format_table(["API", "p50 ms", "x chat", "W48 out tok/s", "x chat"], rows))


if __name__ == "__main__":
    main()
