"""reshape_and_cache: write this step's K/V rows into their paged-cache slots.

Token t goes to slot `slot_mapping[t]` = `block_id * block_size + offset`, i.e.
`k_cache[block_id, offset]`; slot -1 (e.g. a padding token) is skipped. With an FP8 cache
each value is stored as `clamp(x / scale, -max, max)`, max = 448 for float8_e4m3fn and 57344
for float8_e5m2 (their largest finite values), rounded to nearest even as torch's cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)

# dtype -> (largest finite value, mantissa bits, smallest normal exponent)
_FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}


@triton.jit
def _round_to_fp8(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round fp32 `x` (within the format's range) to the nearest FP8 value, ties to even, so the cast is exact.

    With M mantissa bits, values in [2^e, 2^(e+1)) sit on a grid of 2^(e-M), with e >=
    MIN_EXPONENT (below that, the subnormal grid 2^(MIN_EXPONENT-M)): e4m3 M=3, e >= -6;
    e5m2 M=2, e >= -14. Adding and subtracting 1.5 * 2^23 * grid rounds to that grid in
    fp32's own round-to-nearest-even. (Triton's interpreter casts fp32 -> fp8 wrongly when
    rounding carries; a value already on the grid casts exactly there and on GPUs alike.)
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    magic = ((exponent - MANTISSA_BITS + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    return (x + magic) - magic


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale,
    v_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    slot_in_block = slot % BLOCK_SIZE

    heads = tl.arange(0, NUM_KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask)
    if KV_IS_FP8:  # correctly rounded division, so the cache matches torch's x / scale bit for bit
        k = tl.clamp(tl.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX)
        k = _round_to_fp8(k, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT)
        v = _round_to_fp8(v, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT)

    k_dst = k_cache_ptr + block_id * stride_k_cache_block + slot_in_block * stride_k_cache_slot
    v_dst = v_cache_ptr + block_id * stride_v_cache_block + slot_in_block * stride_v_cache_slot
    k_dst += heads[:, None] * stride_k_cache_head + dims[None, :]
    v_dst += heads[:, None] * stride_v_cache_head + dims[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write `key`/`value` [num_tokens, num_kv_heads, head_dim] into `k_cache`/`v_cache` in place.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim] in key's dtype or an FP8
    dtype (float8_e4m3fn, float8_e5m2: then quantised with `k_scale`/`v_scale`); `slot_mapping` [num_tokens]
    int64, -1 = skip. Slots must be distinct (two tokens writing one slot race).
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be the same 3-D shape")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match and be 4-D")
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold key [.., {num_kv_heads}, {head_dim}]")
    if key.dtype != value.dtype:
        raise ValueError(f"key {key.dtype} and value {value.dtype} differ")
    kv_is_fp8 = k_cache.dtype in _FP8_FORMATS
    if k_cache.dtype != key.dtype and not kv_is_fp8:
        raise ValueError(f"cache dtype {k_cache.dtype} must be key's ({key.dtype}) or one of {tuple(_FP8_FORMATS)}")
    if not kv_is_fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError("k_scale and v_scale apply to an fp8 cache (float8_e4m3fn, float8_e5m2) only")
    if kv_is_fp8 and not (k_scale > 0.0 and v_scale > 0.0):
        raise ValueError(f"fp8 scales must be positive, got k_scale={k_scale} v_scale={v_scale}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        got = f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        raise ValueError(f"slot_mapping must be contiguous int64 [{num_tokens}], got {got}")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("key, value and the caches need a unit stride on head_dim")
    if len({key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}) != 1:
        raise ValueError("key, value, caches and slot_mapping must share a device")
    if num_tokens == 0:
        return

    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        **reshape_and_cache_config(num_kv_heads, head_dim, k_cache.shape[1], k_cache.dtype),
    )


def reshape_and_cache_config(
    num_kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype
) -> dict[str, object]:
    """The constexprs `reshape_and_cache` launches `_reshape_and_cache_kernel` with for a cache of `cache_dtype`."""
    fp8_max, mantissa_bits, min_exponent = _FP8_FORMATS.get(cache_dtype, (0.0, 0, 0))
    return dict(
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        KV_IS_FP8=cache_dtype in _FP8_FORMATS,
        FP8_MAX=fp8_max,
        FP8_MANTISSA_BITS=mantissa_bits,
        FP8_MIN_EXPONENT=min_exponent,
    )
