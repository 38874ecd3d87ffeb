"""Every Triton kernel of kernels/ compiled for the GPUs people have, on any machine: no GPU needed.

    python bench/kernel_compile_table.py                   # sm_80, sm_89, sm_90, gfx942: a markdown table
    python bench/kernel_compile_table.py --target sm_80    # one target (repeatable)
    python bench/kernel_compile_table.py --jobs 2          # compile in 2 processes
    python bench/kernel_compile_table.py --quick           # the smaller cross-section make test compiles

`triton.compile` with an explicit `GPUTarget` runs the whole pipeline the first launch on that GPU
would run (TTIR, TTGIR, LLVM IR, then PTX and a cubin through the ptxas that ships with Triton,
or AMDGCN and an hsaco through Triton's own LLVM), so a kernel that the interpreter accepts but a
GPU's compiler rejects fails here. Each variant is what a launcher chooses (the `*_config`
functions beside each kernel in kernels/) for a model shape and a batch, with the KV cache dtypes
the executor accepts on that GPU (`executor_svc.attention.kv_cache_dtype_for`: e4m3 from sm_89,
e5m2 from sm_80). It is a cross-section, not the full product: around a base of bf16, head dim
128, block size 16, GQA 4, each of dtype, FP8 KV, head dim, block size and GQA ratio varies
alone over decode, split-KV decode and prefill batches, plus the fp32 head-dim-256 prefill that
needs the most shared memory.

Columns: compile seconds (a fresh Triton cache unless --cache), shared memory in bytes
(`metadata.shared`, checked against the target's per-block limit), registers and spills per
thread. Triton reads those two from the driver at load time (`n_regs`, `n_spills`), which needs
the GPU; here CUDA's come from the `ptxas -v` log of the compile ("Used N registers", "N bytes
spill stores") and AMD's from the code object's metadata in the assembly (`.vgpr_count`, and 4
bytes per `.vgpr_spill_count` and `.sgpr_spill_count`).

Exits 1 when a variant fails to compile or needs more shared memory than its target has.
tests/kernels/test_compile_targets.py runs it in `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, when run as a script


@dataclass(frozen=True)
class Target:
    name: str
    gpu: str
    backend: str  # triton's: cuda or hip
    arch: int | str
    warp_size: int
    capability: tuple[int, int]  # for the executor's KV cache dtype rule (ROCm: as torch reports gfx942)
    num_sms: int  # sizes the split-KV choice
    max_shared: int  # bytes of shared memory one block may use (CUDA's opt-in maximum; AMD's LDS)

    @property
    def rocm(self) -> bool:
        return self.backend == "hip"


TARGETS = {
    t.name: t
    for t in (
        Target("sm_80", "A100", "cuda", 80, 32, (8, 0), 108, 163 * 1024),
        Target("sm_89", "L4 / RTX 4090", "cuda", 89, 32, (8, 9), 58, 99 * 1024),
        Target("sm_90", "H100 / H200", "cuda", 90, 32, (9, 0), 132, 227 * 1024),
        Target("gfx942", "MI300X", "hip", "gfx942", 64, (9, 4), 304, 64 * 1024),
    )
}

# Scalar (non-pointer, non-constexpr) arguments that are floats; every other one is an int32.
FLOAT_SCALARS = {"qk_scale", "v_scale", "k_scale", "eps", "scale"}


@dataclass(frozen=True)
class Variant:
    kernel: str  # "module.function" under kernels/
    label: str
    pointers: tuple[tuple[str, str], ...]  # (argument, Triton element type), e.g. ("q_ptr", "bf16")
    meta: tuple[tuple[str, object], ...]  # the launch's keyword arguments: constexprs, num_warps

    @property
    def key(self) -> tuple:
        return (self.kernel, self.pointers, self.meta)


@dataclass(frozen=True)
class Row:
    target: str
    kernel: str
    label: str
    seconds: float
    shared: int
    registers: int
    spills: int
    error: str = ""


def _variant(kernel: str, label: str, pointers: dict[str, str], meta: dict[str, object]) -> Variant:
    return Variant(kernel, label, tuple(sorted(pointers.items())), tuple(sorted(meta.items())))


def variants(target: Target, quick: bool = False) -> list[Variant]:
    """What the launchers choose on `target` across the cross-section; duplicates dropped, first label kept.

    `quick`: a smaller cross-section (what `make test` compiles): every kernel, every axis of the
    attention kernel once around the base, every FP8 KV format the target accepts in a split-KV
    decode and a prefill, the MoE shapes of both models.
    """
    found: dict[tuple, Variant] = {}
    for v in [*_attention_variants(target, quick), *_cache_variants(target, quick), *_layer_variants(quick),
              *_moe_variants(quick), *_lora_variants(quick)]:
        found.setdefault(v.key, v)
    return list(found.values())


def _type(dtype) -> str:
    import torch

    return {
        torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
        torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
    }[dtype]


def _kv_dtypes(target: Target) -> list[tuple[str, object]]:
    """(name, torch dtype) of each FP8 `--kv-cache-dtype` the executor accepts on `target`."""
    from executor_svc.attention import kv_cache_dtype_for

    accepted = []
    for name in ("fp8_e4m3", "fp8_e5m2"):
        try:
            accepted.append((name, kv_cache_dtype_for(name, target.capability, rocm=target.rocm)))
        except ValueError:
            pass
    return accepted


# Batches: (name, num_seqs, max_query_len, max_seq_len)
DECODE = ("decode", 256, 1, 4096)
DECODE_FEW = ("decode x1", 1, 1, 8192)  # one long decode: split-KV on every target
PREFILL = ("prefill", 4, 2048, 2048)
CHUNK = ("chunk", 8, 16, 1024)  # short chunks beside decodes: BLOCK_M 16, TILE_N 32


def _attention_variants(target: Target, quick: bool) -> list[Variant]:
    import torch

    from kernels.paged_attention import paged_attention_config, reduce_segments_config

    def one(dtype, kv_dtype, kv_name, head_dim, block_size, gqa, batch) -> list[Variant]:
        batch_name, num_seqs, max_query_len, max_seq_len = batch
        num_kv_heads = 8
        config = paged_attention_config(
            dtype, kv_dtype, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, num_seqs, max_query_len,
            max_seq_len, target.num_sms, max_shared=target.max_shared,
        )
        segments = config["NUM_SEGMENTS"]
        label = (f"{_type(dtype)} kv={kv_name} {batch_name} hd{head_dim} bs{block_size} gqa{gqa} "
                 f"m{config['BLOCK_M']} n{config['TILE_N']} seg{segments}")
        pointers = dict(out_ptr=_type(dtype), q_ptr=_type(dtype), k_cache_ptr=_type(kv_dtype),
                        v_cache_ptr=_type(kv_dtype), segm_acc_ptr="fp32", segm_max_ptr="fp32", segm_sum_ptr="fp32",
                        query_start_loc_ptr="i32", seq_lens_ptr="i32", block_table_ptr="i32")
        found = [_variant("paged_attention._paged_attention_kernel", label, pointers, config)]
        if segments > 1:
            found.append(_variant(
                "paged_attention._reduce_segments_kernel", f"{_type(dtype)} hd{head_dim} seg{segments}",
                dict(out_ptr=_type(dtype), segm_acc_ptr="fp32", segm_max_ptr="fp32", segm_sum_ptr="fp32"),
                reduce_segments_config(config),
            ))
        return found

    bf16 = torch.bfloat16
    found = []
    if quick:
        for batch in (DECODE, DECODE_FEW, PREFILL, CHUNK):
            found += one(bf16, bf16, "auto", 128, 16, 4, batch)
        for kv_name, kv_dtype in _kv_dtypes(target):
            for batch in (DECODE_FEW, PREFILL):
                found += one(bf16, kv_dtype, kv_name, 128, 16, 4, batch)
        found += one(torch.float16, torch.float16, "auto", 128, 16, 4, PREFILL)
        found += one(torch.float32, torch.float32, "auto", 128, 16, 4, DECODE)
        found += one(bf16, bf16, "auto", 64, 16, 4, DECODE)
        found += one(bf16, bf16, "auto", 256, 16, 4, PREFILL)
        found += one(bf16, bf16, "auto", 128, 32, 4, DECODE)
        found += one(bf16, bf16, "auto", 128, 16, 1, PREFILL)
        found += one(bf16, bf16, "auto", 128, 16, 8, DECODE)
        return found
    for batch in (DECODE, DECODE_FEW, PREFILL):
        found += one(bf16, bf16, "auto", 128, 16, 4, batch)
        for dtype in (torch.float16, torch.float32):
            found += one(dtype, dtype, "auto", 128, 16, 4, batch)
        for kv_name, kv_dtype in _kv_dtypes(target):
            found += one(bf16, kv_dtype, kv_name, 128, 16, 4, batch)
        for head_dim in (64, 256):
            found += one(bf16, bf16, "auto", head_dim, 16, 4, batch)
        for gqa in (1, 8):
            found += one(bf16, bf16, "auto", 128, 16, gqa, batch)
    for batch in (DECODE, PREFILL):
        found += one(bf16, bf16, "auto", 128, 32, 4, batch)
    found += one(bf16, bf16, "auto", 128, 16, 4, CHUNK)
    found += one(torch.float32, torch.float32, "auto", 256, 16, 4, PREFILL)  # the most shared memory
    return found


def _cache_variants(target: Target, quick: bool) -> list[Variant]:
    import torch

    from kernels.copy_blocks import copy_blocks_config
    from kernels.reshape_and_cache import reshape_and_cache_config

    found = []
    caches = [("auto", torch.bfloat16), ("auto", torch.float32), *_kv_dtypes(target)]
    for kv_name, cache_dtype in caches:
        model_dtype = torch.bfloat16 if cache_dtype != torch.float32 else torch.float32
        shapes = ((8, 128, 16), (8, 256, 32))
        for num_kv_heads, head_dim, block_size in shapes[:1] if quick and cache_dtype != torch.float32 else shapes:
            found.append(_variant(
                "reshape_and_cache._reshape_and_cache_kernel",
                f"{_type(model_dtype)} kv={kv_name} kv_heads{num_kv_heads} hd{head_dim} bs{block_size}",
                dict(key_ptr=_type(model_dtype), value_ptr=_type(model_dtype), k_cache_ptr=_type(cache_dtype),
                     v_cache_ptr=_type(cache_dtype), slot_mapping_ptr="i64"),
                reshape_and_cache_config(num_kv_heads, head_dim, block_size, cache_dtype),
            ))
        found.append(_variant(
            "copy_blocks._copy_blocks_kernel", f"{_type(cache_dtype)}",
            dict(cache_ptrs_ptr="i64", dtype_ref_ptr=_type(cache_dtype), src_dst_ptr="i64"), copy_blocks_config(),
        ))
    return found


# (model, hidden, num_heads, num_kv_heads, head_dim): the layer shapes of the norm, rotary and activation
MODELS = [
    ("SmolLM2-135M", 576, 9, 3, 64, 1536),
    ("Llama-3-8B", 4096, 32, 8, 128, 14336),
    ("Llama-3-70B", 8192, 64, 8, 128, 28672),
    ("Gemma-2-9B", 3584, 16, 8, 256, 14336),
]


def _layer_variants(quick: bool) -> list[Variant]:
    from kernels.activation import silu_and_mul_config
    from kernels.rms_norm import rms_norm_config
    from kernels.rotary import rotary_config

    found = []
    quick_norms = {("bf16", True, "Llama-3-8B"), ("fp32", False, "Gemma-2-9B")}
    for model, hidden, num_heads, num_kv_heads, head_dim, intermediate in MODELS:
        if quick and model not in ("Llama-3-8B", "Gemma-2-9B"):
            continue
        for dtype in ("bf16", "fp32"):
            for residual in (False, True):
                if quick and (dtype, residual, model) not in quick_norms:
                    continue
                found.append(_variant(
                    "rms_norm._rms_norm_kernel", f"{dtype} {model} hidden{hidden} residual={residual}",
                    dict(out_ptr=dtype, residual_out_ptr=dtype, x_ptr=dtype, residual_ptr=dtype, weight_ptr=dtype),
                    rms_norm_config(hidden, residual),
                ))
        found.append(_variant(
            "rotary._rotary_kernel", f"bf16 {model} heads{num_heads}/{num_kv_heads} hd{head_dim}",
            dict(q_ptr="bf16", k_ptr="bf16", positions_ptr="i64", cos_sin_cache_ptr="fp32"),
            rotary_config(num_heads, num_kv_heads, head_dim),
        ))
        found.append(_variant(
            "activation._silu_and_mul_kernel", f"bf16 {model} intermediate{intermediate}",
            dict(out_ptr="bf16", x_ptr="bf16"), silu_and_mul_config(intermediate),
        ))
    return found


# (model, num_experts, top_k, hidden, moe intermediate)
MOE_MODELS = [("Mixtral-8x7B", 8, 2, 4096, 14336), ("Qwen3-30B-A3B", 128, 8, 2048, 768)]


def _moe_variants(quick: bool) -> list[Variant]:
    import torch

    from kernels.fused_moe import fused_moe_config

    found = []
    for model, num_experts, top_k, hidden, intermediate in MOE_MODELS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for num_tokens in (4, 2048):  # a decode batch (BLOCK_M 16), a prefill (64)
                gate_up, down = fused_moe_config(dtype, num_tokens, num_experts, top_k, hidden, intermediate)
                for name, config, out in (("gate_up", gate_up, _type(dtype)), ("down", down, "fp32")):
                    if quick and (dtype != torch.bfloat16 or (name == "gate_up") != (num_tokens == 4)):
                        continue  # bf16 only: a decode's gate_up, a prefill's down
                    found.append(_variant(
                        "fused_moe._fused_moe_kernel",
                        f"{_type(dtype)} {model} {name} tokens{num_tokens} m{config['BLOCK_M']} n{config['BLOCK_N']} "
                        f"k{config['BLOCK_K']}",
                        dict(c_ptr=out, a_ptr=_type(dtype), b_ptr=_type(dtype), topk_weights_ptr="fp32",
                             sorted_pair_ids_ptr="i32", block_expert_ids_ptr="i32", num_padded_pairs_ptr="i32"),
                        config,
                    ))
    return found


# (model, hidden, q/k/v rows, intermediate): the projections a LoRA adapter's shrink reads and expand writes
LORA_MODELS = [("Llama-3-8B", 4096, 6144, 14336), ("Qwen3-0.6B", 1024, 4096, 3072)]


def _lora_variants(quick: bool) -> list[Variant]:
    """The multi-LoRA shrink and expand (kernels/lora.py) as their launchers configure them: a decode
    step (4 rows of one slot) and a prefill (512), rank 16 and 64 (zero-padded stacks), 16-bit and fp32."""
    from kernels.lora import lora_config

    found = []
    slots = dict(sorted_token_ids_ptr="i32", slot_ids_ptr="i32", num_tokens_per_slot_ptr="i32", slot_start_loc_ptr="i32")
    for model, hidden, qkv, intermediate in LORA_MODELS:
        for dtype in ("bf16", "fp16", "fp32"):
            for rows in (4, 512):
                for rank in (16, 64):
                    if quick and (model != "Llama-3-8B" or dtype == "fp16" or (rows == 4) != (rank == 16)):
                        continue
                    precision = "ieee" if dtype == "fp32" else "tf32"
                    shrink = lora_config("shrink", rows, hidden, 0, 3 * rank, 4 if dtype == "fp32" else 2)
                    found.append(_variant(
                        "lora._lora_shrink_kernel", f"{dtype} {model} shrink rows{rows} rank3x{rank}",
                        dict(out_ptr="fp32", x_ptr=dtype, a_ptr=dtype, **slots),
                        {**shrink, "DOT_IN_FP32": False, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32"},
                    ))
                    for name, n in (("qkv", qkv), ("down", hidden), ("gate_up", 2 * intermediate)):
                        if quick and name != "gate_up":
                            continue
                        found.append(_variant(
                            "lora._lora_expand_kernel", f"{dtype} {model} expand {name} rows{rows} rank{rank}",
                            dict(out_ptr=dtype, y_ptr="fp32", b_ptr=dtype, **slots),
                            {**lora_config("expand", rows, 0, n, rank), "ADD": True, "DOT_PRECISION": precision},
                        ))
    return found


def compile_variant(target: Target, variant: Variant) -> Row:
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = variant.kernel.split(".")
    fn = getattr(importlib.import_module(f"kernels.{module}"), name)
    meta = dict(variant.meta)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    pointers = dict(variant.pointers)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in meta:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = "*" + pointers[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the JIT specialises aligned tensors
        else:
            signature[arg] = "fp32" if arg in FLOAT_SCALARS else "i32"
    gpu = GPUTarget(target.backend, target.arch, target.warp_size)
    knobs.nvidia.dump_ptxas_log = True  # printed: caught below
    ptxas_log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(ptxas_log):
            compiled = triton.compile(ASTSource(fn, signature, meta, attrs), target=gpu, options=options)
    except Exception as exc:  # noqa: BLE001 (the table reports every failure, then exits 1)
        message = " ".join(str(exc).split())[:300]
        return Row(target.name, variant.kernel, variant.label, time.perf_counter() - start, 0, 0, 0,
                   f"{type(exc).__name__}: {message}")
    seconds = time.perf_counter() - start
    if target.backend == "cuda":
        registers, spills = _cuda_resources(ptxas_log.getvalue())
    else:
        registers, spills = _amd_resources(compiled.asm["amdgcn"])
    error = ""
    if compiled.metadata.shared > target.max_shared:
        error = f"shared memory {compiled.metadata.shared} B > {target.max_shared} B"
    return Row(target.name, variant.kernel, variant.label, seconds, compiled.metadata.shared, registers, spills, error)


def _cuda_resources(ptxas_log: str) -> tuple[int, int]:
    """(registers, bytes of spill stores) per thread of the kernel, from `ptxas -v` (Triton runs it with -v)."""
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores", ptxas_log)
    if registers is None or spills is None:
        raise RuntimeError(f"no register or spill counts in the ptxas log: {ptxas_log!r}")
    return int(registers.group(1)), int(spills.group(1))


def _amd_resources(amdgcn: str) -> tuple[int, int]:
    """(VGPRs, bytes of spilled VGPRs + SGPRs, 4 per register and lane) from the code object metadata."""
    fields = dict(re.findall(r"^\s*\.(vgpr_count|vgpr_spill_count|sgpr_spill_count):\s*(\d+)", amdgcn, re.M))
    if len(fields) != 3:
        raise RuntimeError(f"register counts missing from the AMDGCN metadata: found {fields}")
    return int(fields["vgpr_count"]), 4 * (int(fields["vgpr_spill_count"]) + int(fields["sgpr_spill_count"]))


def _compile_one(job: tuple[str, Variant]) -> Row:
    return compile_variant(TARGETS[job[0]], job[1])


def compile_all(targets: list[Target], jobs: int = 1, quick: bool = False) -> list[Row]:
    work = [(t.name, v) for t in targets for v in variants(t, quick)]
    if jobs <= 1:
        return [_compile_one(job) for job in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, work, chunksize=4))


def markdown(rows: list[Row]) -> str:
    lines = [
        "| kernel | target | variant | compile s | shared B | registers | spills B | result |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        result = r.error or "ok"
        lines.append(f"| {r.kernel} | {r.target} | {r.label} | {r.seconds:.2f} | {r.shared} | {r.registers} "
                     f"| {r.spills} | {result} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    lines = [
        "| target | variants | failed | compile s (sum) | largest shared B (limit) | most registers "
        "| variants that spill |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, target in TARGETS.items():
        mine = [r for r in rows if r.target == name]
        if mine:
            lines.append(
                f"| {name} ({target.gpu}) | {len(mine)} | {sum(bool(r.error) for r in mine)} "
                f"| {sum(r.seconds for r in mine):.1f} | {max(r.shared for r in mine)} ({target.max_shared}) "
                f"| {max(r.registers for r in mine)} | {sum(r.spills > 0 for r in mine)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: every target")
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes")
    parser.add_argument("--quick", action="store_true", help="the smaller cross-section make test compiles")
    parser.add_argument("--cache", action="store_true", help="use Triton's cache (compile times then measure hits)")
    args = parser.parse_args(argv)
    if os.environ.pop("TRITON_INTERPRET", None) == "1" and "kernels.paged_attention" in sys.modules:
        raise SystemExit("kernels were imported under TRITON_INTERPRET=1: run this in a fresh process")
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache_dir:
        if not args.cache:
            os.environ["TRITON_CACHE_DIR"] = cache_dir  # read by each compile, in this and the worker processes
        targets = [TARGETS[name] for name in (args.target or TARGETS)]
        start = time.perf_counter()
        rows = compile_all(targets, args.jobs, args.quick)
        wall = time.perf_counter() - start
    import triton

    print(f"Triton {triton.__version__}, {len(rows)} compiles in {wall:.1f} s wall, --jobs {args.jobs}\n")
    print(summary(rows) + "\n")
    print(markdown(rows))
    failed = [r for r in rows if r.error]
    for r in failed:
        print(f"FAILED {r.target} {r.kernel} [{r.label}]: {r.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
