"""TorchBackend against a per-sequence reference on odd shapes; copy_blocks."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import get_backend
from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.torch_backend import TorchBackend


def reference_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain per-sequence causal attention over the paged cache (after this step's writes)."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        slots = meta.block_table[i, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        rows = slice(starts[i], starts[i + 1])
        query_len = starts[i + 1] - starts[i]
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys.double()) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).to(q.dtype)
    return out


def make_step(context_lens, query_lens, block_size, num_blocks, seed):
    """Metadata for sequences with the given context and query lengths, on shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    block_table = torch.zeros(len(seq_lens), max_blocks + 1, dtype=torch.int32)  # one padding column
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        n = -(-s // block_size)
        block_table[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        pos = torch.arange(c, s)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


CASES = [
    # (context_lens, query_lens)
    ([0], [1]),
    ([14, 15, 16, 17, 0, 299], [1, 1, 1, 1, 1, 1]),  # decodes only
    ([0, 0, 0], [1, 15, 17]),  # prefills only
    ([40, 0, 16, 3, 100], [1, 33, 1, 16, 7]),  # decodes among chunked prefills with context
    ([5, 0, 9], [1, 20, 1]),  # one prompt from its start beside decodes
    ([40], [33]),  # one chunk with context
    ([0], [1000]),
]


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 16)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, num_heads, num_kv_heads, head_dim, block_size):
    context_lens, query_lens = CASES[case]
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 4
    meta = make_step(context_lens, query_lens, block_size, num_blocks, seed=case)
    g = torch.Generator().manual_seed(100 + case)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    scale = head_dim**-0.5

    out = TorchBackend("cpu").forward(q, k, v, k_cache, v_cache, meta, scale)

    torch.testing.assert_close(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.flatten(0, 1)[meta.slot_mapping], v)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, meta, scale), atol=2e-5, rtol=1e-4)


def test_slot_minus_one_is_not_written():
    meta = make_step([3, 0], [1, 4], block_size=4, num_blocks=8, seed=0)
    meta.slot_mapping[2] = -1
    shape = (8, 4, 2, 8)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    TorchBackend().forward(torch.randn(5, 4, 8), k, v, k_cache, v_cache, meta, 0.3)
    written = meta.slot_mapping >= 0
    torch.testing.assert_close(k_cache.flatten(0, 1)[meta.slot_mapping[written]], k[written])
    assert int((k_cache.flatten(0, 2).abs().sum(-1) > 0).sum()) == 4 * 2
    assert int((v_cache.flatten(0, 2).abs().sum(-1) > 0).sum()) == 4 * 2


def test_layout_is_rebuilt_for_each_step():
    backend = TorchBackend()
    shape = (16, 4, 2, 8)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    for seed, (ctx, qlens) in enumerate([([0, 0], [3, 5]), ([3, 5], [1, 1]), ([7, 0], [2, 9])]):
        meta = make_step(ctx, qlens, 4, 16, seed)
        n = sum(qlens)
        q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.35)
        torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.35), atol=2e-5, rtol=1e-4)


def test_copy_blocks():
    caches = [torch.randn(10, 4, 2, 8) for _ in range(4)]
    before = [c.clone() for c in caches]
    src_dst = torch.tensor([[1, 7], [2, 3], [9, 8]])
    get_backend("torch", "cpu").copy_blocks(caches, src_dst)
    for c, b in zip(caches, before):
        expected = b.clone()
        expected[7], expected[3], expected[8] = b[1], b[2], b[9]
        assert torch.equal(c, expected)
    get_backend("torch", "cpu").copy_blocks(caches, torch.empty(0, 2, dtype=torch.int64))


def test_get_backend(monkeypatch):
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="nope"):
        get_backend("nope", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("triton", "cpu")
    with pytest.raises(ValueError, match="triton"):
        get_backend("torch", "cpu", kv_cache_dtype="fp8")
