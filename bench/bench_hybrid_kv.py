"""KV memory of sliding windows: blocks one request holds with its windows' blocks freed, and without.

    python bench/bench_hybrid_kv.py [--model gemma3-1b] [--prompt-len 8064] [--output-len 128]
                                    [--long-output 8064] [--every 512] [--block-size 16] [--step-tokens 2048]

A script, not a test: it runs the real scheduler core (`scheduler_svc.core`, no model;
each step's sampled token is a constant) on the KV cache groups the executor would
register for a model shape (`executor_svc.kv_cache_spec`, from its Hugging Face config),
three ways:

    windows freed   the groups as registered: sliding-window groups free the blocks
                    wholly outside the window while the request runs
    windows kept    the same groups, every one treated as full attention (the same blocks
                    and bytes a block, nothing freed)
    one group       every layer in one full-attention group (Pagoda before KV cache groups)

Table 1: one request of `prompt-len + output-len` tokens (8,192 by default), chunked
prefill of `step-tokens` a step: blocks held at the peak (a prefill step), in the first
decode step and in the last one, in blocks of each layout and in bytes (bfloat16 K and V). Table 2: a long
generation (`--long-output` tokens after a 128-token prompt): free blocks of a pool
sized for the one-group layout's whole sequence, every `--every` tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

from bench.common import OUT_DIR, format_table, machine_info, machine_line, timestamp, write_json  # noqa: E402
from executor_svc.kv_cache_spec import kv_cache_groups, layer_sliding_windows  # noqa: E402
from pagoda.step import KVCacheGroupSpec, SampledToken, StepResult  # noqa: E402
from scheduler_svc.core import Request, Scheduler, SchedulerConfig  # noqa: E402

# Model shapes: what the KV cache needs of their Hugging Face configs (layers, windows, KV heads).
SHAPES = {
    "gemma3-1b": dict(model_type="gemma3_text", num_hidden_layers=26, sliding_window=512, sliding_window_pattern=6,
                      max_position_embeddings=32768, num_key_value_heads=1, head_dim=256),
    "gemma3-27b": dict(model_type="gemma3_text", num_hidden_layers=62, sliding_window=1024, sliding_window_pattern=6,
                       max_position_embeddings=131072, num_key_value_heads=16, head_dim=128),
    "mistral-7b-v0.1": dict(model_type="mistral", num_hidden_layers=32, sliding_window=4096,
                            max_position_embeddings=32768, num_key_value_heads=8, head_dim=128),
}
BYTES_PER_ELEMENT = 2  # bfloat16 K and V


def layouts(shape: dict) -> dict[str, tuple[KVCacheGroupSpec, ...]]:
    groups = kv_cache_groups(layer_sliding_windows(shape))
    return {
        "windows freed": groups,
        "windows kept": tuple(dataclasses.replace(g, sliding_window=None) for g in groups),
        "one group": (KVCacheGroupSpec(tuple(range(shape["num_hidden_layers"]))),),
    }


def block_bytes(groups: tuple[KVCacheGroupSpec, ...], shape: dict, block_size: int) -> int:
    layers_per_block = max(len(g.layer_ids) for g in groups)
    return 2 * layers_per_block * block_size * shape["num_key_value_heads"] * shape["head_dim"] * BYTES_PER_ELEMENT


def run(config: SchedulerConfig, prompt_len: int, output_len: int, every: int) -> dict:
    """One request through the core; blocks held in its first decode step, at its peak (a prefill
    step: a sliding window holds the step's tokens and the window before them), in its last
    step, and free blocks every `every` tokens."""
    scheduler = Scheduler(config)
    pool = scheduler.kv_cache_manager.block_pool
    prompt = [1000 + (i * 7919) % 30000 for i in range(prompt_len)]
    request = Request("r", prompt, max_tokens=output_len)
    scheduler.add_requests([request])
    held = lambda: pool.num_total_blocks - pool.num_free_blocks  # noqa: E731
    first_decode = peak = at_end = 0
    free_every: dict[int, int] = {}
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        peak = max(peak, held())
        if request.num_computed_tokens == prompt_len + 1:
            first_decode = held()
        if request.num_computed_tokens % every == 0:
            free_every[request.num_computed_tokens] = pool.num_free_blocks
        if request.num_tokens + 1 == prompt_len + output_len:
            at_end = held()
        sampled = [SampledToken(r, 1) for r in plan.num_scheduled_tokens if scheduler.get_request(r).num_output_placeholders]
        scheduler.update_from_output(plan, StepResult(plan.step_id, sampled))
    return dict(first_decode=first_decode, peak=peak, at_end=at_end, free_every=free_every, total=pool.num_total_blocks)


def config_for(groups, num_blocks: int, shape: dict, args) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, block_size=args.block_size, max_num_batched_tokens=args.step_tokens,
                           max_model_len=shape["max_position_embeddings"], kv_cache_groups=groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gemma3-1b")
    parser.add_argument("--prompt-len", type=int, default=8064)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-output", type=int, default=8064)
    parser.add_argument("--every", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--step-tokens", type=int, default=2048, help="max_num_batched_tokens (a GPU's default)")
    args = parser.parse_args()

    shape, size = SHAPES[args.model], args.block_size
    info = machine_info()
    print(machine_line(info))
    total_len = args.prompt_len + args.output_len
    all_layouts = layouts(shape)
    print(f"{args.model}: {shape['num_hidden_layers']} layers, window {shape['sliding_window']}, block size {size}, "
          f"steps of {args.step_tokens} tokens, K and V in bfloat16")
    for name, groups in all_layouts.items():
        print(f"  {name}: " + ", ".join(f"{'full' if g.sliding_window is None else g.sliding_window}:{list(g.layer_ids)}" for g in groups))

    rows, results = [], {}
    for name, groups in all_layouts.items():
        per_block = block_bytes(groups, shape, size)
        num_blocks = -(-total_len // size) * len(groups) + 1  # room for the whole sequence in every group
        one = run(config_for(groups, num_blocks, shape, args), args.prompt_len, args.output_len, args.every)
        rows.append([name, len(groups), max(len(g.layer_ids) for g in groups), f"{per_block / 2**10:.0f} KiB",
                     one["peak"], one["first_decode"], one["at_end"],
                     f"{one['peak'] * per_block / 2**20:.1f} MiB", f"{one['at_end'] * per_block / 2**20:.1f} MiB"])
        results[name] = dict(one_request=one, block_bytes=per_block, num_groups=len(groups))
    print(f"\nTable 1: KV blocks held by one request of {args.prompt_len} + {args.output_len} = {total_len} tokens")
    print(format_table(["layout", "groups", "layers/block", "block", "peak", "first decode", "last step",
                        "peak bytes", "last step bytes"], rows))
    freed, one_group = results["windows freed"], results["one group"]
    for when in ("peak", "at_end"):
        ratio = one_group["one_request"][when] * one_group["block_bytes"] / (freed["one_request"][when] * freed["block_bytes"])
        print(f"KV bytes {'at the peak' if when == 'peak' else 'in the last step'}, one group / windows freed: {ratio:.2f}x")

    # Table 2: the same KV memory for both, the one-group layout's whole long sequence
    long_len = 128 + args.long_output
    layer_blocks = -(-long_len // size) * shape["num_hidden_layers"]
    columns = {}
    for name in ("windows freed", "one group"):
        groups = all_layouts[name]
        num_blocks = layer_blocks // max(len(g.layer_ids) for g in groups) + 1
        long = run(config_for(groups, num_blocks, shape, args), 128, args.long_output, args.every)
        results[name]["long"] = long
        columns[name] = long
    memory = layer_blocks * block_bytes(all_layouts["one group"], shape, size) / shape["num_hidden_layers"]
    print(f"\nTable 2: free blocks while one request generates {args.long_output} tokens after a 128-token prompt, "
          f"in {memory / 2**20:.0f} MiB of KV cache (what the one-group layout needs for it)")
    positions = sorted(set.intersection(*(set(c["free_every"]) for c in columns.values())))
    headers = ["computed tokens"] + [f"{name}: free of {c['total']}" for name, c in columns.items()] + ["free %, windows", "free %, one group"]
    table = [
        [p] + [c["free_every"][p] for c in columns.values()] + [f"{100 * c['free_every'][p] / c['total']:.1f}" for c in columns.values()]
        for p in positions
    ]
    print(format_table(headers, table))
    path = write_json(OUT_DIR / f"hybrid_kv-{timestamp()}.json", dict(args=vars(args), machine=info, shape=shape, results=results))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
