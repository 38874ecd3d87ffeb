"""SMG in front of Pagoda: one W48-like load over two schedulers through the router vs one
scheduler direct, and the router's added latency per request at one stream.

    python bench/bench_router.py                        # both parts, services spawned here
    python bench/bench_router.py --part load --num-requests 48 --prompt-len 32:384 --output-len 16:160

Part `load`: the same 48 requests (prompt 32-384 tokens, output 16-160, ignore_eos, greedy, all at
once) (a) streamed over pagoda.v1 to one scheduler with one executor, (b) streamed as OpenAI
completions to `smg launch --backend vllm` in front of two schedulers with one executor each.
The executors' threads are split so both sides use the same cores (`--threads`: one executor of
N threads vs two of N/2).

Part `latency`: one request at a time (`--latency-requests`, prompt 32, output 16) to ONE
scheduler: over pagoda.v1, over vllm.grpc.engine directly, and through SMG. The router's added
latency is SMG minus VllmEngine direct (same scheduler, same engine protocol; the difference is
the router's HTTP front, tokenization, routing and detokenization).

The router takes text (its completions API has no token-id prompts), so prompts are random
token ids decoded to text; every path sends that text and the scheduler or router tokenizes it
(the lengths are those token counts). Times are client-side. On a shared machine, quote the
ratios of one run, measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402
import httpx2 as httpx  # noqa: E402
from smg_grpc_proto import vllm_engine_pb2 as vpb  # noqa: E402
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc  # noqa: E402

from bench.common import (  # noqa: E402
    OUT_DIR,
    SAFE_TOKEN_IDS,
    LengthDist,
    RequestRecord,
    machine_info,
    machine_line,
    metrics_table,
    summarize,
    timestamp,
    write_json,
)
from bench.smg_router import DETERMINISTIC_ROUTING, SmgRouter  # noqa: E402
from pagoda.v1 import generation_pb2 as pb  # noqa: E402
from pagoda.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from tests.service.harness import Service  # noqa: E402


def text_prompts(lengths: list[int], seed: int) -> list[tuple[str, int]]:
    """(text, its token count) per length: random token ids decoded (the tokenizer's own text)."""
    from transformers import AutoTokenizer

    from pagoda.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None, weights=False)))
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        text = tokenizer.decode([rng.randint(*SAFE_TOKEN_IDS) for _ in range(n)])
        prompts.append((text, len(tokenizer.encode(text, add_special_tokens=False))))
    return prompts


# ---- one request over each path ------------------------------------------------------------


async def pagoda_one(stub, text: str, max_tokens: int, record: RequestRecord) -> None:
    req = pb.GenerateRequest(text=text)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens, req.stopping.ignore_eos = max_tokens, True
    record.start = time.perf_counter()
    try:
        async for response in stub.Generate(req, timeout=3600):
            n = sum(len(o.token_ids) for o in response.outputs)
            if n:
                record.token_times.append(time.perf_counter())
                record.token_counts.append(n)
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    record.end = time.perf_counter()


