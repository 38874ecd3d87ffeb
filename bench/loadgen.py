"""gRPC load generator for Pagoda: a workload of exact-length greedy requests, streamed.

    python bench/loadgen.py --spawn                      # start scheduler + 1 CPU executor, run, stop
    python bench/loadgen.py --target 127.0.0.1:50051     # a service that is already running
    python bench/loadgen.py --spawn --num-requests 16 --prompt-len 64:256 --output-len 32 \
        --request-rate 4 --scheduler-args "--max-num-batched-tokens 512" --executor-args "--num-threads 2"

Each request sends its prompt as token ids with temperature 0, `max_tokens` = its output
length and `ignore_eos`, so every request produces exactly that many tokens. Requests go all
at once (default), at most `--max-concurrency` in flight, or at Poisson `--request-rate`.
Prints a table (machine, model, workload, throughput, TTFT / ITL / TPOT / E2E percentiles),
writes JSON and, with matplotlib installed, a PNG of latency CDFs and tokens/s over time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402

from bench.common import (  # noqa: E402
    OUT_DIR,
    RequestRecord,
    RequestSpec,
    RunQueueSampler,
    add_workload_flags,
    exit_on_sigterm,
    machine_info,
    machine_line,
    metrics_table,
    plot_runs,
    records_json,
    summarize,
    timestamp,
    workload_from_args,
    write_json,
)
from pagoda.cli import add_flag  # noqa: E402
from pagoda.client.connection import Connection, TLSConfig  # noqa: E402
from pagoda.v1 import generation_pb2 as pb  # noqa: E402
from pagoda.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

# How this run reaches a --target: API key and TLS (add_service_flags; set by service_target).
_CONNECTION = Connection(())


def make_request(spec: RequestSpec) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(spec.prompt_ids)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = spec.max_tokens
    req.stopping.ignore_eos = True
    return req


async def _stream_one(stub, spec: RequestSpec, record: RequestRecord, timeout_s: float, make=make_request) -> None:
    record.start = time.perf_counter()
    try:
        async for response in stub.Generate(make(spec), timeout=timeout_s, metadata=_CONNECTION.metadata()):
            now = time.perf_counter()
            n = 0
            for out in response.outputs:
                if out.index == 0:
                    n += len(out.token_ids)
                    record.token_ids.extend(out.token_ids)
            if n:
                record.token_times.append(now)
                record.token_counts.append(n)
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    record.end = time.perf_counter()


async def run_requests(
    target: str, specs: list[RequestSpec], max_concurrency: int | None = None, timeout_s: float = 3600.0, make=make_request
) -> tuple[list[RequestRecord], float, float]:
    """Stream every request (each at its arrival time, at most `max_concurrency` at once);
    return the records and the run's start and end (perf_counter seconds). `make` builds
    each spec's GenerateRequest."""
    records = [RequestRecord(s.index, len(s.prompt_ids), s.max_tokens) for s in specs]
    limit = asyncio.Semaphore(max_concurrency or len(specs) or 1)
    async with _CONNECTION.aio_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await channel.channel_ready()
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, record: RequestRecord) -> None:
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                await _stream_one(stub, spec, record, timeout_s, make)

        await asyncio.gather(*(one(s, r) for s, r in zip(specs, records)))
        t_end = max([t0, *(r.end for r in records)])
    return records, t0, t_end


def warm_up(target: str, num_requests: int = 2, timeout_s: float = 300.0) -> None:
    """A few short requests first, so one-time costs (first kernels, allocations) are not measured."""
    if num_requests <= 0:
        return
    specs = [RequestSpec(i, [1000 + 7 * j for j in range(48)], 8, 0.0) for i in range(num_requests)]
    records, _, _ = asyncio.run(run_requests(target, specs, timeout_s=timeout_s))
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[0]}")


def server_snapshot(target: str) -> dict:
    with _CONNECTION.channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=_CONNECTION.metadata())
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30, metadata=_CONNECTION.metadata())
    return {
        "model": model.name,
        "max_model_len": model.max_model_len,
        "block_size": model.block_size,
        "version": info.version,
        "num_preemptions": info.num_preemptions,
        "executors": [
            {"id": e.executor_id, "device": e.device, "num_total_blocks": e.num_total_blocks} for e in info.executors
        ],
    }


