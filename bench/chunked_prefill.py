"""Chunked prefill: do running streams stall when a long prompt arrives?

    python bench/chunked_prefill.py                              # budgets 256 (chunked) and 4096 (not)
    python bench/chunked_prefill.py --budgets 128,512,4096 --long-prompt-len 2048 --streams 8

For each token budget (`--max-num-batched-tokens`), a fresh service runs `--streams` greedy
decode streams; once each has `--arrive-after-tokens` tokens, one request with a
`--long-prompt-len`-token prompt arrives. With a small budget the scheduler splits that prompt
into chunks that share each step with the streams' decodes; with a budget >= the prompt, one
step computes the whole prompt and every stream waits for it. The streams are cancelled
`--tail-s` seconds after the long request finishes.

Prints, per budget: the streams' inter-token latency (ITL) before the arrival, over the whole
run and within the window from the arrival to the long request's first token (p50 / p99 / max),
the long request's TTFT, and the streams' tokens/s; draws ITL over time with the arrival marked.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import grpc  # noqa: E402

from bench.common import (  # noqa: E402
    OUT_DIR,
    SAFE_TOKEN_IDS,
    RequestRecord,
    RequestSpec,
    RunQueueSampler,
    exit_on_sigterm,
    format_table,
    machine_info,
    machine_line,
    percentile,
    pyplot,
    timestamp,
    write_json,
)
from bench.loadgen import make_request, server_snapshot, warm_up  # noqa: E402
from pagoda.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


async def _stream(stub, spec: RequestSpec, record: RequestRecord, calls: dict) -> None:
    record.start = time.perf_counter()
    call = stub.Generate(make_request(spec), timeout=1800)
    calls[spec.index] = call
    try:
        async for response in call:
            n = sum(len(o.token_ids) for o in response.outputs if o.index == 0)
            if n:
                record.token_times.append(time.perf_counter())
                record.token_counts.append(n)
    except asyncio.CancelledError:
        pass  # we cancelled the stream at the end of the run
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            record.error = f"{e.code().name}: {e.details()}"
    record.end = time.perf_counter()


async def run_experiment(target: str, args, seed: int) -> dict:
    import random

    rng = random.Random(seed)
    low, high = SAFE_TOKEN_IDS
    ids = lambda n: [rng.randint(low, high) for _ in range(n)]  # noqa: E731
    streams = [RequestSpec(i, ids(args.stream_prompt_len), args.stream_max_tokens, 0.0) for i in range(args.streams)]
    long = RequestSpec(args.streams, ids(args.long_prompt_len), args.long_output_len, 0.0)
    records = [RequestRecord(s.index, len(s.prompt_ids), s.max_tokens) for s in [*streams, long]]
    calls: dict = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_stream(stub, s, r, calls)) for s, r in zip(streams, records)]
        deadline = time.perf_counter() + 600
        while min(r.num_output_tokens for r in records[: args.streams]) < args.arrive_after_tokens:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the streams did not reach {args.arrive_after_tokens} tokens in 600 s")
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a stream ended early: {[r.error for r in records if r.error]}")
            await asyncio.sleep(0.01)
        arrival = time.perf_counter()
        await _stream(stub, long, records[-1], calls)
        await asyncio.sleep(args.tail_s)
        for i in range(args.streams):
            calls[i].cancel()
        await asyncio.gather(*tasks)
    return {"records": records, "t0": t0, "arrival": arrival}


def analyse(result: dict) -> dict:
    records, arrival = result["records"], result["arrival"]
    long = records[-1]
    first = long.token_times[0] if long.token_times else long.end
    before, window, everything = [], [], []
    for r in records[:-1]:
        for a, b in zip(r.token_times, r.token_times[1:]):
            everything.append(b - a)
            if b <= arrival:
                before.append(b - a)
            elif a < first:
                window.append(b - a)
    stream_tokens = sum(r.num_output_tokens for r in records[:-1])
    span = max(r.end for r in records[:-1]) - result["t0"]
    ms = lambda xs, q: 1000 * percentile(xs, q)  # noqa: E731
    return {
        "itl_before_p50_ms": ms(before, 50), "itl_before_p99_ms": ms(before, 99),
        "itl_all_p50_ms": ms(everything, 50), "itl_all_p99_ms": ms(everything, 99),
        "itl_all_max_ms": 1000 * max(everything, default=float("nan")),
        "itl_window_p50_ms": ms(window, 50), "itl_window_p99_ms": ms(window, 99),
        "itl_window_max_ms": 1000 * max(window, default=float("nan")),
        "num_window_gaps": len(window),
        "long_ttft_ms": 1000 * (first - long.start), "long_error": long.error,
        "stream_tokens_per_s": stream_tokens / span,
        "stream_errors": [r.error for r in records[:-1] if r.error],
    }


ROWS = [
    ("streams' ITL p50 before arrival ms", "itl_before_p50_ms"),
    ("streams' ITL p99 before arrival ms", "itl_before_p99_ms"),
    ("streams' ITL p50, arrival..long TTFT ms", "itl_window_p50_ms"),
    ("streams' ITL p99, arrival..long TTFT ms", "itl_window_p99_ms"),
    ("streams' ITL max, arrival..long TTFT ms", "itl_window_max_ms"),
    ("streams' ITL p99, whole run ms", "itl_all_p99_ms"),
    ("streams' ITL max, whole run ms", "itl_all_max_ms"),
    ("long prompt TTFT ms", "long_ttft_ms"),
    ("streams' output tokens/s", "stream_tokens_per_s"),
    ("runnable tasks (mean; more than the threads = shared cores)", "runnable_tasks"),
]


def plot(results: dict[int, dict], path: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot (pip install -r requirements.txt)")
        return None
    fig, ax = plt.subplots(figsize=(11, 5))
    for budget, res in results.items():
        arrival, records = res["arrival"], res["records"]
        xs, ys = [], []
        for r in records[:-1]:
            for a, b in zip(r.token_times, r.token_times[1:]):
                xs.append(b - arrival)
                ys.append(1000 * (b - a))
        line = ax.scatter(xs, ys, s=6, alpha=0.6, label=f"--max-num-batched-tokens {budget}")
        long = records[-1]
        if long.token_times:
            ax.axvline(long.token_times[0] - arrival, color=line.get_facecolor()[0], ls=":", lw=1)
    ax.axvline(0, color="k", lw=1, label="long prompt arrives (dotted: its first token)")
    ax.set_yscale("log")
    ax.set_xlabel("time since the long prompt arrived (s)")
    ax.set_ylabel("streams' inter-token latency (ms)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="256,4096", help="--max-num-batched-tokens values to run, one service each")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt-len", type=int, default=64)
    parser.add_argument("--stream-max-tokens", type=int, default=2000, help="streams are cancelled before this")
    parser.add_argument("--long-prompt-len", type=int, default=1536)
    parser.add_argument("--long-output-len", type=int, default=4)
    parser.add_argument("--arrive-after-tokens", type=int, default=16, help="each stream's tokens before the arrival")
    parser.add_argument("--tail-s", type=float, default=2.0, help="seconds the streams go on after the long request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags")
    parser.add_argument("--executor-args", default="", help="extra executor flags")
    parser.add_argument("--out", default=None, help=f"JSON path (default {OUT_DIR}/chunked-prefill-<time>.json)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    budgets = [int(b) for b in args.budgets.split(",")]

    from tests.service.harness import Service

    machine = machine_info()
    results, summaries = {}, {}
    for budget in budgets:
        sched = ["--max-num-batched-tokens", str(budget), *shlex.split(args.scheduler_args)]
        print(f"budget {budget}: starting Pagoda (scheduler {sched})", flush=True)
        with Service(args.model, sched, shlex.split(args.executor_args)) as svc:
            target = f"127.0.0.1:{svc.port}"
            try:
                warm_up(target, 2)
                with RunQueueSampler() as load:
                    results[budget] = asyncio.run(run_experiment(target, args, args.seed))
                server = server_snapshot(target)
            except BaseException:
                print(svc.logs())
                raise
        summaries[budget] = {**analyse(results[budget]), "runnable_tasks": load.mean()}
        s = summaries[budget]
        print(f"  ITL max in window {s['itl_window_max_ms']:.0f} ms, long TTFT {s['long_ttft_ms']:.0f} ms", flush=True)

    workload = (f"{args.streams} streams (prompt {args.stream_prompt_len}, decoding), then 1 prompt of "
                f"{args.long_prompt_len} tokens (output {args.long_output_len}) after {args.arrive_after_tokens} "
                f"tokens per stream; greedy, random token ids, seed {args.seed}")
    print()
    print(f"machine   {machine_line(machine)}")
    print(f"model     {server['model']} on {server['executors'][0]['device']}, float32")
    print(f"workload  {workload}")
    print(f"service   scheduler {args.scheduler_args or '(defaults)'}, executor {args.executor_args or '(defaults)'}")
    print()
    headers = ["metric", *(f"budget {b}" + (" (chunked)" if b < args.long_prompt_len else " (whole prompt)")
                           for b in budgets)]
    print(format_table(headers, [[label, *(summaries[b][key] for b in budgets)] for label, key in ROWS]))
    errors = {b: s["stream_errors"] + ([s["long_error"]] if s["long_error"] else []) for b, s in summaries.items()}
    if any(errors.values()):
        print(f"errors: {errors}")

    out = Path(args.out) if args.out else OUT_DIR / f"chunked-prefill-{timestamp()}.json"
    write_json(out, {
        "machine": machine, "workload": workload, "args": vars(args), "summaries": summaries,
        "itl_series": {
            b: [[round(t - res["arrival"], 6) for t in r.token_times] for r in res["records"]] for b, res in results.items()
        },
    })
    print(f"\nJSON: {out}")
    if not args.no_plot:
        png = plot(results, out.with_suffix(".png"), workload)
        if png:
            print(f"plot: {png}")


if __name__ == "__main__":
    main()
