"""python -m executor_svc: one model replica that connects to the scheduler (see --help)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# torch's OpenMP threads (GNU libgomp) wait for the next parallel op by spinning for a short
# while (3000 turns, tens of microseconds), then sleep. The default spins for much longer,
# which on cores shared with the scheduler (or other executors, or the decode-attention
# threads) stalls everyone; never spinning (OMP_WAIT_POLICY=PASSIVE) pays a wake-up per op,
# ~10 % of a CPU decode step. Measured side by side on 2 cores, 64 decodes per step:
# PASSIVE 197 ms, spin 1000-20000: 171-180 ms. Read when torch loads; the environment wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from pagoda import link_security, model_files  # noqa: E402
from pagoda.cli import StartupError, add_bool_flag, add_flag, add_model_flags, add_runner_flag, run_main  # noqa: E402
from executor_svc.parallel import is_group  # noqa: E402
from executor_svc.worker import Worker, WorkerConfig  # noqa: E402

log = logging.getLogger("executor_svc")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__)
    add_model_flags(p, "the scheduler's")
    add_runner_flag(p)
    add_flag(p, "--scheduler", default="tcp://127.0.0.1:5557", help="the scheduler's ZeroMQ endpoint")
    add_flag(p, "--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_flag(
        p, "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="activations and KV cache: auto = bfloat16 on a GPU, float32 on the CPU; bfloat16 on the CPU keeps a "
        ".gguf model's blocks (quality bound in the README)",
    )
    add_flag(p, "--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)")
    add_flag(p, "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory for weights + KV cache")
    add_flag(p, "--kv-cache-memory-gb", type=float, default=1.0, help="CPU only: KV cache size when --num-kv-blocks is not set")
    add_flag(p, "--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    add_flag(
        p, "--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache: auto = the model's dtype; fp8_e4m3 / fp8_e5m2 (--attention-backend triton); fp8 = "
        "fp8_e4m3 where the GPU converts it (compute capability 8.9+, ROCm), else fp8_e5m2; fp8_e4m3 on an A100 / "
        "A10 is refused",
    )
    add_flag(
        p,
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "int8"],
        help="weights in memory: auto = a .gguf model's blocks kept as they are on a float32 or bfloat16 CPU "
        "replica (gguf), else as loaded (none); none dequantizes a .gguf model; int8 = 8-bit per-channel (CPU)",
    )
    add_bool_flag(
        p, "--gguf-bf16-weights", default=False,
        help="with --dtype bfloat16 and a .gguf model: also hold a bfloat16 copy of the weights (2 bytes a weight) "
        "for batched and prefill steps, faster there on CPUs with AMX; decode steps keep reading the blocks",
    )
    add_bool_flag(
        p, "--gguf-int8-activations", default=False,
        help="with a .gguf model on a CPU with AVX2: every matmul of Q5_0, Q4_K and Q6_K weights (decode steps "
        "and prompts) takes x rounded to int8 per 32 values, as llama.cpp does (faster; not transformers' float32 "
        "numbers)",
    )
    add_flag(p, "--num-threads", type=int, default=None, help="torch CPU threads (default: one per physical core; idle threads sleep)")
    add_flag(p, "--executor-id", default="", help="default: host-pid-random")
    add_flag(
        p, "--cluster-secret-file", default=None,
        help="the scheduler's cluster secret: authenticates and encrypts the link (CURVE); must match the scheduler's "
        "(default: the per-user secret a scheduler on this host makes in the cache directory)",
    )
    add_bool_flag(
        p, "--insecure-executor-link", default=False,
        help="a plaintext link, for a scheduler started with --insecure-executor-link",
    )
    add_bool_flag(
        p, link_security.ALLOW_INSECURE_SECRET_FLAG, default=False,
        help="use a --cluster-secret-file that other users may read or that is weak, with a warning, instead of "
        "refusing to start",
    )
    add_flag(p, "--log-level", default="INFO")
    # Tensor parallelism (executor_svc/parallel): one executor made of N ranks.
    add_flag(p, "--tensor-parallel-size", type=int, default=1, help="ranks of this executor (torch.distributed: NCCL on CUDA, gloo on the CPU)")
    add_flag(p, "--tp-rank", type=int, default=None, help="this process's rank, one process per rank on several hosts (default: rank 0 starts the others here)")
    add_flag(p, "--tp-master-addr", default="127.0.0.1", help="rank 0's address for the group's rendezvous")
    add_flag(p, "--tp-master-port", type=int, default=None, help="rank 0's rendezvous port (default: a free port, one host only)")
    add_flag(p, "--tp-watchdog-timeout", type=float, default=30.0, help="seconds a silent rank is given before the group leaves")
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be at least 1")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 2:
        p.error("--num-kv-blocks must be at least 2 (block 0 is the null block)")
    if args.executor_id.endswith("/hb"):
        p.error("--executor-id must not end with /hb (the routing id of our heartbeat connection)")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization must be in (0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_main("executor_svc", lambda: _serve(args, sys.argv[1:] if argv is None else list(argv)))


def _serve(args: argparse.Namespace, argv: list[str]) -> int:
    if args.attention_backend == "triton" and not _cuda_available(args.device):
        # Triton kernels on the CPU run in Triton's interpreter, chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # a GGUF file is read as it is
        model_dir = model_files.resolve_model(args.model, weights=False, revision=args.revision)
        fingerprint = model_files.fingerprint(model_dir)
        source = model_files.gguf_source(model_dir)
        weights = [source] if source is not None else sorted(model_dir.glob("*.safetensors"))
        if not weights:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        for path in weights:  # unreadable weights fail here, before we connect, not after the handshake
            with open(path, "rb") as f:
                f.read(8)
    except model_files.HubError as exc:
        raise StartupError(str(exc)) from None
    except (OSError, ValueError) as exc:  # (ValueError: a GGUF pooling model's key it cannot serve)
        raise StartupError(f"cannot read the model {args.model or '(default)'}: {exc} (--model)") from None
    runner_kind = _runner_kind(args, model_dir)

    from executor_svc.backend import BackendOptions

    try:  # the one place the PAGODA_* execution switches are read (bench/README.md)
        backend = BackendOptions.from_env(
            attention=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype, gguf_bf16_weights=args.gguf_bf16_weights,
            gguf_int8_activations=args.gguf_int8_activations,
        )
    except ValueError as exc:
        raise StartupError(f"backend options: {exc}") from None
    if args.gguf_bf16_weights and args.dtype not in ("bfloat16", "bf16"):
        raise StartupError(f"--gguf-bf16-weights needs --dtype bfloat16 (got --dtype {args.dtype})")
    if backend.gguf_int8_activations:
        from executor_svc.quant.gguf_kernel import get_kernel

        kernel = get_kernel()
        if kernel is None or not kernel.int8_activations_supported:
            raise StartupError("--gguf-int8-activations needs the GGUF kernel's AVX2 int8 loops, which this CPU "
                               "or compiler does not have")
    logging.getLogger(__name__).info("backend options: %s", backend.describe())
    if args.kv_cache_dtype != "auto" and _cuda_available(args.device):  # refused here, not at the first step
        from executor_svc.attention import device_kv_cache_dtype

        try:
            log.info("KV cache: %s", device_kv_cache_dtype(args.kv_cache_dtype, "cuda"))
        except ValueError as exc:
            raise StartupError(str(exc)) from None

    def runner_options(config, device: str) -> dict:
        """The ModelRunner's keyword arguments (on `device`) once the scheduler's config is known."""
        if device == "cpu":
            from executor_svc.host_malloc import keep_freed_memory

            keep_freed_memory()
        num_threads = args.num_threads
        kv_bytes = None
        if args.num_kv_blocks is None and device == "cpu":
            kv_bytes = int(args.kv_cache_memory_gb * 2**30)
        return dict(
            device=device,
            dtype=args.dtype,
            block_size=config.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_memory_bytes=kv_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            attention_backend=args.attention_backend,
            num_threads=num_threads,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_batched_tokens=config.max_num_batched_tokens,
            quantization=args.quantization,
            backend=backend,
        )

    def make_runner(config):
        import torch

        from executor_svc.model_runner import ModelRunner

        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if runner_kind == "pooling":  # no KV cache: the KV flags do not apply
            from executor_svc.pooling import PoolingRunner

            return PoolingRunner(model_dir, device=device, dtype=args.dtype, block_size=config.block_size,
                                 num_threads=args.num_threads)
        return ModelRunner(model_dir, **runner_options(config, device))

    def load_or_fail(config):
        try:
            return make_runner(config)
        except (OSError, ValueError, KeyError) as exc:  # a corrupt or unsupported checkpoint
            raise StartupError(f"cannot load the model from {model_dir}: {exc} (--model)") from None

    try:
        link_keys = link_security.executor_link_keys(
            args.cluster_secret_file, args.insecure_executor_link, args.scheduler,
            allow_insecure_secret=args.allow_insecure_cluster_secret,
        )
    except (OSError, ValueError) as exc:
        log.error("no key for the executor link: %s", exc)
        return 2
    log.info("link to %s: %s", args.scheduler, "CURVE, keys from the cluster secret" if link_keys else "plaintext")
    worker_config = WorkerConfig(scheduler=args.scheduler, executor_id=args.executor_id, link_keys=link_keys)

    def make_worker(runner_factory) -> Worker:
        return Worker(worker_config, runner_factory, fingerprint)

    if is_group(args):  # rank 0 alone holds the link (and its keys); see executor_svc/parallel
        from executor_svc.parallel.launch import run_group

        code = run_group(args, model_dir, runner_options, make_worker, argv)
        # A rank leaves without the interpreter's teardown. Its work is done (requests handed back,
        # the other ranks told to leave, spawned ranks waited for; the OS closes the group's
        # sockets), but at exit a C++ destructor of the torch.distributed stack sometimes aborted
        # the process ("terminate called without an active exception": SIGABRT instead of this
        # exit code, seen in CI after a clean SIGTERM).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return make_worker(load_or_fail).run()


def _runner_kind(args: argparse.Namespace, model_dir) -> str:
    """"generate" or "pooling" for --runner and the model; a model the runner cannot take is a StartupError."""
    from pagoda.pooling_files import PoolingError, read_pooling_spec, resolve_runner

    try:
        kind = resolve_runner(model_dir, args.runner)
        if kind == "pooling":
            if is_group(args):
                raise PoolingError("--runner", "pooling: no tensor parallelism (--tensor-parallel-size 1)")
            read_pooling_spec(model_dir)  # a folder the pooling runner cannot serve fails here, named
    except PoolingError as exc:
        raise StartupError(f"{exc} (model {model_dir})") from None
    log.info("runner: %s", kind)
    return kind


def _cuda_available(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
