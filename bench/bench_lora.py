"""LoRA adapters against the base model, side by side in one process: one stream and a W48-like load.

    python bench/bench_lora.py [--rank 16] [--rounds 2] [--threads 2] [--model FILE.gguf]

The default model (or `--model`), GGUF blocks kept, one `ModelRunner` with `enable_lora`; four
random adapters of rank `--rank` on every projection (q/k/v/o, gate/up/down), written as PEFT
folders of the model's shapes. Each measurement alternates base and adapters (A B, B A, ...),
best of `--rounds`:

1. one stream: a 64-token prompt, then 128 decode steps of one request; decode tokens/s, base vs
   one adapter (the issue's aim: at least 0.85x);
2. W48-like: 48 greedy requests (prompts 32-384 tokens, outputs 16-160, all queued at once) through
   the core scheduler (512-token steps, `max_loras` 4), every request on the base vs the 48 spread
   over the 4 adapters; output tokens/s (aim: at least 0.8x);
3. the resident bytes of one adapter;
4. with `--vllm-python PATH` (vLLM's CPU build in a venv of its own): the same W48-like workload and
   adapters through vLLM's offline `LLM` with `enable_lora`, on the model as a Hugging Face folder
   (`bench/vllm_lora_load.py`), base vs adapters, in the same run.

Runner level (no sockets): the service's per-token overhead does not change with adapters.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.bench_bf16 import w48_requests  # noqa: E402
from bench.common import format_table, machine_info, machine_line  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from pagoda.model_files import resolve_model  # noqa: E402
from pagoda.step import SamplingParams  # noqa: E402
from scheduler_svc.core import Request, Scheduler, SchedulerConfig  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
ADAPTERS = ("a0", "a1", "a2", "a3")


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random PEFT adapter of every projection of `config` (the runner's ModelConfig)."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    shapes = {"q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size), "v_proj": (c.hidden_size, c.kv_size),
              "o_proj": (c.q_size, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    tensors = {}
    for layer in range(c.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            owner = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes), "bias": "none",
    }))
    return folder


def one_stream(runner: ModelRunner, lora: str, tag: str) -> float:
    """Decode tokens/s of one request (64-token prompt, 128 tokens) through the core scheduler."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=runner.block_size,
                                          max_model_len=runner.max_model_len, kv_cache_groups=runner.kv_cache_groups,
                                          enable_prefix_caching=False))
    rng = random.Random(1)
    scheduler.add_requests([Request(tag, [rng.randint(1000, 40000) for _ in range(64)], GREEDY, max_tokens=129,
                                    eos_token_ids=frozenset(), lora=lora)])
    plan = scheduler.schedule()  # the prompt
    scheduler.update_from_output(plan, runner.execute(plan))
    t0 = time.perf_counter()
    steps = 0
    while scheduler.has_unfinished() or scheduler.pending_finished_req_ids:
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
        steps += 1
    return 128 / (time.perf_counter() - t0)


def load(runner: ModelRunner, workload, adapters: tuple[str, ...], tag: str) -> float:
    """Output tokens/s of the workload, request i on adapters[i % len(adapters)] ("" = the base)."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=runner.block_size,
                                          max_model_len=runner.max_model_len, kv_cache_groups=runner.kv_cache_groups,
                                          max_num_batched_tokens=512, enable_prefix_caching=False, max_loras=4))
    for i, (prompt, max_tokens) in enumerate(workload):
        scheduler.add_requests([Request(f"{tag}{i}", prompt, GREEDY, max_tokens=max_tokens, eos_token_ids=frozenset(),
                                        lora=adapters[i % len(adapters)])])
    t0 = time.perf_counter()
    while scheduler.has_unfinished() or scheduler.pending_finished_req_ids:
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
    return sum(n for _, n in workload) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: the default model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--vllm-python", default=None, help="vLLM's Python: also run the load through vLLM")
    parser.add_argument("--vllm-dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(resolve_model(args.model, weights=False), device="cpu", block_size=16, num_kv_blocks=4096,
                         enable_lora=True, max_lora_rank=args.rank)
    print(machine_line(machine_info()))
    tmp = tempfile.TemporaryDirectory()
    folders = [write_adapter(Path(tmp.name) / name, runner.config, args.rank, i) for i, name in enumerate(ADAPTERS)]
    sizes = [runner.add_lora(name, folder) for name, folder in zip(ADAPTERS, folders)]
    print(f"model {runner.model_dir.name} ({runner.quantization}, {runner.weight_bytes / 2**20:.1f} MiB); "
          f"4 adapters of rank {args.rank} on every projection, {sizes[0] / 2**20:.2f} MiB resident each")
    workload = w48_requests(args.requests)
    best = {"one/base": 0.0, "one/lora": 0.0, "load/base": 0.0, "load/lora": 0.0}
    for r in range(args.rounds):
        order = ["base", "lora"] if r % 2 == 0 else ["lora", "base"]
        for which in order:
            best[f"one/{which}"] = max(best[f"one/{which}"], one_stream(runner, "" if which == "base" else "a0", f"o{r}{which}"))
        for which in order:
            adapters = ("",) if which == "base" else ADAPTERS
            best[f"load/{which}"] = max(best[f"load/{which}"], load(runner, workload, adapters, f"l{r}{which}-"))
            print(f"round {r} {which}: one stream {best[f'one/{which}']:.1f} tok/s, load {best[f'load/{which}']:.1f} tok/s",
                  flush=True)
    rows = [["one stream, decode tok/s", best["one/base"], best["one/lora"], best["one/lora"] / best["one/base"]],
            [f"W{args.requests}-like, output tok/s (4 adapters)", best["load/base"], best["load/lora"],
             best["load/lora"] / best["load/base"]]]
    if args.vllm_python:
        del runner  # its memory back before vLLM starts
        vllm = run_vllm(args, folders, workload, Path(tmp.name))
        rows.append([f"vLLM {args.vllm_dtype}: W{args.requests}-like, output tok/s", vllm["base"], vllm["lora"],
                     vllm["lora"] / vllm["base"]])
    print(format_table(["measurement", "base", "adapters", "ratio"], rows))
    tmp.cleanup()


def run_vllm(args, folders: list[Path], workload, tmp: Path) -> dict:
    """bench/vllm_lora_load.py under `--vllm-python` on the same model (as a Hugging Face folder), adapters and workload."""
    import os
    import subprocess

    spec = tmp / "vllm_spec.json"
    spec.write_text(json.dumps({"model": str(resolve_model(args.model)), "adapters": [str(f) for f in folders],
                                "workload": workload, "rank": args.rank, "dtype": args.vllm_dtype, "rounds": args.rounds}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}" if args.threads > 1 else "0"}
    out = subprocess.run([args.vllm_python, str(Path(__file__).with_name("vllm_lora_load.py")), str(spec)], env=env,
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
