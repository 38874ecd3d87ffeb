"""The sizes people run (issue 42): Pagoda beside llama.cpp's server on random-weight GGUF files of
the Llama-3.2-1B, Qwen3-4B and Llama-3.1-8B shapes, against the machine's read bandwidth.

    nice -n 10 .venv/bin/python bench/bench_sizes.py --llama-cpp ../peers/llama_cpp_python-0.3.36/vendor/llama.cpp
    .venv/bin/python bench/bench_sizes.py --llama-cpp DIR --files llama3.2-1b.Q4_K_M --parts one --rounds 1
    .venv/bin/python bench/bench_sizes.py --llama-cpp DIR --files llama3.1-8b.Q4_K_M --parts one,memory

The files (`--files`, default all four): `llama3.2-1b.Q4_K_M`, `llama3.2-1b.Q8_0`, `qwen3-4b.Q4_K_M`,
`llama3.1-8b.Q4_K_M`, under `--models-dir` (default /work/peers/models, outside git), made once
and reused: a Hugging Face folder of the shape (the real hidden, MLP, layer, head and vocabulary
sizes and tied/untied head; no RoPE scaling, which does not change a step's bytes) with random
weights of std 0.02 (norms 1), written one safetensors shard per layer straight from
`torch.Tensor.normal_` in bfloat16, so no more than one layer and the embedding is ever in memory;
the default model's tokenizer, its 49,152 tokens padded by llama.cpp's converter to the shape's
vocabulary; then llama.cpp's `convert_hf_to_gguf.py` to f16 and `llama-quantize` (as
bench/random_family_gguf.py); the folder and the f16 file are deleted once the file is made.

Systems (`--systems`): `pagoda` (the service, executor defaults: the file's blocks kept, float32
x), `pagoda-int8` (`--gguf-int8-activations`), `llama.cpp` (`llama-server`, the same threads).
Parts (`--parts`), every request greedy, `ignore_eos`, as token ids (bench/bench_cpu_peers.py):

    one     one stream, a 64-token prompt, `--tokens` (128) tokens: output tok/s over the request's
            wall time, and the decode rate after the first token
    four    4 such streams at once (each prompt its own first token)
    w48     bench_cpu_peers' W48 (48 requests, prompts 32-384, outputs 16-160, all at once); only on
            the 1B files
    memory  the server process's peak resident size (VmHWM) and, at that point, its anonymous and
            file-backed resident sizes (/proc/PID/status), beside the file size plus its KV cache
            (llama.cpp: `--llama-slots` x 1,024 tokens in f16; the executor: as many tokens, up to
            32,768, in float32, `--kv-cache-memory-gb`);
            and start-up to the first token (server start until ready, plus the first request's
            time to first token, the file already in the page cache from an earlier part or run)

Bandwidth: the best of 5 sums of a 1.5 GiB float32 tensor over `--threads` torch threads (GB/s,
1e9 bytes). The roofline of a file: bandwidth / bytes read per decode token, those being the
file's tensor bytes less the token-embedding table (rows gathered, not read whole) unless the
head is tied to it (then it is read whole as the head). "% roofline" is the decode rate over it.

llama.cpp is a benchmark peer, not a dependency: its source tree (`--llama-cpp`) with
`build/bin/llama-server` and `llama-quantize` built (see bench/README.md). Its converter imports
`sentencepiece` for a Llama folder, which the project does not need: install it apart
(`pip install --target ../peers/converter-pylib "sentencepiece~=0.2.0"`) and run with
`PYTHONPATH=../peers/converter-pylib` (passed on to the converter).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import torch  # noqa: E402

from bench.bench_cpu_peers import LlamaCpp, Pagoda, measure_part, parse_names, w48_specs  # noqa: E402
from bench.common import SAFE_TOKEN_IDS, RequestSpec, exit_on_sigterm, format_table, machine_info, machine_line  # noqa: E402
from bench.random_family_gguf import convert, copy_tokenizer  # noqa: E402
from pagoda import model_files  # noqa: E402

SHAPES = {  # the released models' shapes (config.json), RoPE scaling left out
    "llama3.2-1b": dict(arch="LlamaForCausalLM", hidden=2048, mlp=8192, layers=16, heads=32, kv_heads=8, head_dim=64,
                        vocab=128256, tied=True, rope_theta=500000.0),
    "qwen3-4b": dict(arch="Qwen3ForCausalLM", hidden=2560, mlp=9728, layers=36, heads=32, kv_heads=8, head_dim=128,
                     vocab=151936, tied=True, rope_theta=1000000.0),
    "llama3.1-8b": dict(arch="LlamaForCausalLM", hidden=4096, mlp=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                        vocab=128256, tied=False, rope_theta=500000.0),
}
FILES = ("llama3.2-1b.Q4_K_M", "llama3.2-1b.Q8_0", "qwen3-4b.Q4_K_M", "llama3.1-8b.Q4_K_M")
SYSTEMS = ("pagoda", "pagoda-int8", "llama.cpp")
PARTS = ("one", "four", "w48", "memory")
PROMPT_LEN, NUM_STREAMS, STD = 64, 4, 0.02
SLOT_CONTEXT = 1024  # llama.cpp's context per slot: the longest request is W48's 384 + 160 tokens


# ---- the files -------------------------------------------------------------------------------


def hf_config(shape: dict):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], rope_theta=shape["rope_theta"],
                  max_position_embeddings=131072 if shape["arch"].startswith("Llama") else 40960, rms_norm_eps=1e-5,
                  tie_word_embeddings=shape["tied"], bos_token_id=1, eos_token_id=2, architectures=[shape["arch"]])
    return (LlamaConfig if shape["arch"].startswith("Llama") else Qwen3Config)(**common)


def write_random_hf(shape: dict, out: Path) -> None:
    """config, tokenizer and `model-NNNNN.safetensors` shards (the embedding and head, then one per
    layer) of random bf16 weights, each shard written and freed before the next is made."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf_config(shape).save_pretrained(out)
    copy_tokenizer(out)
    gen = torch.Generator().manual_seed(0)
    h, kv = shape["hidden"], shape["kv_heads"] * shape["head_dim"]
    q = shape["heads"] * shape["head_dim"]

    def rand(*size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.bfloat16).normal_(0.0, STD, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rand(shape["vocab"], h), "model.norm.weight": ones(h),
               **({} if shape["tied"] else {"lm_head.weight": rand(shape["vocab"], h)})}]
    weight_map, total = {}, 0
    for i in range(-1, shape["layers"]):
        if i >= 0:
            p = f"model.layers.{i}."
            layer = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                     p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                     p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                     p + "mlp.gate_proj.weight": rand(shape["mlp"], h), p + "mlp.up_proj.weight": rand(shape["mlp"], h),
                     p + "mlp.down_proj.weight": rand(h, shape["mlp"])}
            if shape["arch"].startswith("Qwen3"):
                layer[p + "self_attn.q_norm.weight"] = ones(shape["head_dim"])
                layer[p + "self_attn.k_norm.weight"] = ones(shape["head_dim"])
            tensors = layer
        else:
            tensors = shards.pop()
        name = f"model-{i + 2:05d}-of-{shape['layers'] + 1:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))


