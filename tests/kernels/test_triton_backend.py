"""TritonBackend over two steps of a small batch, against SDPA on each request's whole K/V.

Step 1 prefills three requests (one chunked); step 2 mixes decodes with the rest of the
chunked prompt, so step 2 reads K/V that step 1 wrote.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import kv_cache_dtype_for
from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.triton_backend import TritonBackend
from tests.kernels.conftest import skip_unless_the_gpu_converts

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 12
SCALE = HEAD_DIM**-0.5
# Blocks per request, in a scrambled order; block 0 stays the null block.
BLOCK_IDS = [[7, 2], [5], [11, 3, 9]]
STEPS = [[20, 7, 25], [1, 1, 8]]  # scheduled tokens per request: prefill (chunk), then decode / rest of the chunk


def request_slots(i: int, positions: range) -> list[int]:
    return [BLOCK_IDS[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def metadata(computed: list[int], scheduled: list[int], device: torch.device) -> AttentionMetadata:
    slots, starts = [], [0]
    for i, (done, n) in enumerate(zip(computed, scheduled)):
        slots += request_slots(i, range(done, done + n))
        starts.append(starts[-1] + n)
    block_table = torch.zeros(len(BLOCK_IDS), 4, dtype=torch.int32)
    for i, ids in enumerate(BLOCK_IDS):
        block_table[i, : len(ids)] = torch.tensor(ids)
    seq_lens = [done + n for done, n in zip(computed, scheduled)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        max_query_len=max(scheduled),
        max_seq_len=max(seq_lens),
    )


def sdpa_reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scheduled: list[int]
) -> torch.Tensor:
    out, start = [], 0
    for k, v, n in zip(keys, values, scheduled):
        context_len = k.shape[0] - n
        visible = torch.arange(k.shape[0])[None, :] <= context_len + torch.arange(n)[:, None]
        o = F.scaled_dot_product_attention(
            q[start : start + n].float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
            attn_mask=visible, scale=SCALE, enable_gqa=True,
        )
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


@dataclass
class Step:
    q: torch.Tensor
    keys: list[torch.Tensor]  # per request, every token so far
    values: list[torch.Tensor]
    scheduled: list[int]
    out: torch.Tensor


def run_steps(
    backend: TritonBackend, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype
) -> Iterator[Step]:
    device = k_cache.device
    keys = [torch.empty(0, NUM_KV_HEADS, HEAD_DIM, dtype=dtype) for _ in BLOCK_IDS]
    values = [k.clone() for k in keys]
    computed = [0] * len(BLOCK_IDS)
    for scheduled in STEPS:
        num_tokens = sum(scheduled)
        q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)
        k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        starts = [0, *itertools.accumulate(scheduled)]
        keys = [torch.cat([keys[i], k[starts[i] : starts[i + 1]]]) for i in range(len(keys))]
        values = [torch.cat([values[i], v[starts[i] : starts[i + 1]]]) for i in range(len(values))]
        meta = metadata(computed, scheduled, device)
        out = backend.forward(q.to(device), k.to(device), v.to(device), k_cache, v_cache, meta, SCALE)
        assert out.shape == q.shape and out.dtype == dtype
        yield Step(q, keys, values, scheduled, out.cpu().float())
        computed = [c + n for c, n in zip(computed, scheduled)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_steps(dtype, device):
    tolerance = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1.5e-2, rtol=2e-2)}[dtype]
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    for step in run_steps(TritonBackend(device), k_cache, torch.zeros_like(k_cache), dtype):
        want = sdpa_reference(step.q, step.keys, step.values, step.scheduled)
        torch.testing.assert_close(step.out, want, **tolerance)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_two_steps_fp8_cache(kv_cache_dtype, device):
    k_scale, v_scale = 4.0 / 448, 5.0 / 448
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    skip_unless_the_gpu_converts(fp8, device)
    backend = TritonBackend(device, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    assert backend.cache_dtype(torch.bfloat16) == fp8
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    for step in run_steps(backend, k_cache, v_cache, torch.bfloat16):
        # Tight against what the cache holds, so reads match writes...
        slots = [request_slots(i, range(len(k))) for i, k in enumerate(step.keys)]
        cached_keys = [k_cache.flatten(0, 1)[s].float().cpu() * k_scale for s in slots]
        cached_values = [v_cache.flatten(0, 1)[s].float().cpu() * v_scale for s in slots]
        want = sdpa_reference(step.q, cached_keys, cached_values, step.scheduled)
        torch.testing.assert_close(step.out, want, atol=1.5e-2, rtol=2e-2)
        # ...and near the unquantised values (on the GPU: the interpreter's fp8 rounding is off when it carries).
        if device.type == "cuda":
            error = (step.out - sdpa_reference(step.q, step.keys, step.values, step.scheduled)).abs()
            assert error.mean() < 0.035 and error.max() < 0.5


def test_copy_blocks(device):
    backend = TritonBackend(device)
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device) for _ in range(4)]
    before = [c.clone() for c in caches]
    backend.copy_blocks(caches, torch.tensor([[3, 8], [5, 1]]))  # a host tensor, as the runner may pass
    for cache, old in zip(caches, before):
        assert torch.equal(cache[8], old[3]) and torch.equal(cache[1], old[5])
        assert torch.equal(cache[[0, 2, 3, 4, 5, 6, 7, 9, 10, 11]], old[[0, 2, 3, 4, 5, 6, 7, 9, 10, 11]])


def test_validates_configuration(device):
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        TritonBackend(device, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="fp8"):
        TritonBackend(device, k_scale=0.5)
    backend = TritonBackend(device, kv_cache_dtype="fp8")
    assert backend.cache_dtype(torch.bfloat16) == torch.float8_e4m3fn
    meta = metadata([0, 0, 0], [1, 1, 1], device)
    x = torch.zeros(3, NUM_KV_HEADS, HEAD_DIM, device=device)
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)
    with pytest.raises(ValueError, match="KV cache is"):
        backend.forward(torch.zeros(3, NUM_HEADS, HEAD_DIM, device=device), x, x, cache, cache.clone(), meta, SCALE)


# (compute capability, rocm) -> the dtypes of fp8, fp8_e4m3, fp8_e5m2 (None: refused)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_BY_GPU = {
    ((8, 0), False): (E5M2, None, E5M2),  # A100: no e4m3 conversion in Triton before sm_89
    ((8, 6), False): (E5M2, None, E5M2),  # A10, RTX 30xx
    ((8, 9), False): (E4M3, E4M3, E5M2),  # L4, RTX 40xx
    ((9, 0), False): (E4M3, E4M3, E5M2),  # H100, H200
    ((9, 4), True): (E4M3, E4M3, E5M2),  # MI300X
}


@pytest.mark.parametrize("gpu", FP8_BY_GPU, ids=lambda g: f"{g[0][0]}.{g[0][1]}{'-rocm' if g[1] else ''}")
def test_fp8_kv_cache_dtype_by_gpu(gpu):
    capability, rocm = gpu
    for name, want in zip(("fp8", "fp8_e4m3", "fp8_e5m2"), FP8_BY_GPU[gpu]):
        if want is None:
            refusal = r"--kv-cache-dtype fp8_e4m3: NVIDIA A100 has compute capability 8\.\d, .* use .* fp8_e5m2"
            with pytest.raises(ValueError, match=refusal):
                kv_cache_dtype_for(name, capability, rocm=rocm, gpu_name="NVIDIA A100")
        else:
            assert kv_cache_dtype_for(name, capability, rocm=rocm) == want
    assert kv_cache_dtype_for("auto", capability, rocm=rocm) is None


def test_fp8_kv_cache_dtype_without_a_gpu_takes_both_formats():
    assert kv_cache_dtype_for("fp8") == kv_cache_dtype_for("fp8_e4m3") == E4M3
    assert kv_cache_dtype_for("fp8_e5m2") == E5M2
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp16': expected one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        kv_cache_dtype_for("fp16")