def run_pagoda(
    target: str, specs: list[RequestSpec], max_concurrency: int | None, warmup: int = 2, timeout_s: float = 1800.0,
    make=make_request,
) -> dict:
    """Warm up, run the workload, and return records, times, summary and server facts."""
    warm_up(target, warmup)
    before = server_snapshot(target)
    with RunQueueSampler() as load:
        records, t0, t_end = asyncio.run(run_requests(target, specs, max_concurrency, timeout_s, make))
    after = server_snapshot(target)
    summary = summarize(records, t0, t_end)
    summary["num_preemptions"] = after["num_preemptions"] - before["num_preemptions"]
    summary["runnable_tasks"] = load.mean()
    return {"records": records, "t0": t0, "t_end": t_end, "summary": summary, "server": after}


# ---------------------------------------------------------------- service


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("service")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--target", help="host:port of a running Pagoda service")
    where.add_argument("--spawn", action="store_true", help="start scheduler + executors (tests/service/harness.py)")
    g.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument("--num-executors", type=int, default=1)
    g.add_argument(
        "--scheduler-args", default="", help='extra scheduler flags, e.g. "--max-num-batched-tokens 512" (one flag alone: use =)'
    )
    g.add_argument("--executor-args", default="", help='extra executor flags, e.g. "--num-threads 2"')
    # for --target, as the `pagoda` CLI's (pagoda.client.flags; its --target is ours above)
    add_flag(g, "--api-key", help="sent as `authorization: Bearer <key>`")
    add_flag(g, "--ssl-ca-certs", help="TLS: the CA that signed the scheduler's certificate")
    add_flag(g, "--ssl-certfile", help="mutual TLS: client certificate")
    add_flag(g, "--ssl-keyfile", help="mutual TLS: its private key")


@contextlib.contextmanager
def service_target(args, scheduler_args: str | None = None):
    """Yield host:port: `--target` as given, else a spawned service that stops afterwards."""
    if args.target:
        global _CONNECTION
        tls = TLSConfig.from_files(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile) if args.ssl_ca_certs or args.ssl_certfile else None
        _CONNECTION = Connection((args.target,), args.api_key, tls)
        yield args.target
        return
    from tests.service.harness import Service

    sched = shlex.split(args.scheduler_args if scheduler_args is None else scheduler_args)
    svc = Service(args.model, sched, shlex.split(args.executor_args), args.num_executors)
    print(f"starting Pagoda: scheduler {sched or '(defaults)'}, {args.num_executors} executor(s) "
          f"{shlex.split(args.executor_args) or '(defaults)'}; logs in {svc.logdir}", flush=True)
    with svc:
        try:
            yield f"127.0.0.1:{svc.port}"
        except BaseException:
            print(svc.logs())
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    add_service_flags(parser)
    parser.add_argument("--warmup", type=int, default=2, help="short requests sent before the measured run")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="gRPC deadline of each request, s")
    parser.add_argument("--label", default="pagoda")
    parser.add_argument("--out", default=None, help=f"JSON path (default {OUT_DIR}/loadgen-<time>.json)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    if not args.target and not args.spawn:
        parser.error("give --target host:port or --spawn")

    workload = workload_from_args(args)
    specs = workload.build(args.model)
    machine = machine_info()
    with service_target(args) as target:
        result = run_pagoda(target, specs, workload.max_concurrency, args.warmup, args.request_timeout)

    server = result["server"]
    devices = ", ".join(e["device"] for e in server["executors"])
    print()
    print(f"machine   {machine_line(machine)}")
    print(f"model     {server['model']} on {len(server['executors'])} executor(s): {devices}")
    print(f"service   {args.target or 'spawned'}: scheduler {args.scheduler_args or '(defaults)'}; "
          f"executor {args.executor_args or '(defaults)'}")
    print(f"workload  {workload.describe()}")
    print(f"preemptions during the run: {result['summary']['num_preemptions']}")
    print()
    print(metrics_table({args.label: result["summary"]}))

    stem = OUT_DIR / f"loadgen-{timestamp()}"
    out = write_json(
        stem.with_suffix(".json") if args.out is None else Path(args.out),
        {
            "machine": machine,
            "server": server,
            "workload": workload,
            "summary": result["summary"],
            "requests": records_json(result["records"], result["t0"]),
        },
    )
    print(f"\nJSON: {out}")
    if not args.no_plot:
        png = plot_runs(
            {args.label: (result["records"], result["t0"], result["t_end"])},
            out.with_suffix(".png"),
            f"{server['model']}: {workload.describe()}",
        )
        if png:
            print(f"plot: {png}")


if __name__ == "__main__":
    main()