def ensure_files(names: list[str], models_dir: Path, llama_cpp: Path) -> dict[str, Path]:
    """name -> its GGUF file, made where missing (the folder and f16 file of a shape deleted after)."""
    paths = {n: models_dir / "{}-shape-random.{}.gguf".format(*n.rsplit(".", 1)) for n in names}
    for shape_name in dict.fromkeys(n.rsplit(".", 1)[0] for n in names):
        missing = [n for n in names if n.startswith(shape_name + ".") and not paths[n].exists()]
        if not missing:
            continue
        hf_dir, f16 = models_dir / f"{shape_name}-shape-random-hf", models_dir / f"{shape_name}-shape-random.f16.gguf"
        t0 = time.perf_counter()
        if not f16.exists():
            write_random_hf(SHAPES[shape_name], hf_dir)
        for n in missing:
            tmp = paths[n].with_suffix(".part")
            convert(llama_cpp, hf_dir, f16, tmp, n.rsplit(".", 1)[1])
            tmp.rename(paths[n])
        shutil.rmtree(hf_dir, ignore_errors=True)
        f16.unlink(missing_ok=True)
        print(f"{shape_name}: made {', '.join(paths[n].name for n in missing)} in {time.perf_counter() - t0:.0f} s", flush=True)
    return paths


