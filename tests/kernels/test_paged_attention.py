"""kernels.paged_attention against a per-request torch reference, on mixed prefill/decode batches.

Every cache slot that no request owns (the null block included) holds NaN, so a read past
a sequence's end or through the block table's padding shows up in the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kernels.paged_attention import paged_attention
from kernels.paged_attention import choose_num_segments, paged_attention_config
from tests.kernels.conftest import skip_unless_the_gpu_converts

# --kv-cache-dtype fp8_e4m3 and fp8_e5m2, with the mean and largest error against the unquantised
# K/V that their 3 and 2 mantissa bits leave on outputs of unit scale
FP8_FORMATS = {"e4m3": (torch.float8_e4m3fn, 0.02, 0.25), "e5m2": (torch.float8_e5m2, 0.035, 0.5)}
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1.5e-2, rtol=2e-2)}

# (context_len, query_len): fresh decode at length 1, a 15-token prefill, a decode at 17,
# a chunked prefill reaching 100, a decode at 121, a short chunk.
MIXED = [(0, 1), (0, 15), (16, 1), (83, 17), (120, 1), (30, 3)]
DECODES = [(0, 1), (16, 1), (150, 1), (40, 1)]


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], fp32, before any quantisation
    values: list[torch.Tensor]


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    cache_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Batch:
    """Random q and a paged cache holding each request's K/V, blocks in random order."""
    cache_dtype = cache_dtype or dtype
    seq_lens = [c + n for c, n in requests]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # null block + owned + spare
    block_ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_table = torch.zeros(len(requests), max(blocks_per_seq) + 2, dtype=torch.int32)

    k_cache = torch.full((num_blocks * block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [], []
    for i, seq_len in enumerate(seq_lens):
        ids = [block_ids.pop() for _ in range(blocks_per_seq[i])]
        block_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim))
        k_cache[slots] = keys[-1] / k_scale
        v_cache[slots] = values[-1] / v_scale
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    num_tokens = sum(n for _, n in requests)
    # q is a strided view, as when it is split from a fused qkv projection.
    q = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(dtype).to(device)[:, :num_heads]
    query_start_loc = torch.tensor([0] + [n for _, n in requests], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return Batch(
        q=q,
        k_cache=k_cache.view(shape).to(cache_dtype).to(device),
        v_cache=v_cache.view(shape).to(cache_dtype).to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        max_query_len=max(n for _, n in requests),
        max_seq_len=max(seq_lens),
        keys=keys,
        values=values,
    )


def reference(
    batch: Batch, scale: float, *, from_cache: bool = True, k_scale: float = 1.0, v_scale: float = 1.0
) -> torch.Tensor:
    """fp32 causal attention per request, K/V read back from the cache through the block table or taken as generated."""
    q = batch.q.float().cpu()
    num_heads = q.shape[1]
    block_size = batch.k_cache.shape[1]
    k_slots = batch.k_cache.float().cpu().flatten(0, 1) * k_scale
    v_slots = batch.v_cache.float().cpu().flatten(0, 1) * v_scale
    qsl = batch.query_start_loc.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        context_len = seq_len - (end - start)
        pos = torch.arange(seq_len)
        if from_cache:
            slots = batch.block_table[i].cpu()[pos // block_size].long() * block_size + pos % block_size
            k, v = k_slots[slots], v_slots[slots]
        else:
            k, v = batch.keys[i], batch.values[i]
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale
        visible = pos[None, :] <= context_len + torch.arange(end - start)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def run(batch: Batch, scale: float, **kwargs) -> torch.Tensor:
    return paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        scale,
        batch.max_query_len,
        batch.max_seq_len,
        **kwargs,
    )


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, **tolerance) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **(tolerance or TOLERANCE[dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch(group, block_size, dtype, device):
    num_kv_heads, head_dim = 2, 64
    batch = make_batch(
        MIXED, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device,
    )
    scale = head_dim**-0.5
    assert_close(run(batch, scale), reference(batch, scale), dtype)


@pytest.mark.parametrize("head_dim", [128, 48, 80])
def test_head_dims(head_dim, device):
    batch = make_batch(
        MIXED, num_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=16, dtype=torch.bfloat16, device=device
    )
    scale = head_dim**-0.5
    assert_close(run(batch, scale), reference(batch, scale), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_segments", [2, 8])
@pytest.mark.parametrize("group", [1, 4])
def test_split_kv_decode(group, num_segments, dtype, device):
    batch = make_batch(
        DECODES, num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device=device
    )
    scale = 0.125
    assert_close(run(batch, scale, num_segments=num_segments, tile_n=16), reference(batch, scale), dtype)


def test_split_kv_mixed_batch(device):
    """Segments that a causal prefill row cannot see come back empty and must merge to nothing."""
    batch = make_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.float32, device=device
    )
    assert_close(run(batch, 0.125, num_segments=4, tile_n=16), reference(batch, 0.125), torch.float32)


@pytest.mark.parametrize("fp8", FP8_FORMATS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_cache(block_size, fp8, device):
    cache_dtype, mean_error, max_error = FP8_FORMATS[fp8]
    skip_unless_the_gpu_converts(cache_dtype, device)
    k_scale, v_scale = 6.0 / 448, 5.0 / 448
    batch = make_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=torch.bfloat16,
        device=device, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
    )
    out = run(batch, 0.125, k_scale=k_scale, v_scale=v_scale)
    # Tight against the same quantised cache; against the values before quantisation the
    # mantissa's bits bound the error.
    assert_close(out, reference(batch, 0.125, k_scale=k_scale, v_scale=v_scale), torch.bfloat16)
    error = (out.float().cpu() - reference(batch, 0.125, from_cache=False)).abs()
    assert error.mean() < mean_error and error.max() < max_error


@pytest.mark.parametrize("fp8", FP8_FORMATS)
def test_fp8_split_kv(fp8, device):
    skip_unless_the_gpu_converts(FP8_FORMATS[fp8][0], device)
    k_scale = v_scale = 6.0 / 448
    batch = make_batch(
        DECODES, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16,
        device=device, cache_dtype=FP8_FORMATS[fp8][0], k_scale=k_scale, v_scale=v_scale,
    )
    out = run(batch, 0.125, k_scale=k_scale, v_scale=v_scale, num_segments=4, tile_n=16)
    assert_close(out, reference(batch, 0.125, k_scale=k_scale, v_scale=v_scale), torch.bfloat16)


@pytest.mark.slow
@pytest.mark.slow  # ~10 s each in Triton's interpreter on 2 shared cores
@pytest.mark.parametrize("num_segments", [None, 8])
def test_long_context(num_segments, device):
    requests = [(1030, 1), (1000, 40), (7, 1)]
    if num_segments:
        requests = [(c + n - 1, 1) for c, n in requests]
    batch = make_batch(
        requests, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16, device=device
    )
    assert_close(run(batch, 0.125, num_segments=num_segments), reference(batch, 0.125), torch.bfloat16)


def test_choose_num_segments():
    # Few long decodes on a big GPU split; full batches, prefills and short contexts do not.
    assert choose_num_segments(1, 8, 1, 8192, 64, num_sms=132) == 32  # 4 tiles per segment at least
    assert choose_num_segments(16, 8, 1, 4096, 64, num_sms=132) == 4
    assert choose_num_segments(64, 8, 1, 4096, 64, num_sms=132) == 1
    assert choose_num_segments(1, 8, 2, 8192, 64, num_sms=132) == 1
    assert choose_num_segments(1, 8, 1, 200, 64, num_sms=132) == 1
    assert choose_num_segments(1, 8, 1, 8192, 64, num_sms=0) == 1


def test_tiles_shrink_to_the_gpus_shared_memory():
    # fp32 operands take twice bf16's shared memory: on a 64 KB GPU (MI300X) or a 99 KB one (L4) the
    # default tiles do not fit, and the compile table showed it (69,632 B on gfx942, 139,776 B on sm_89).
    def tiles(dtype, head_dim, max_query_len, max_shared, **kw):
        config = paged_attention_config(dtype, dtype, 32, 8, head_dim, 16, 4, max_query_len, 4096, 132,
                                        max_shared=max_shared, **kw)
        return config["BLOCK_M"], config["TILE_N"]

    assert tiles(torch.float32, 128, 1, None) == (16, 64)
    assert tiles(torch.float32, 128, 1, 64 * 1024) == (16, 32)
    assert tiles(torch.float32, 256, 512, 99 * 1024) == (32, 16)
    assert tiles(torch.float32, 256, 512, 64 * 1024) == (16, 16)
    assert tiles(torch.float32, 256, 512, 227 * 1024) == (64, 32)
    assert tiles(torch.bfloat16, 128, 512, 99 * 1024) == (64, 32)
    assert tiles(torch.float32, 128, 1, 64 * 1024, tile_n=64) == (16, 64)  # a forced tile_n stays


def test_rejects_bad_inputs(device):
    batch = make_batch(
        [(3, 2)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    with pytest.raises(ValueError, match="block_table"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
                        batch.block_table.long(), 0.125, 2, 5)
    with pytest.raises(ValueError, match="fp8|float8"):
        run(batch, 0.125, k_scale=0.5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention(batch.q[:, :1].expand(-1, 3, -1), batch.k_cache.expand(-1, -1, 2, -1),
                        batch.v_cache.expand(-1, -1, 2, -1), batch.query_start_loc, batch.seq_lens,
                        batch.block_table, 0.125, 2, 5)
