"""python -m scheduler_svc: the gRPC front end and scheduler (see --help)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

import zmq

from pagoda import link_security, model_files
from pagoda.cli import StartupError, add_bool_flag, add_flag, add_model_flags, add_runner_flag, env_name, run_main
from pagoda.pooling_files import PoolingError, PoolingSpec, read_pooling_spec, resolve_runner
from pagoda.reasoning import choose_reasoning_parser_from_template, reasoning_parser_names
from pagoda.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS, choose_tool_parser_from_template
from pagoda.gc_heap import freeze_startup_heap
from scheduler_svc import auth
from scheduler_svc.core import SpeculativeConfig
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.errors import ServiceError
from scheduler_svc.lora_registry import parse_lora_modules
from scheduler_svc.pooling_requests import PoolingFrontEnd
from scheduler_svc.server import DEFAULT_MAX_CONCURRENT_STREAMS, DEFAULT_MAX_REQUEST_BYTES, build_server
from scheduler_svc.media import DEFAULT_LIMIT_IMAGES, MediaConfig, parse_limit_mm
from scheduler_svc.tokenizer import load_tokenizer, read_model_spec

log = logging.getLogger("scheduler_svc")

# The largest KV cache an executor may announce, in bytes at one byte per element (fp8): more
# than any one machine holds today. It keeps a confused or hostile executor from making the
# scheduler track billions of blocks; --max-kv-blocks overrides it.
KV_MEMORY_CEILING_BYTES = 2 * 2**40


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    add_model_flags(p, "give the executors the same")
    add_runner_flag(p)
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
    add_flag(
        p, "--max-requests-per-tenant", type=int, default=None,
        help="running + waiting requests of one API-key tenant (RESOURCE_EXHAUSTED past it; 0 = no limit; "
        "default: half of --max-waiting-requests when the keys name two tenants or more, else no limit)",
    )
    add_flag(
        p, "--max-running-per-tenant", type=int, default=0,
        help="running slots of one executor a tenant may hold while another tenant waits (0, the default: "
        "--max-num-seqs divided by the tenants with work); over it, its new requests wait and its newest "
        "running ones are preempted (nothing lost) to make room",
    )
    add_flag(
        p, "--max-concurrent-streams", type=int, default=DEFAULT_MAX_CONCURRENT_STREAMS,
        help="streams one client connection may have open at once (gRPC's grpc.max_concurrent_streams; "
        "further calls wait in the client)",
    )
    add_flag(p, "--executor-timeout", type=float, default=2.0, help="seconds without heartbeat before an executor is dead")
    add_flag(p, "--no-executor-wait", type=float, default=30.0, help="seconds a request waits for an executor, then UNAVAILABLE")
    add_bool_flag(
        p, "--async-scheduling", default=True,
        help="plan each executor's next step while its current one runs (the executor never waits for the scheduler)",
    )
    add_flag(
        p, "--step-timeout", type=float, default=120.0,
        help="seconds to wait for a step result before the executor is judged hung (generous: first steps compile kernels)",
    )
    add_bool_flag(p, "--enable-lora", default=False, help="serve LoRA adapters (GenerateRequest.model, LoadLoraAdapter)")
    add_flag(p, "--lora-modules", nargs="+", default=[], help="adapters served from the start: NAME=PATH ... (a PEFT "
             "folder or a Hugging Face name ORG/ADAPTER); implies --enable-lora")
    add_flag(p, "--max-loras", type=int, default=4, help="LoRA adapters in one step (the base model aside)")
    add_flag(p, "--max-lora-rank", type=int, default=64, help="the largest LoRA rank an adapter may have")
    add_flag(p, "--max-cpu-loras", type=int, default=None, help="LoRA adapters kept loaded; loading one more evicts the "
             "least recently used idle one (default: 4 x --max-loras)")
    add_flag(p, "--speculative-method", default=None, choices=["ngram"], help="speculative decoding: ngram = prompt lookup drafts")
    add_flag(p, "--num-speculative-tokens", type=int, default=0, help="draft tokens per request and step (0 = off); turns async scheduling off")
    add_flag(p, "--prompt-lookup-min", type=int, default=2, help="shortest n-gram prompt lookup matches")
    add_flag(p, "--prompt-lookup-max", type=int, default=5, help="longest n-gram prompt lookup matches")
    add_flag(p, "--shutdown-grace", type=float, default=30.0, help="seconds streams may run on after SIGTERM")
    add_flag(p, "--metrics-port", type=int, default=9400, help="Prometheus /metrics port on --host (0 = off)")
    add_flag(
        p, "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request message gRPC accepts (default 4 MiB, gRPC's own; larger ones get RESOURCE_EXHAUSTED)",
    )
    add_flag(p, "--limit-mm-per-prompt", nargs="+", default=[], help="images one prompt may hold: image=N "
             f"(default {DEFAULT_LIMIT_IMAGES})")
    add_flag(p, "--allowed-media-domains", nargs="+", default=[], help="domains whose image URLs a request may name "
             "(off by default: only data: URLs and bytes)")
    add_flag(p, "--log-level", default="INFO")
    add_flag(p, "--reasoning-parser", default="auto", choices=["auto", *reasoning_parser_names()],
             help="split chat outputs' reasoning (`<think>`...) from the answer (auto: from the chat template)")
    add_flag(p, "--tool-call-parser", default="auto", choices=["auto", *TOOL_PARSERS],
             help="the tool-call format of the model, reported to the gateway (auto: from the chat template, else hermes)")
    security = p.add_argument_group("security (see README: Security)")
    add_flag(
        security, "--cluster-secret-file", default=None,
        help="shared secret file: CURVE-authenticates and encrypts the executor link (executors take the same file)",
    )
    add_bool_flag(
        security, "--insecure-executor-link", default=False,
        help="a plaintext executor link, without the per-user secret (anyone reaching it can act as an executor; "
        "executors take the same flag)",
    )
    add_bool_flag(
        security, link_security.ALLOW_INSECURE_SECRET_FLAG, default=False,
        help="use a --cluster-secret-file that other users may read or that is weak (a repeated pattern, few "
        "bits), with a warning, instead of refusing to start (executors take the same flag)",
    )
    security.add_argument(
        "--generate-cluster-secret", metavar="PATH", default=None,
        help="write a new random cluster secret to PATH (mode 600; refuses to overwrite) and exit",
    )
    add_flag(
        security, "--max-kv-blocks", type=int, default=None,
        help="largest num_kv_blocks an executor may register (default: what 2 TiB of fp8 KV cache of the model holds)",
    )
    security.add_argument(
        "--api-key", action="append", default=None, metavar="KEY",
        help=f"require `authorization: Bearer KEY` on pagoda.v1.Generation RPCs (repeatable) [env {env_name('--api-key')}]",
    )
    add_flag(security, "--api-key-file", default=None, help="API keys, one per line: `key` or `key tenant`")
    add_flag(security, "--ssl-certfile", default=None, help="serve gRPC over TLS with this certificate (PEM)")
    add_flag(security, "--ssl-keyfile", default=None, help="the private key of --ssl-certfile (PEM)")
    add_flag(security, "--ssl-ca-certs", default=None, help="mutual TLS: require client certificates signed by this CA (PEM)")
    args = p.parse_args(argv)
    if args.api_key is None and os.environ.get(env_name("--api-key")):
        args.api_key = [os.environ[env_name("--api-key")]]
    if args.max_kv_blocks is not None and args.max_kv_blocks < 2:
        p.error("--max-kv-blocks must be at least 2")
    try:
        parse_limit_mm(args.limit_mm_per_prompt)
    except ValueError as exc:
        p.error(f"--limit-mm-per-prompt {exc}")
    for flag in (
        "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_waiting_requests", "max_request_bytes",
        "max_concurrent_streams",
    ):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            _refuse(p, f"--{flag.replace('_', '-')} must be positive, got {value}")
    for flag in ("executor_timeout", "step_timeout"):
        if not getattr(args, flag) > 0:
            _refuse(p, f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.max_running_per_tenant < 0:
        _refuse(p, f"--max-running-per-tenant must not be negative (0 = a share of --max-num-seqs), got {args.max_running_per_tenant}")
    if args.max_requests_per_tenant is not None and args.max_requests_per_tenant < 0:
        _refuse(p, f"--max-requests-per-tenant must not be negative (0 = no limit), got {args.max_requests_per_tenant}")
    if args.no_executor_wait < 0 or args.shutdown_grace < 0:
        _refuse(p, "--no-executor-wait and --shutdown-grace must not be negative")
    for flag in ("port", "metrics_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            _refuse(p, f"--{flag.replace('_', '-')} must be a port number in [0, 65535], got {getattr(args, flag)}")
    if args.speculative_method and args.num_speculative_tokens <= 0:
        p.error("--speculative-method needs --num-speculative-tokens K (K >= 1)")
    if isinstance(args.lora_modules, str):  # (from PAGODA_LORA_MODULES)
        args.lora_modules = args.lora_modules.split()
    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as error:
        _refuse(p, str(error))
    args.enable_lora = args.enable_lora or bool(args.lora_modules)
    args.max_cpu_loras = 4 * args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    for flag in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(args, flag) < 1:
            _refuse(p, f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_cpu_loras < len(args.lora_modules):
        _refuse(p, f"--max-cpu-loras {args.max_cpu_loras} is fewer than the {len(args.lora_modules)} --lora-modules")
    if args.num_speculative_tokens:
        try:
            args.speculative = SpeculativeConfig(
                num_speculative_tokens=args.num_speculative_tokens,
                method=args.speculative_method or "ngram",
                prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
            )
        except ValueError as error:
            p.error(str(error))
    else:
        args.speculative = None
    return args


def max_kv_blocks(args: argparse.Namespace, kv_elements_per_token: int) -> int:
    if args.max_kv_blocks is not None:
        return args.max_kv_blocks
    per_block = max(kv_elements_per_token, 1) * args.block_size
    return min(KV_MEMORY_CEILING_BYTES // per_block, 2**32 - 1)


def security_settings(args: argparse.Namespace):
    """(link keys, API keys, TLS credentials) from the flags; raises with a message saying what to fix.

    The link is CURVE unless --insecure-executor-link: with --cluster-secret-file, else with the
    per-user secret (made on the first start). Warns when the gRPC port is reachable from other
    hosts without an API key.
    """
    link_keys = link_security.scheduler_link_keys(
        args.cluster_secret_file, args.insecure_executor_link, args.executor_bind, args.allow_insecure_cluster_secret
    )
    api_keys = auth.load_api_keys(args.api_key, args.api_key_file)
    credentials = auth.server_credentials(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    if not api_keys and not link_security.is_loopback_endpoint(f"tcp://{_bracketed(args.host)}:{args.port or 1}"):
        log.warning(
            "--host %s is reachable from other hosts and no API key is required: anyone who reaches port %d can "
            "generate, read server load and abort requests. Pass --api-key or --api-key-file (env PAGODA_API_KEY)",
            args.host, args.port,
        )
    return link_keys, api_keys, credentials


def requests_per_tenant(flag: int | None, api_keys, max_waiting_requests: int) -> int:
    """--max-requests-per-tenant, or its default: half the queue once two tenants or more share it (0 = no limit)."""
    if flag is not None:
        return flag
    return max(1, max_waiting_requests // 2) if len({key.tenant for key in api_keys}) >= 2 else 0


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _refuse(p: argparse.ArgumentParser, message: str) -> None:
    """One line, exit 2: argparse's p.error would print the whole usage first."""
    p.exit(2, f"{p.prog}: error: {message}\n")