def bytes_per_token(path: Path) -> tuple[int, int]:
    """(the file's tensor bytes, the bytes a decode step reads: all but an untied token embedding)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    tied = "output.weight" not in tensors
    return total, total - (0 if tied else tensors.get("token_embd.weight", 0))


def read_bandwidth(threads: int, gib: float = 1.5, repeats: int = 5) -> float:
    """GB/s (1e9) of the best of `repeats` sums of a `gib` GiB float32 tensor over `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(previous)


# ---- memory ---------------------------------------------------------------------------------


def proc_memory(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of `pid` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def kv_bytes(shape: dict, tokens: int, itemsize: int) -> int:
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * itemsize * tokens


# ---- measuring ------------------------------------------------------------------------------


def stream_specs(chat_ids: list[int], round_index: int, n: int, tokens: int) -> list[RequestSpec]:
    """The chat prompt behind a first token of its own per stream and round: no two share a prefix."""
    return [RequestSpec(i, [SAFE_TOKEN_IDS[0] + 2 * NUM_STREAMS * round_index + i, *chat_ids[: PROMPT_LEN - 1]],
                        tokens, 0.0) for i in range(n)]


def make_system(name: str, path: Path, args, kv_gib: float):
    if name == "llama.cpp":
        binary = args.llama_cpp / "build/bin/llama-server"
        system = LlamaCpp(str(binary), args.threads, args.llama_slots, model=str(path))
        system.cmd[system.cmd.index("-c") + 1] = str(args.llama_slots * SLOT_CONTEXT)
        return system
    extra = ["--gguf-int8-activations"] if name == "pagoda-int8" else []
    return Pagoda("float32", args.threads, args.scheduler_args.split(), [*extra, "--kv-cache-memory-gb", f"{kv_gib:.4f}"],
                  model=str(path))


def server_pid(system) -> int:
    return system.svc.executors[0].pid if isinstance(system, Pagoda) else system.proc.pid


def run_file(name: str, path: Path, parts: list[str], systems: list[str], args, chat_ids: list[int]) -> dict:
    """system -> {part: summary}, with "startup_s", "memory" where measured."""
    shape = SHAPES[name.rsplit(".", 1)[0]]
    w48 = "w48" in parts and name.startswith("llama3.2-1b")
    # the executor's KV cache (float32) holds as many tokens as llama.cpp's slots (f16), up to 32,768
    kv_gib = args.pagoda_kv_gib or kv_bytes(shape, min(args.llama_slots * SLOT_CONTEXT, 32768), 4) / 2**30
    t0 = time.perf_counter()
    model_files.gguf_metadata_dir(path)  # the scheduler's config and tokenizer folder, made once and cached
    print(f"{name}: metadata folder ready in {time.perf_counter() - t0:.1f} s (made once per file, then cached)", flush=True)
    out: dict[str, dict] = {}
    for system_name in systems:
        print(f"{name} {system_name}: starting (load average {os.getloadavg()[0]:.2f})", flush=True)
        row: dict = {}
        t_start = time.perf_counter()
        try:
            with make_system(system_name, path, args, kv_gib) as system:
                row["ready_s"] = time.perf_counter() - t_start
                first = measure_part(system, stream_specs(chat_ids, 99, 1, 2))["summary"]  # also the warm-up
                row["startup_s"] = row["ready_s"] + first["ttft_p50_ms"] / 1e3
                for r in range(args.rounds):
                    for part in parts:
                        if part == "memory" or (part == "w48" and not w48):
                            continue
                        specs = {"one": lambda: stream_specs(chat_ids, r, 1, args.tokens),
                                 "four": lambda: stream_specs(chat_ids, r, NUM_STREAMS, args.tokens),
                                 "w48": lambda: w48_specs(args, r)}[part]()
                        s = measure_part(system, specs)["summary"]
                        print(f"  round {r + 1} {part}: {s['duration_s']:.1f} s, {s['output_tokens_per_s']:.2f} tok/s, "
                              f"decode {s['decode_tokens_per_s'] or 0:.2f} tok/s, errors {s['num_errors']}, "
                              f"runnable {s['runnable_tasks']:.1f}", flush=True)
                        if part not in row or s["output_tokens_per_s"] > row[part]["output_tokens_per_s"]:
                            row[part] = s
                row["memory"] = proc_memory(server_pid(system))
                if isinstance(system, Pagoda):
                    row["kv_bytes"] = int(kv_gib * 2**30)
                    row["weight_bytes"] = system.svc.server_info().executors[0].weight_bytes
                else:  # f16 K and V, every slot's context
                    row["kv_bytes"] = kv_bytes(shape, args.llama_slots * SLOT_CONTEXT, 2)
        except (OSError, RuntimeError, TimeoutError) as e:
            print(f"{name} {system_name}: not measured ({e})", flush=True)
            continue
        mem = row["memory"]
        print(f"  start-up to first token {row['startup_s']:.1f} s; VmHWM {mem['VmHWM'] / 2**30:.2f} GiB "
              f"(anon {mem['RssAnon'] / 2**30:.2f}, file {mem['RssFile'] / 2**30:.2f} GiB at the end)", flush=True)
        out[system_name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (build/bin built)")
    parser.add_argument("--models-dir", type=Path, default=Path("/work/peers/models"))
    parser.add_argument("--files", default=",".join(FILES), help=f"comma-separated subset of {','.join(FILES)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="each part this many times per system; the best is kept")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of each stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pagoda-kv-gib", type=float, default=None,
                        help="the executor's --kv-cache-memory-gb (default: llama.cpp's KV tokens, up to 32,768, in float32)")
    parser.add_argument("--llama-slots", type=int, default=None,
                        help=f"llama-server's slots of {SLOT_CONTEXT} tokens (default: 48 with w48, else 4)")
    parser.add_argument("--make-only", action="store_true", help="make the missing files and stop")
    parser.add_argument("--scheduler-args", default="")
    parser.add_argument("--w48-requests", type=int, default=48)
    parser.add_argument("--w48-prompt-len", default="32:384")
    parser.add_argument("--w48-output-len", default="16:160")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON of every figure (default: none)")
    args = parser.parse_args()
    try:
        files = parse_names(args.files, FILES, "--files")
        systems = parse_names(args.systems, SYSTEMS, "--systems")
        parts = parse_names(args.parts, PARTS, "--parts")
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1 or args.threads < 1 or args.tokens < 2:
        parser.error("--rounds and --threads must be >= 1, --tokens >= 2")
    if args.llama_slots is None:
        args.llama_slots = args.w48_requests if "w48" in parts else NUM_STREAMS
    exit_on_sigterm()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    paths = ensure_files(files, args.models_dir, args.llama_cpp)
    if args.make_only:
        return

    from bench.bench_one_stream import prompt_ids

    chat_ids = prompt_ids()
    machine = machine_info()
    flags = sorted(f for f in Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].strip(" :").split()
                   if f.startswith(("avx", "amx", "fma", "f16c", "vnni", "sse4")))
    bandwidth = read_bandwidth(args.threads)
    print(machine_line(machine), flush=True)
    print(f"CPU flags: {' '.join(flags)}; read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads)", flush=True)
    results: dict[str, dict] = {}
    for name in files:
        results[name] = run_file(name, paths[name], parts, systems, args, chat_ids)
    bandwidth_after = read_bandwidth(args.threads)

    print()
    print(machine_line(machine))
    print(f"CPU flags: {' '.join(flags)}")
    print(f"read bandwidth: {bandwidth:.1f} GB/s before, {bandwidth_after:.1f} GB/s after ({args.threads} threads); "
          f"the roofline uses the higher")
    bandwidth = max(bandwidth, bandwidth_after)
    print(f"one/four: {PROMPT_LEN}-token prompt, {args.tokens} tokens; W48 as bench_cpu_peers; greedy, ignore_eos; "
          f"{args.threads} threads each; best of {args.rounds} round(s)")
    rows, mem_rows = [], []
    fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
    for name, by_system in results.items():
        size, read = bytes_per_token(paths[name])
        roof = bandwidth * 1e9 / read
        base = by_system.get("llama.cpp", {})
        for system_name, row in by_system.items():
            get = lambda part, key: row.get(part, {}).get(key)  # noqa: E731
            ratio = lambda part: (get(part, "output_tokens_per_s") / base[part]["output_tokens_per_s"]  # noqa: E731
                                  if part in row and part in base else None)
            decode = get("one", "decode_tokens_per_s")
            rows.append([name, f"{size / 1e9:.2f}", f"{roof:.1f}", system_name,
                         fmt(get("one", "output_tokens_per_s"), "{:.2f}"), fmt(decode, "{:.2f}"),
                         fmt(decode and 100 * decode / roof, "{:.0f}%"), fmt(ratio("one"), "{:.2f}x"),
                         fmt(get("four", "output_tokens_per_s"), "{:.2f}"), fmt(ratio("four"), "{:.2f}x"),
                         fmt(get("w48", "duration_s"), "{:.1f}"), fmt(get("w48", "output_tokens_per_s"), "{:.1f}"),
                         fmt(ratio("w48"), "{:.2f}x")])
            if "memory" in parts:
                mem = row["memory"]
                mem_rows.append([name, system_name, f"{size / 2**30:.2f}", f"{row['kv_bytes'] / 2**30:.2f}",
                                 f"{mem['VmHWM'] / 2**30:.2f}", f"{mem['VmHWM'] / (size + row['kv_bytes']):.2f}x",
                                 f"{mem['RssAnon'] / 2**30:.2f}", f"{mem['RssFile'] / 2**30:.2f}",
                                 f"{row['startup_s']:.1f}"])
    print(format_table(["file", "GB", "roofline tok/s", "system", "1 stream tok/s", "1 stream decode tok/s",
                        "% roofline", "1 stream vs llama.cpp", "4 streams tok/s", "4 streams vs llama.cpp",
                        "W48 s", "W48 tok/s", "W48 vs llama.cpp"], rows))
    if mem_rows:
        print()
        print(format_table(["file", "system", "file GiB", "KV GiB", "peak RSS (VmHWM) GiB", "peak / (file + KV)",
                            "anon RSS GiB", "file-backed RSS GiB", "start-up to 1st token s"], mem_rows))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "flags": flags, "bandwidth_gb_s": bandwidth,
                                        "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1, default=str))
        print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
