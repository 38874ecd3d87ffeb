"""float32 vs bfloat16 on the CPU, side by side in one process: linears, whole steps, a W48-like load.

    python bench/bench_bf16.py                          # all three parts, one thread
    python bench/bench_bf16.py --parts linears,steps --threads 2
    python bench/bench_bf16.py --parts load --load-requests 24

The default model (SmolLM2-135M Q4_1, GGUF blocks kept) is loaded twice, `--dtype float32` and
`--dtype bfloat16`; every measurement alternates the two (A B B A ... , best of `--repeat`), so a
load that changes during the run skews both alike. Only the ratios mean much on a shared machine.

1. linears: the four projections of one decoder layer (q/k/v, o, gate/up, down; the same
   `GGUFLinear` modules, float32 vs bfloat16 x) at 1, 16, 48, 256 and 512 rows;
2. steps: a whole step through `ModelRunner.execute` (prefill chunks of 256 and 512 tokens of one
   request; decode steps of 1 and 48 requests with 256 tokens of context each);
3. load: a W48-like load (48 greedy requests, prompts 32-384 random tokens, outputs 16-160, all
   queued at once) through the core scheduler and the model runner, no sockets: output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch

from bench.common import OUT_DIR, format_table, machine_info, machine_line
from executor_svc.model_runner import ModelRunner, resolve_dtype
from executor_svc.quant.gguf_linear import BF16_FUSED_MAX_ROWS, FUSED_MAX_ROWS
from pagoda.model_files import resolve_model
from pagoda.step import NewRequestData, SamplingParams, StepPlan
from scheduler_svc.core import Request, Scheduler, SchedulerConfig

DTYPES = (torch.float32, torch.bfloat16)
GREEDY = SamplingParams(temperature=0.0)


def alternate(fns: dict, repeat: int) -> dict:
    """Best seconds of each fn, run in the order A B B A ... (after one warm-up each)."""
    keys = list(fns)
    for k in keys:
        fns[k]()
    best = dict.fromkeys(keys, float("inf"))
    for i in range(repeat):
        for k in keys if i % 2 == 0 else reversed(keys):
            t0 = time.perf_counter()
            fns[k]()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def bench_linears(runner: ModelRunner, rows_list: list[int], repeat: int) -> list[list]:
    layer = runner.model.layers[0]
    linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    out = []
    for rows in rows_list:
        fns = {}
        for dtype in DTYPES:
            xs = {n: torch.randn(rows, m.in_features).to(dtype) for n, m in linears.items()}
            fns[dtype] = lambda xs=xs: [m(xs[n]) for n, m in linears.items()]
        with torch.inference_mode():
            best = alternate(fns, repeat)
        f32, b16 = best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3
        out.append([f"4 linears of layer 0, {rows} rows", f32, b16, f32 / b16])
    return out


class Blocks:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give(self, ids: list[int]) -> None:
        self.free.extend(ids)


def prefill_step(runner: ModelRunner, blocks: Blocks, num_tokens: int, step: list[int]) -> None:
    """One new request of `num_tokens` prompt tokens, prefilled in one step, then dropped."""
    ids = blocks.take(-(-num_tokens // runner.block_size))
    prompt = [1000 + (i * 7919) % 39000 for i in range(num_tokens)]
    step[0] += 1
    runner.execute(StepPlan(step[0], new_requests=[NewRequestData("p", prompt, num_tokens, GREEDY, ids, 0)],
                            num_scheduled_tokens={"p": num_tokens}))
    step[0] += 1
    runner.execute(StepPlan(step[0], finished_req_ids=["p"]))
    blocks.give(ids)


def decode_steps(runner: ModelRunner, num_seqs: int, context: int, max_steps: int, blocks: Blocks):
    """Prefill `num_seqs` requests of `context` tokens (blocks for `max_steps` more tokens each);
    returns (run(n): n decode steps of every request, finish: drop them)."""
    per_req = -(-(context + max_steps) // runner.block_size)
    reqs = {f"d{i}": blocks.take(per_req) for i in range(num_seqs)}
    new = [NewRequestData(r, [1000 + (i * 31 + j * 7) % 39000 for j in range(context)], context, GREEDY, ids, 0)
           for i, (r, ids) in enumerate(reqs.items())]
    step = [10_000]
    runner.execute(StepPlan(step[0], new_requests=new, num_scheduled_tokens=dict.fromkeys(reqs, context)))

    def run(n: int) -> None:
        for _ in range(n):
            step[0] += 1
            runner.execute(StepPlan(step[0], num_scheduled_tokens=dict.fromkeys(reqs, 1)))

    def finish() -> None:
        step[0] += 1
        runner.execute(StepPlan(step[0], finished_req_ids=list(reqs)))
        for ids in reqs.values():
            blocks.give(ids)

    return run, finish


def bench_steps(runners: dict, repeat: int) -> list[list]:
    out = []
    blocks = {d: Blocks(r.num_kv_blocks) for d, r in runners.items()}
    steps = {d: [0] for d in runners}
    for num_tokens in (256, 512):
        fns = {d: (lambda d=d: prefill_step(runners[d], blocks[d], num_tokens, steps[d])) for d in runners}
        with torch.inference_mode():
            best = alternate(fns, repeat)
        f32, b16 = best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3
        out.append([f"step: prefill chunk of {num_tokens} tokens", f32, b16, f32 / b16])
    num_steps = 4  # per timed run
    for num_seqs in (1, 48):
        runs, finishes = {}, []
        for d, r in runners.items():
            run, finish = decode_steps(r, num_seqs, 256, num_steps * (repeat + 1), blocks[d])
            runs[d] = lambda run=run: run(num_steps)
            finishes.append(finish)
        best = alternate(runs, repeat)
        for finish in finishes:
            finish()
        f32, b16 = best[torch.float32] * 1e3 / num_steps, best[torch.bfloat16] * 1e3 / num_steps
        out.append([f"step: decode, {num_seqs} requests x 256 context", f32, b16, f32 / b16])
    return out


def w48_requests(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randint(1000, 40000) for _ in range(rng.randint(32, 384))], rng.randint(16, 160))
            for _ in range(num_requests)]


def run_load(runner: ModelRunner, workload, tag: str, step_budget: int) -> tuple[float, int, int]:
    """The whole workload through the core scheduler; (seconds, output tokens, steps)."""
    config = SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=runner.block_size,
                             max_model_len=runner.max_model_len, kv_cache_groups=runner.kv_cache_groups,
                             max_num_batched_tokens=step_budget, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    for i, (prompt, max_tokens) in enumerate(workload):
        scheduler.add_requests([Request(f"{tag}{i}", prompt, GREEDY, max_tokens=max_tokens)])
    t0 = time.perf_counter()
    num_steps = 0
    while scheduler.has_unfinished() or scheduler.pending_finished_req_ids:
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
        num_steps += 1
    return time.perf_counter() - t0, sum(n for _, n in workload), num_steps


def bench_load(runners: dict, num_requests: int, rounds: int, step_budget: int) -> list[list]:
    workload = w48_requests(num_requests)
    best = {d: (float("inf"), 0, 0) for d in runners}
    order = list(runners)
    for i in range(rounds):
        for d in order if i % 2 == 0 else reversed(order):
            result = run_load(runners[d], workload, f"{i}-", step_budget)
            best[d] = min(best[d], result)
    (f32, n, steps32), (b16, _, steps16) = best[torch.float32], best[torch.bfloat16]
    return [[f"load: {num_requests} requests (W48-like, {step_budget}-token steps), output tok/s", n / f32, n / b16,
             f32 / b16],
            [f"load: wall seconds ({steps32} / {steps16} steps)", f32, b16, f32 / b16]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="linears,steps,load", help="comma-separated: linears, steps, load")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5, help="alternating runs of each measurement; the best counts")
    parser.add_argument("--load-requests", type=int, default=48)
    parser.add_argument("--load-rounds", type=int, default=2, help="alternating runs of the load (A B, B A, ...)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="the load's step budget "
                        "(512: the scheduler's default for a CPU executor)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(None, weights=False)
    runners = {d: ModelRunner(model_dir, device="cpu", dtype=d, block_size=16, num_kv_blocks=2048) for d in DTYPES}
    print(machine_line(machine_info()))
    print(f"--dtype auto on the CPU: {resolve_dtype('auto', torch.device('cpu'))}; "
          f"fused GGUF kernel up to {FUSED_MAX_ROWS} rows (fp32) / {BF16_FUSED_MAX_ROWS} rows (bf16)")
    r32, r16 = runners[torch.float32], runners[torch.bfloat16]
    print(f"model {model_dir.name}: weights {r32.quantization} {r32.weight_bytes / 2**20:.1f} MiB (fp32) / "
          f"{r16.quantization} {r16.weight_bytes / 2**20:.1f} MiB (bf16); a bf16 copy of the kept weights would be "
          f"{_bf16_copy_bytes(r16) / 2**20:.1f} MiB; C decode path: fp32 {r32.backend.decode_step is not None}, "
          f"bf16 {r16.backend.decode_step is not None}")
    rows = []
    headers = ["measurement", "float32 (ms)", "bfloat16 (ms)", "bf16 speedup"]
    if "linears" in parts:
        rows += bench_linears(r32, [1, 16, 48, 256, 512], args.repeat)
        if parts - {"linears"}:
            print(format_table(headers, rows), flush=True)  # so far (a long load may follow)
    if "steps" in parts:
        rows += bench_steps(runners, args.repeat)
    if "load" in parts:
        rows += bench_load(runners, args.load_requests, args.load_rounds, args.max_num_batched_tokens)
    print(format_table(headers, rows))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "bench_bf16.json").write_text(json.dumps({"machine": machine_info(), "headers": headers, "rows": rows}))
    print("bf16 speedup = float32 time / bfloat16 time (> 1: bfloat16 faster); tok/s rows: the columns are tokens/s")


def _bf16_copy_bytes(runner: ModelRunner) -> int:
    from executor_svc.quant.gguf_linear import GGUFLinear

    return sum(2 * m.in_features * m.out_features for m in runner.model.modules() if isinstance(m, GGUFLinear))


if __name__ == "__main__":
    main()