def parsers(args: argparse.Namespace, tokenizer) -> dict[str, str]:
    """The reasoning and tool-call parsers: the flags', or "auto" chosen from the chat template."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default and the tool-use one
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    reasoning = args.reasoning_parser
    if reasoning == "auto":
        reasoning = choose_reasoning_parser_from_template(template) or ""
    tool = args.tool_call_parser
    if tool == "auto":
        tool = choose_tool_parser_from_template(template) or DEFAULT_TOOL_PARSER
    log.info("reasoning parser %s, tool-call parser %s", reasoning or "none", tool)
    return {"reasoning_parser": "" if reasoning == "none" else reasoning, "tool_call_parser": tool}


def _load_model(model: str | None, revision: str | None = None):
    """The model directory, tokenizer and spec; StartupError (naming --model) if they cannot be read."""
    try:  # config and tokenizer: no weights here
        model_dir = model_files.resolve_model(model, weights=False, revision=revision, tokenizer_only=True)
        tokenizer = load_tokenizer(model_dir)
        return model_dir, tokenizer, read_model_spec(model_dir, tokenizer)
    except model_files.HubError as exc:
        raise StartupError(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:
        raise StartupError(f"cannot read the model {model or '(default)'}: {exc} (--model)") from None


async def _listen(
    args: argparse.Namespace, engine: Engine, spec, model_name: str, api_keys, credentials, model_dir=None, pooling=None,
):
    """Bind the gRPC port and the metrics port, or raise StartupError naming the flag."""
    address = f"{args.host}:{args.port}"
    try:
        if args.port:  # ask the OS first: gRPC would also log its own multi-line error
            socket.create_server((args.host, args.port)).close()
        server, port = await build_server(
            engine, spec, model_name, address, api_keys, credentials, args.max_request_bytes, model_dir=model_dir,
            max_concurrent_streams=args.max_concurrent_streams, pooling=pooling, **parsers(args, engine.tokenizer),
            media=MediaConfig(parse_limit_mm(args.limit_mm_per_prompt), tuple(args.allowed_media_domains)),
        )
    except (OSError, RuntimeError) as exc:
        cause = getattr(exc, "strerror", None) or "the port is in use or the address is not local"
        raise StartupError(f"cannot listen on {address} for gRPC: {cause} (--port, --host)") from None
    if args.metrics_port:
        try:
            engine.metrics.serve(args.host, args.metrics_port)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {args.host}:{args.metrics_port}: {exc.strerror or exc} "
                f"(--metrics-port: choose another, or 0 for none)"
            ) from None
        log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    return server, port


def _pooling_spec(args: argparse.Namespace, model_dir) -> PoolingSpec | None:
    """The pooling model's spec under --runner pooling (or auto on a pooling folder); None to generate.
    StartupError naming the flag or the folder's file for what cannot be served."""
    try:
        if resolve_runner(model_dir, args.runner) == "generate":
            return None
        pooling = read_pooling_spec(model_dir)
    except PoolingError as exc:
        raise StartupError(f"{exc} (--runner, --model)") from None
    if pooling is None:
        raise StartupError(f"--runner pooling: {model_dir} is a generation model with no pooling to serve")
    if args.enable_lora or args.speculative is not None:
        raise StartupError("--runner pooling serves no LoRA adapters nor speculative decoding (--enable-lora, "
                           "--num-speculative-tokens)")
    return pooling


