"""ModelRunner alone: N concurrent greedy requests, prefill then decode, and where the time goes.

    python bench/bench_model_runner.py                      # 16 x (100 prompt + 64 new), default model
    python bench/bench_model_runner.py --threads 1 --baseline

No scheduler, no sockets: hand-built StepPlans drive `ModelRunner` directly. Each step is
split into the runner's own stages:

    inputs    update_states + prepare_inputs   (Python state, index tensors, block table)
    forward   model(...) + compute_logits     (the decoder and the LM head on sampled rows)
    sample    sample + finish_step            (sampler, appending tokens)

`--baseline` also runs transformers' `generate` on the same prompts in one static batch
(equal prompt lengths: no padding), greedy, float32, KV cache on.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch

from bench.common import format_table, machine_info, machine_line
from executor_svc.model_runner import ModelRunner
from pagoda.model_files import resolve_model
from pagoda.step import CachedRequestData, NewRequestData, SamplingParams, StepPlan

STAGES = ("inputs", "forward", "sample")


def timed_step(runner: ModelRunner, plan: StepPlan, times: dict[str, float]):
    with torch.inference_mode():
        t0 = time.perf_counter()
        runner.update_states(plan)
        inputs = runner.prepare_inputs(plan)
        t1 = time.perf_counter()
        hidden, residual = runner.model(
            inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, runner.attention
        )
        logits = runner.model.compute_logits(hidden, residual, inputs.logits_indices)
        t2 = time.perf_counter()
        sampled, _ = runner.sample(logits, inputs.sampled_req_ids)
        runner.finish_step(plan, sampled)
        t3 = time.perf_counter()
    times["inputs"] += t1 - t0
    times["forward"] += t2 - t1
    times["sample"] += t3 - t2
    return sampled


def run(runner: ModelRunner, prompts: list[list[int]], output_len: int) -> dict:
    """One prefill step for every request, then decode steps; returns phase times and stage splits."""
    block_size = runner.block_size
    free = list(range(1, runner.num_kv_blocks))
    random.Random(0).shuffle(free)
    blocks = {}
    new = []
    for i, prompt in enumerate(prompts):
        req_id = f"r{i}"
        blocks[req_id] = [free.pop() for _ in range(-(-len(prompt) // block_size))]
        new.append(NewRequestData(req_id, prompt, len(prompt), SamplingParams(temperature=0.0), blocks[req_id], 0))
    lengths = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    prefill_times = dict.fromkeys(STAGES, 0.0)
    decode_times = dict.fromkeys(STAGES, 0.0)
    plan = StepPlan(0, new_requests=new, num_scheduled_tokens=dict(lengths))
    timed_step(runner, plan, prefill_times)
    for step in range(1, output_len):
        cached = []
        for req_id, length in lengths.items():
            lengths[req_id] = length + 1
            if -(-(length + 1) // block_size) > len(blocks[req_id]):
                blocks[req_id].append(free.pop())
                cached.append(CachedRequestData(req_id, [blocks[req_id][-1]]))
        plan = StepPlan(step, cached_requests=cached, num_scheduled_tokens=dict.fromkeys(lengths, 1))
        timed_step(runner, plan, decode_times)
    runner.execute(StepPlan(output_len, finished_req_ids=list(lengths)))
    return {"prefill": prefill_times, "decode": decode_times}


def attention_decode_ms(runner: ModelRunner, num_seqs: int, seq_len: int, repeat: int = 20) -> tuple[float, float]:
    """One layer's decode attention (KV write + attention) for `num_seqs` sequences of `seq_len`
    tokens: (the runner's backend, a per-sequence SDPA loop over the same paged cache), in ms."""
    import torch.nn.functional as F

    from executor_svc.attention.base import AttentionMetadata

    c, block_size = runner.config, runner.block_size
    k_cache, v_cache = runner.kv_caches[0]
    cols = -(-seq_len // block_size)
    table = torch.randperm(runner.num_kv_blocks - 1)[: num_seqs * cols].view(num_seqs, cols).int() + 1
    pos = torch.full((num_seqs,), seq_len - 1)
    meta = AttentionMetadata(
        slot_mapping=(table[:, -1].long() * block_size + pos % block_size),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32),
        block_table=table,
        max_query_len=1,
        max_seq_len=seq_len,
    )
    q = torch.randn(num_seqs, c.num_heads, c.head_dim, dtype=k_cache.dtype)
    k = torch.randn(num_seqs, c.num_kv_heads, c.head_dim, dtype=k_cache.dtype)
    scale = c.head_dim**-0.5

    def loop():
        out = []
        for i in range(num_seqs):
            keys = k_cache[table[i].long()].flatten(0, 1)[:seq_len].transpose(0, 1)
            values = v_cache[table[i].long()].flatten(0, 1)[:seq_len].transpose(0, 1)
            out.append(F.scaled_dot_product_attention(q[i][:, None], keys, values, scale=scale, enable_gqa=True))
        return torch.stack(out)

    def timed(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1e3

    with torch.inference_mode():
        ours = timed(lambda: runner.attention.forward(q, k, k, k_cache, v_cache, meta, scale))
        return ours, timed(loop)


def baseline(model_dir: Path, prompts: list[list[int]], output_len: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto (float32 on the CPU), bfloat16, ...")
    parser.add_argument("--repeat", type=int, default=2, help="runs; the best is reported")
    parser.add_argument("--baseline", action="store_true", help="also time transformers generate")
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    runner = ModelRunner(model_dir, device="cpu", dtype=args.dtype, num_kv_blocks=1024, num_threads=args.threads)
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    run(runner, [p[:16] for p in prompts[:2]], 4)  # warm-up
    best = min(
        (run(runner, prompts, args.output_len) for _ in range(args.repeat)), key=lambda r: sum(r["decode"].values())
    )

    n, out = args.num_requests, args.output_len
    prefill_s, decode_s = sum(best["prefill"].values()), sum(best["decode"].values())
    print(machine_line(machine_info()))
    print(
        f"model {model_dir.name}, {runner.dtype}, attention {runner.attention.name}, "
        f"{n} requests x ({args.prompt_len} prompt + {out} new tokens), greedy"
    )
    rows = [
        [
            "prefill (1 step)",
            n * args.prompt_len,
            prefill_s * 1e3,
            n * args.prompt_len / prefill_s,
            *(100 * best["prefill"][s] / prefill_s for s in STAGES),
        ],
        [
            f"decode ({out - 1} steps)",
            n * (out - 1),
            decode_s * 1e3 / (out - 1),
            n * (out - 1) / decode_s,
            *(100 * best["decode"][s] / decode_s for s in STAGES),
        ],
        ["total", n * out, (prefill_s + decode_s) * 1e3, n * out / (prefill_s + decode_s), "", "", ""],
    ]
    headers = ["phase", "tokens", "ms (per step)", "tokens/s", "% inputs", "% forward", "% sample"]
    if args.baseline:
        hf_s = baseline(model_dir, prompts, out)
        rows.append(["transformers generate (total)", n * out, hf_s * 1e3, n * out / hf_s, "", "", ""])
    print(format_table(headers, rows))
    ours, loop = attention_decode_ms(runner, 16, 300)
    print(
        f"decode attention, one layer, 16 sequences x 300 tokens: {runner.attention.name} backend {ours:.2f} ms, "
        f"per-sequence SDPA loop {loop:.2f} ms"
    )


if __name__ == "__main__":
    main()
