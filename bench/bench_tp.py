"""Tensor parallelism on the CPU: TP=2 vs TP=1 step time, the collectives' share, plan broadcast vs ZeroMQ.

    nice -n 10 .venv/bin/python bench/bench_tp.py [--hidden 256] [--layers 4] [--batch 8] [--steps 60]
    python bench/bench_tp.py --device cuda --tp 2 --hidden 4096 --layers 8 --batch 64   # GPUs, NCCL

A random Llama (GQA, --hidden, --layers) saved to a temp folder; --batch requests prefilled,
then --steps decode steps timed. TP=1 is a `ModelRunner`; TP=N (--tp, 2) N ranks (processes; gloo on the CPU, NCCL on GPUs)
through `LeaderRunner` / `FollowerRunner`, rank 0 timing its step and, inside it, every
collective (plan broadcast, all-reduces, logits gather). Then the plan's way to the other
ranks, one way (half a round trip between ranks 0 and 1), for a decode plan's size and a
64 KiB plan: `dist.broadcast` of the bytes as a uint8 tensor on the rank's device vs a ZeroMQ
PUB/SUB pair on 127.0.0.1. Prints a table; each rank runs one torch thread. On GPUs it needs
--tp GPUs and says so when there are fewer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.executor.plans import GREEDY, PlanBuilder  # noqa: E402


def make_model(path: Path, hidden: int, layers: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, max_position_embeddings=1024,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(runner, batch: int, steps: int) -> float:
    """Mean seconds per decode step of `batch` requests (after their prefill and 5 warm-up steps)."""
    builder = PlanBuilder(block_size=16, num_blocks=runner.num_kv_blocks, seed=0)
    for i in range(batch):
        builder.add(f"r{i}", [(7 * i + j) % 4000 + 1 for j in range(32)], steps + 10, GREEDY)
    times = []
    for n in range(steps + 6):
        plan = builder.next_plan()
        start = time.perf_counter()
        result = runner.execute(plan)
        _sync(runner.device)
        if n >= 6:
            times.append(time.perf_counter() - start)
        builder.update(plan, result)
    return sum(times) / len(times)


def _rank(rank: int, model_dir: str, port: int, args, out: str) -> None:
    import zmq

    import torch.distributed as dist

    from executor_svc.parallel.group import ProcessGroupTP, Rendezvous
    from executor_svc.parallel.runner import FollowerRunner, LeaderRunner

    torch.set_num_threads(1)
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    group = ProcessGroupTP(Rendezvous(rank, args.tp, "127.0.0.1", port), torch.device(device))
    options = dict(device=device, block_size=16, num_kv_blocks=512)
    if rank != 0:
        FollowerRunner(group, model_dir, **options).serve()
    else:
        leader = LeaderRunner(group, model_dir, **options)
        spent = [0.0]
        for name in ("all_reduce", "gather_logits", "broadcast_bytes"):
            inner = getattr(group, name)

            def timed(x, inner=inner):
                _sync(device)
                start = time.perf_counter()
                try:
                    return inner(x)
                finally:
                    _sync(device)
                    spent[0] += time.perf_counter() - start

            setattr(group, name, timed)
        spent[0] = 0.0
        step = timed_steps(leader, args.batch, args.steps)
        share = spent[0] / ((args.steps + 6) * step)  # collectives over every step, warm-up included
        leader.stop()
        torch.save({"step": step, "share": share}, out)

    # The plan's way to the other ranks: one way = half a ping-pong between ranks 0 and 1
    # (a broadcast involves every rank; the ZeroMQ pair only ranks 0 and 1).
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    if rank < 2:
        pub.bind(f"tcp://127.0.0.1:{port + 1 + rank}")
        sub.connect(f"tcp://127.0.0.1:{port + 2 - rank}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # PUB/SUB: subscriptions settle before the first message
    dist.barrier()
    figures = {}
    for size in (args.plan_bytes, 64 * 1024):
        payload = os.urandom(size)
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        for way in ("broadcast", "zmq"):
            rounds = 200
            start = time.perf_counter()
            for _ in range(rounds):
                if way == "broadcast":  # as the runner does: host bytes in, host bytes out
                    if rank == 0:
                        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                    dist.broadcast(buf, src=0)
                    if rank == 1:
                        buf.cpu()
                    dist.broadcast(buf, src=1)
                    if rank == 0:
                        buf.cpu()
                elif rank == 0:
                    pub.send(payload)
                    sub.recv()
                elif rank == 1:
                    pub.send(sub.recv())
            figures[(way, size)] = (time.perf_counter() - start) / rounds / 2
            dist.barrier()
    if rank == 0:
        data = torch.load(out)
        data["ways"] = figures
        torch.save(data, out)
    pub.close(0)
    sub.close(0)
    group.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--plan-bytes", type=int, default=512, help="a decode plan's size on the wire")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tp", type=int, default=2, help="ranks of the group")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"bench_tp: TP={args.tp} on GPUs needs {args.tp} GPUs (one per rank, NCCL); "
              f"this machine has {torch.cuda.device_count()}: no TP figure")
        return
    from executor_svc.model_runner import ModelRunner
    from tests.service.harness import free_port

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_model(model_dir, args.hidden, args.layers)
        device = "cuda:0" if args.device == "cuda" else "cpu"
        single = timed_steps(ModelRunner(model_dir, device=device, block_size=16, num_kv_blocks=512), args.batch, args.steps)
        out = str(Path(tmp) / "tp.pt")
        mp.spawn(_rank, args=(str(model_dir), free_port(), args, out), nprocs=args.tp, join=True)
        tp2 = torch.load(out)
    print(f"\nLlama hidden {args.hidden}, {args.layers} layers, vocab 4096; decode batch {args.batch}, {args.steps} steps; "
          f"{os.cpu_count()} CPUs, 1 torch thread per rank, device {args.device}\n")
    print("| | step (ms) | collectives' share of the step |")
    print("|---|---|---|")
    print(f"| TP=1 | {single * 1e3:.2f} | - |")
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"| TP={args.tp} ({backend}) | {tp2['step'] * 1e3:.2f} ({tp2['step'] / single:.2f}x) | {tp2['share']:.0%} |")
    print(f"\n| plan to the other rank, one way | {backend} dist.broadcast (us) | ZeroMQ PUB/SUB (us) |")
    print("|---|---|---|")
    for size in (args.plan_bytes, 64 * 1024):
        ways = tp2["ways"]
        print(f"| {size} bytes | {ways[('broadcast', size)] * 1e6:.0f} | {ways[('zmq', size)] * 1e6:.0f} |")


if __name__ == "__main__":
    main()
