"""Every kernel variant the launchers use compiles for Hopper (sm_90), on any machine.

The interpreter checks the numbers but not what the Triton compiler accepts (loop-carried
types, casts, pointer arithmetic, dot shapes). `triton.compile` with an explicit GPU target
needs no GPU (triton ships ptxas), so CPU-only CI catches those too. It runs in a
subprocess: in this process `kernels` was imported under the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCALARS_FP32 = {"qk_scale", "v_scale", "k_scale", "eps"}


def _attention_ptrs(dtype: str, cache: str) -> dict[str, str]:
    return dict(out_ptr=dtype, q_ptr=dtype, k_cache_ptr=cache, v_cache_ptr=cache, segm_acc_ptr="fp32",
                segm_max_ptr="fp32", segm_sum_ptr="fp32", query_start_loc_ptr="i32", seq_lens_ptr="i32",
                block_table_ptr="i32")


def _attention(dtype: str, cache: str, block_m: int, tile_n: int, segments: int, group: int = 4, head_dim: int = 128):
    constexprs = dict(NUM_QUERIES_PER_KV=group, QUERIES_PER_KV_PADDED=group, HEAD_DIM=head_dim,
                      HEAD_DIM_PADDED=max(16, 1 << (head_dim - 1).bit_length()), BLOCK_SIZE=16,
                      BLOCK_Q=block_m // group, BLOCK_M=block_m, TILE_N=tile_n, NUM_SEGMENTS=segments,
                      KV_IS_FP8=cache == "fp8e4nv", DOT_IN_FP32=False,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    return ("paged_attention", "_paged_attention_kernel", _attention_ptrs(dtype, cache), constexprs)


# (module under kernels/, kernel, pointer element types, constexprs)
VARIANTS = [
    _attention("bf16", "bf16", 16, 64, 1),
    _attention("bf16", "bf16", 64, 32, 1, group=1),
    _attention("bf16", "bf16", 16, 64, 8, group=8, head_dim=80),
    _attention("bf16", "fp8e4nv", 16, 64, 1),
    _attention("bf16", "fp8e4nv", 64, 32, 4, head_dim=64),
    _attention("fp32", "fp32", 16, 32, 1, group=2),
    _attention("fp16", "fp16", 64, 32, 1),
    ("paged_attention", "_reduce_segments_kernel",
     dict(out_ptr="bf16", segm_acc_ptr="fp32", segm_max_ptr="fp32", segm_sum_ptr="fp32"),
     dict(HEAD_DIM=80, HEAD_DIM_PADDED=128, NUM_SEGMENTS=8)),
    *[("reshape_and_cache", "_reshape_and_cache_kernel",
       dict(key_ptr="bf16", value_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="i64"),
       dict(NUM_KV_HEADS=8, NUM_KV_HEADS_PADDED=8, HEAD_DIM=128, HEAD_DIM_PADDED=128, BLOCK_SIZE=16,
            KV_IS_FP8=cache == "fp8e4nv", FP8_MAX=448.0, FP8_MANTISSA_BITS=3, FP8_MIN_EXPONENT=-6))
      for cache in ("bf16", "fp8e4nv")],
    *[("copy_blocks", "_copy_blocks_kernel", dict(cache_ptrs_ptr="i64", dtype_ref_ptr=cache, src_dst_ptr="i64"),
       dict(CHUNK=2048))
      for cache in ("bf16", "fp8e4nv")],
    *[("rms_norm", "_rms_norm_kernel",
       dict(out_ptr="bf16", residual_out_ptr="bf16", x_ptr="bf16", residual_ptr="bf16", weight_ptr="bf16"),
       dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=residual))
      for residual in (False, True)],
    ("rotary", "_rotary_kernel",
     dict(q_ptr="bf16", k_ptr="bf16", positions_ptr="i64", cos_sin_cache_ptr="fp32"),
     dict(NUM_HEADS=32, NUM_HEADS_PADDED=32, NUM_KV_HEADS=8, NUM_KV_HEADS_PADDED=8, HALF=64, HALF_PADDED=64)),
    ("activation", "_silu_and_mul_kernel", dict(out_ptr="bf16", x_ptr="bf16"), dict(BLOCK=1024)),
]


def compile_all() -> None:
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import importlib

    target = GPUTarget("cuda", 90, 32)
    for module, name, ptrs, constexprs in VARIANTS:
        fn = getattr(importlib.import_module(f"kernels.{module}"), name)
        signature, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg in ptrs:
                signature[arg] = "*" + ptrs[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]  # as the JIT specialises aligned tensors
            else:
                signature[arg] = "fp32" if arg in SCALARS_FP32 else "i32"
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target)
        print(f"ok {module}.{name}", flush=True)


@pytest.mark.slow
@pytest.mark.slow  # ~100 s on 2 shared cores: make test, not make test-fast
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum(line.startswith("ok ") for line in result.stdout.splitlines()) == len(VARIANTS)


if __name__ == "__main__":
    compile_all()