async def vllm_one(stub, text: str, max_tokens: int, record: RequestRecord) -> None:
    req = vpb.GenerateRequest(
        text=text, stream=True, sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    record.start = time.perf_counter()
    try:
        async for response in stub.Generate(req, timeout=3600):
            if response.WhichOneof("response") == "chunk" and response.chunk.token_ids:
                record.token_times.append(time.perf_counter())
                record.token_counts.append(len(response.chunk.token_ids))
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    record.end = time.perf_counter()


async def router_one(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int, record: RequestRecord) -> None:
    """An OpenAI streamed completion; each SSE chunk with text counts as one token, the last one
    the rest of the usage's completion tokens (the router sends text deltas, not ids)."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    record.start = time.perf_counter()
    usage = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as reply:
            if reply.status_code != 200:
                record.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", ())):
                    record.token_times.append(time.perf_counter())
                    record.token_counts.append(1)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    if record.token_counts and usage:
        record.token_counts[-1] += usage - sum(record.token_counts)


async def run_all(one, prompts, max_tokens: list[int], concurrency: int | None) -> tuple[list[RequestRecord], float, float]:
    records = [RequestRecord(i, n, m) for i, ((_, n), m) in enumerate(zip(prompts, max_tokens))]
    limit = asyncio.Semaphore(concurrency or len(records))

    async def go(i: int) -> None:
        async with limit:
            await one(prompts[i][0], max_tokens[i], records[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(go(i) for i in range(len(records))))
    return records, t0, max(r.end for r in records)


def run_pagoda(port: int, prompts, max_tokens, concurrency=None):
    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await run_all(lambda t, m, r: pagoda_one(stub, t, m, r), prompts, max_tokens, concurrency)

    return asyncio.run(main())


def run_vllm(port: int, prompts, max_tokens, concurrency=None):
    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vpb_grpc.VllmEngineStub(channel)
            return await run_all(lambda t, m, r: vllm_one(stub, t, m, r), prompts, max_tokens, concurrency)

    return asyncio.run(main())


def run_router(router: SmgRouter, model: str, prompts, max_tokens, concurrency=None):
    async def main():
        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
        async with httpx.AsyncClient(limits=limits) as client:
            return await run_all(
                lambda t, m, r: router_one(client, router.url, model, t, m, r), prompts, max_tokens, concurrency
            )

    return asyncio.run(main())


# ---- the two parts -------------------------------------------------------------------------


def start(services: list[Service]) -> None:
    for svc in services:  # one after the other: two model loads at once on 2 cores double both
        svc.start()


def part_load(args, prompts, max_tokens) -> dict:
    one = Service(executor_args=["--num-threads", str(args.threads)])
    pair = [Service(executor_args=["--num-threads", str(max(args.threads // 2, 1))]) for _ in range(2)]
    results = {}
    try:
        start([one])
        model = one.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).name
        run_pagoda(one.port, prompts[:2], [8, 8])  # warm-up: first kernels and allocations
        results["1 scheduler direct"] = summarize(*run_pagoda(one.port, prompts, max_tokens))
    finally:
        one.stop()
    try:
        start(pair)
        with SmgRouter([f"grpc://127.0.0.1:{s.port}" for s in pair], DETERMINISTIC_ROUTING) as router:
            run_router(router, model, prompts[:4], [8] * 4)  # warm-up: both schedulers
            results["SMG + 2 schedulers"] = summarize(*run_router(router, model, prompts, max_tokens))
    finally:
        for svc in pair:
            svc.stop()
    return results


def part_latency(args) -> dict:
    lengths = [32] * args.latency_requests
    prompts = text_prompts(lengths, args.seed + 1)
    max_tokens = [16] * args.latency_requests
    svc = Service(executor_args=["--num-threads", str(args.threads)])
    results = {}
    try:
        start([svc])
        model = svc.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).name
        with SmgRouter([f"grpc://127.0.0.1:{svc.port}"], DETERMINISTIC_ROUTING) as router:
            run_pagoda(svc.port, prompts[:2], [4, 4], 1)  # warm-up, every path
            run_vllm(svc.port, prompts[:2], [4, 4], 1)
            run_router(router, model, prompts[:2], [4, 4], 1)
            for _ in range(args.rounds):  # interleaved rounds: drift on a shared machine hits all three alike
                for name, run in (
                    ("pagoda.v1 direct", lambda: run_pagoda(svc.port, prompts, max_tokens, 1)),
                    ("VllmEngine direct", lambda: run_vllm(svc.port, prompts, max_tokens, 1)),
                    ("through SMG", lambda: run_router(router, model, prompts, max_tokens, 1)),
                ):
                    records, _, _ = run()
                    results.setdefault(name, []).extend(records)
    finally:
        svc.stop()
    return {name: summarize(r, min(x.start for x in r), max(x.end for x in r)) for name, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["load", "latency", "both"], default="both")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prompt-len", default="32:384")
    parser.add_argument("--output-len", default="16:160")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="executor threads in all (split over the two)")
    parser.add_argument("--latency-requests", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="latency: interleaved rounds over the three paths")
    args = parser.parse_args()
    machine = machine_info()
    out: dict = {"machine": machine, "args": vars(args)}
    print(f"machine   {machine_line(machine)}")
    if args.part in ("load", "both"):
        rng = random.Random(args.seed)
        lengths = LengthDist(args.prompt_len).sample(rng, args.num_requests)
        max_tokens = LengthDist(args.output_len).sample(rng, args.num_requests)
        prompts = text_prompts(lengths, args.seed)
        out["load"] = part_load(args, prompts, max_tokens)
        print(f"\nload      {args.num_requests} requests, prompt U[{args.prompt_len}] tokens (as text), output "
              f"U[{args.output_len}] (ignore_eos, greedy), all at once; {args.threads} executor threads either way")
        print(metrics_table(out["load"], ratio_of=("SMG + 2 schedulers", "1 scheduler direct")))
    if args.part in ("latency", "both"):
        out["latency"] = part_latency(args)
        print(f"\nlatency   one stream, {args.latency_requests} requests x {args.rounds} rounds, prompt 32 tokens, "
              f"output 16, one scheduler")
        print(metrics_table(out["latency"], ratio_of=("through SMG", "VllmEngine direct")))
        lat = out["latency"]
        for key in ("ttft_p50_ms", "e2e_p50_ms"):
            added = lat["through SMG"][key] - lat["VllmEngine direct"][key]
            print(f"router's added latency, {key[:-7].upper()} p50: {added:+.1f} ms")
    path = write_json(OUT_DIR / f"router-{timestamp()}.json", out)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