async def serve(args: argparse.Namespace, link_keys, api_keys, credentials) -> None:
    model_dir, tokenizer, spec = _load_model(args.model, args.revision)
    pooling = _pooling_spec(args, model_dir)
    model_len = pooling.max_model_len if pooling is not None else spec.max_position_embeddings
    max_model_len = min(args.max_model_len or model_len, model_len)
    speculative = args.speculative
    if speculative is not None:
        if args.async_scheduling:
            # drafts need each request's latest tokens: a step cannot be planned before the last result
            log.info("speculative decoding (%d ngram drafts): async scheduling is off", args.num_speculative_tokens)
    config = EngineConfig(
        model_fingerprint=model_files.fingerprint(model_dir),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        max_waiting_requests=args.max_waiting_requests,
        max_running_per_tenant=args.max_running_per_tenant,
        max_requests_per_tenant=requests_per_tenant(args.max_requests_per_tenant, api_keys, args.max_waiting_requests),
        executor_timeout_s=args.executor_timeout,
        no_executor_wait_s=args.no_executor_wait,
        async_scheduling=args.async_scheduling and speculative is None,
        speculative=speculative,
        vocab_size=spec.vocab_size,
        max_kv_blocks=max_kv_blocks(args, spec.kv_elements_per_token),
        step_timeout_s=args.step_timeout,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        runner="pooling" if pooling is not None else "generate",
    )
    try:
        engine = Engine(config, tokenizer, args.executor_bind, link_keys=link_keys)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot bind {args.executor_bind} for executors: {exc} (--executor-bind)") from None
    try:
        front_end = PoolingFrontEnd(tokenizer, pooling, max_model_len, spec.vocab_size) if pooling is not None else None
        server, port = await _listen(
            args, engine, spec, model_files.model_name(args.model), api_keys, credentials, model_dir=model_dir,
            pooling=front_end,
        )
    except StartupError:
        engine.pool.link.close()
        raise
    if args.enable_lora:
        registry = engine.enable_loras(model_files.model_name(args.model), args.max_cpu_loras)
        for name, path in args.lora_modules:
            try:
                registry.register(name, path)
            except ServiceError as exc:
                engine.pool.link.close()
                raise StartupError(f"--lora-modules {name}={path}: {exc.message}") from None
        log.info("LoRA adapters on (up to %d a step, rank <= %d): %s", args.max_loras, args.max_lora_rank,
                 ", ".join(registry.names()) or "none loaded yet")
    engine.start()
    await server.start()
    freeze_startup_heap("scheduler")
    log.info(
        "serving pagoda.v1.Generation and vllm.grpc.engine.VllmEngine on %s:%d (%s runner; %s, %s); executors connect "
        "to %s (%s)",
        args.host, port, config.runner, "TLS" + (" with client certificates" if args.ssl_ca_certs else "") if credentials else "plaintext",
        f"{len(api_keys)} API keys" if api_keys else "no API key required",
        engine.pool.link.endpoint, "CURVE" if link_keys else "plaintext",
    )
    print(f"PAGODA_READY port={port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    engine.drain()
    log.info("stopping: no new requests; streams in flight get %g s to finish", args.shutdown_grace)
    await server.stop(grace=args.shutdown_grace)
    await engine.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.generate_cluster_secret:
        try:
            path = link_security.make_cluster_secret(args.generate_cluster_secret)
        except FileExistsError:
            sys.exit(f"{args.generate_cluster_secret} exists; not overwriting it")
        print(f"wrote a new cluster secret to {path}; pass --cluster-secret-file {path} to the scheduler and every executor")
        return
    try:
        settings = security_settings(args)
    except (ValueError, OSError) as exc:
        log.error("refusing to start: %s", exc)
        sys.exit(2)
    return run_main("scheduler_svc", lambda: asyncio.run(serve(args, *settings)))


if __name__ == "__main__":
    sys.exit(main())
