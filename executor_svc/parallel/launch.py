"""Start a tensor-parallel executor group and run this process's rank.

Three ways in (`python -m executor_svc --tensor-parallel-size N ...`):

- one host, no `--tp-rank`: this process is rank 0; it listens for the rendezvous on
  127.0.0.1 (a free port unless `--tp-master-port`) and starts ranks 1..N-1 as child
  processes (same flags plus `--tp-rank i`), which die with it (PR_SET_PDEATHSIG);
- several hosts: one process per rank with `--tp-rank R --tp-master-addr A --tp-master-port P`
  (A: rank 0's address, reachable from every rank; rank 0 listens there);
- torchrun: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK` from its environment.

Rank 0 then runs the normal `Worker` (the only rank on the scheduler's link) with a
`LeaderRunner`; the other ranks wait for the scheduler's `ExecutorConfig` in the store,
build a `FollowerRunner` and follow rank 0's steps.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from executor_svc.loader import UnsupportedModelError, load_config
from executor_svc.parallel.group import ProcessGroupTP, Rendezvous
from executor_svc.parallel.runner import FollowerRunner, LeaderRunner
from executor_svc.parallel.sharding import check_split
from executor_svc.parallel.watchdog import Watchdog
from pagoda.gc_heap import freeze_startup_heap
from pagoda.model_files import gguf_source
from pagoda.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)

CONFIG_KEY = "pagoda/config"  # b"C" + ExecutorConfig bytes, or b"X": rank 0 leaves before any step


def rendezvous(args) -> tuple[Rendezvous, socket.socket | None]:
    """This rank's rendezvous; for a one-host launch also rank 0's listening socket (127.0.0.1)."""
    env = os.environ
    size = args.tensor_parallel_size
    if args.tp_rank is None and "RANK" in env and "WORLD_SIZE" in env:  # torchrun
        world = int(env["WORLD_SIZE"])
        if size > 1 and size != world:
            raise SystemExit(f"--tensor-parallel-size {size} but torchrun's WORLD_SIZE is {world}")
        return (
            Rendezvous(
                rank=int(env["RANK"]), size=world, master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                store_exists=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            ),
            None,
        )
    if args.tp_rank is not None:
        if not 0 <= args.tp_rank < size:
            raise SystemExit(f"--tp-rank {args.tp_rank}: must be in [0, {size})")
        if args.tp_master_port is None:
            raise SystemExit("--tp-rank needs --tp-master-port (and --tp-master-addr: rank 0's address)")
        listener = None
        if args.tp_rank == 0:
            listener = _listen(args.tp_master_addr, args.tp_master_port)
        return Rendezvous(args.tp_rank, size, args.tp_master_addr, args.tp_master_port), listener
    listener = _listen("127.0.0.1", args.tp_master_port or 0)
    return Rendezvous(0, size, "127.0.0.1", listener.getsockname()[1]), listener


def _listen(addr: str, port: int) -> socket.socket:
    """Rank 0's store listens only on `addr` (TCPStore alone would listen on every interface)."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(128)
    return sock


def spawn_ranks(rdv: Rendezvous, argv: list[str]) -> list[subprocess.Popen]:
    """Ranks 1..N-1 on this host, each dying with this process."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the group's own traffic stays on loopback
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    base = [sys.executable, "-m", "executor_svc", *argv, "--tp-master-addr", rdv.master_addr, "--tp-master-port", str(rdv.master_port)]
    return [
        subprocess.Popen([*base, "--tp-rank", str(rank)], env=env, preexec_fn=_die_with_parent)
        for rank in range(1, rdv.size)
    ]


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_device(requested: str, rank: int) -> str:
    """cuda:<local rank> when the group runs on GPUs, else cpu."""
    if requested == "cpu" or not torch.cuda.is_available():
        return "cpu"
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def run_group(
    args,
    model_dir,
    runner_options: Callable[[pb.ExecutorConfig, str], dict],
    make_worker: Callable,
    argv: list[str],
) -> int:
    """Run this process's rank of the group until rank 0's worker is done; returns the exit code.

    `runner_options(config, device)`: the `ModelRunner` keyword arguments;
    `make_worker(runner_factory)`: rank 0's `Worker`.
    """
    rdv, listener = rendezvous(args)
    try:  # refuse a model that does not split before anyone waits for the scheduler
        if Path(model_dir).suffix == ".gguf" or gguf_source(model_dir) is not None or args.quantization not in ("auto", "none"):
            raise UnsupportedModelError(
                "tensor parallelism shards safetensors weights (a Hugging Face folder, --quantization none), "
                f"not {model_dir} with --quantization {args.quantization}"
            )
        check_split(load_config(model_dir), rdv.size)
    except UnsupportedModelError as exc:
        log.error("%s", exc)
        return 2
    if rdv.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    children = spawn_ranks(rdv, argv) if listener is not None and args.tp_rank is None else []
    try:
        device = rank_device(args.device, rdv.rank)
        group = ProcessGroupTP(rdv, torch.device(device), listen_fd=None if listener is None else listener.fileno())
        Watchdog(group, children, timeout_s=args.tp_watchdog_timeout).start()
        if rdv.rank != 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 drains, then stops us
            data = group.wait_for(CONFIG_KEY)
            if data[:1] != b"C":
                return 0
            config = pb.ExecutorConfig.FromString(data[1:])
            follower = FollowerRunner(group, model_dir, **runner_options(config, device))
            freeze_startup_heap(f"executor rank {rdv.rank}")
            return follower.serve()
        leader: list[LeaderRunner] = []

        def make_runner(config: pb.ExecutorConfig) -> LeaderRunner:
            group.publish(CONFIG_KEY, b"C" + config.SerializeToString())
            leader.append(LeaderRunner(group, model_dir, **runner_options(config, device)))
            return leader[0]

        code = make_worker(make_runner).run()
        if leader:
            leader[0].stop()
        else:
            group.leaving = True
            group.publish(CONFIG_KEY, b"X")
        return code
    finally:
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
