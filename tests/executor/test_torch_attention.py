"""TorchBackend against a per-sequence reference on odd shapes; copy_blocks."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from executor_svc.attention import get_backend
from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.torch_backend import TorchBackend


def reference_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None, soft_cap: float | None = None
) -> torch.Tensor:
    """Plain per-sequence causal attention over the paged cache (after this step's writes); with a
    `window`, a query at p sees keys p - window + 1 .. p; `soft_cap` c: scores tanh(s / c) * c."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        query_len = starts[i + 1] - starts[i]
        pos = torch.arange(0 if window is None else max(seq_len - query_len - window + 1, 0), seq_len)
        slots = meta.block_table[i, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        rows = slice(starts[i], starts[i + 1])
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys.double()) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(seq_len - query_len, seq_len)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
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
    # 40 decodes of spread lengths (several length buckets) among long chunks with and without
    # context (attended alone) and short ones (padded together)
    ([(37 * i) % 301 for i in range(40)] + [0, 50, 7, 0], [1] * 40 + [40, 33, 5, 2]),
    ([2047, 3, 600, 1], [1, 1, 1, 1]),  # one long decode among short ones
]


def backend(decode_kernel: bool) -> TorchBackend:
    """The torch backend with decodes through SDPA on gathered blocks, or through the CPU kernel."""
    if decode_kernel and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for the CPU decode kernel")
    b = TorchBackend("cpu", decode_kernel=decode_kernel)
    assert b.uses_decode_kernel == decode_kernel
    return b


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "kernel"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 16), (8, 1, 128), (4, 1, 256)]
)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, num_heads, num_kv_heads, head_dim, block_size, decode_kernel):
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

    out = backend(decode_kernel).forward(q, k, v, k_cache, v_cache, meta, scale)

    torch.testing.assert_close(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.flatten(0, 1)[meta.slot_mapping], v)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, meta, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("case", [1, 3, 4, 5, 7])
def test_windows_and_soft_caps_match_reference_and_never_read_freed_blocks(case, block_size, window, soft_cap):
    """A layer with a sliding window (or soft-capped scores) through `windowed.attend`: the
    reference's outputs; the blocks wholly before each sequence's window hold NaN (freed, reused)
    and the outputs stay finite."""
    context_lens, query_lens = CASES[case]
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 5
    meta = make_step(context_lens, query_lens, block_size, num_blocks, seed=case)
    g = torch.Generator().manual_seed(200 + case)
    num_heads, num_kv_heads, head_dim = 8, 2, 16
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    poison = num_blocks  # in no table: a freed block another request now fills
    k_cache[poison], v_cache[poison] = float("nan"), float("nan")
    if window is not None:
        for i, (c, q) in enumerate(zip(context_lens, query_lens)):
            first_visible = max(c - window + 1, 0)
            meta.block_table[i, : first_visible // block_size] = poison
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}

    out = TorchBackend("cpu").forward(q, k, v, k_cache, v_cache, meta, scale, **options)

    torch.testing.assert_close(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    expected = reference_attention(q, k_cache, v_cache, meta, scale, window, soft_cap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("over", [-2, -1, 0, 1, 2])  # the longest sequence's length minus the window
@pytest.mark.parametrize("query_len", [1, 6])
def test_a_window_that_holds_every_context_is_full_attention_and_one_key_past_it_is_not(over, query_len):
    """While every sequence fits its window the layer takes the fast path; one key more and the
    window applies again (the reference's outputs either way)."""
    window, block_size = 12, 5
    context_lens = [window + over - query_len, 3]
    query_lens = [query_len, 1]
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 3
    meta = make_step(context_lens, query_lens, block_size, num_blocks, seed=7)
    g = torch.Generator().manual_seed(300)
    shape = (num_blocks, block_size, 2, 16)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(sum(query_lens), 4, 16, generator=g)
    k = torch.randn(sum(query_lens), 2, 16, generator=g)
    v = torch.randn(sum(query_lens), 2, 16, generator=g)

    out = TorchBackend("cpu").forward(q, k, v, k_cache, v_cache, meta, 0.25, sliding_window=window)

    expected = reference_attention(q, k_cache, v_cache, meta, 0.25, window, None)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    if over > 0:  # a key fell out of the window: full attention differs
        full = reference_attention(q, k_cache, v_cache, meta, 0.25, None, None)
        assert not torch.allclose(out, full, atol=1e-4)


def _brute_force_cost(sorted_lens, block_size):
    """Least padded tokens + call cost over every way to cut the list into contiguous buckets."""
    from itertools import combinations

    from executor_svc.attention.torch_backend import BUCKET_CALL_COST

    n, best = len(sorted_lens), None
    padded = [-(-x // block_size) * block_size for x in sorted_lens]
    for k in range(n):
        for cuts in combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            cost = sum((b - a) * padded[b - 1] + BUCKET_CALL_COST for a, b in zip(bounds, bounds[1:]))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_length_buckets_are_optimal(seed):
    from executor_svc.attention.torch_backend import BUCKET_CALL_COST, _length_buckets

    g = torch.Generator().manual_seed(seed)
    lens = sorted(torch.randint(1, 2000 if seed % 2 else 200, (9,), generator=g).tolist())
    buckets = _length_buckets(lens, 16)
    assert buckets[0].start == 0 and buckets[-1].stop == len(lens)
    assert all(a.stop == b.start for a, b in zip(buckets, buckets[1:]))
    cost = sum((b.stop - b.start) * -(-lens[b.stop - 1] // 16) * 16 + BUCKET_CALL_COST for b in buckets)
    assert cost == _brute_force_cost(lens, 16)


def test_spread_decode_lengths_use_several_buckets():
    from executor_svc.attention.torch_backend import _build_layout

    meta = make_step([20] * 8 + [1500] * 2, [1] * 10, block_size=16, num_blocks=240, seed=0)
    groups = _build_layout(meta, 16, kernel=None).groups
    assert sorted(g.block_table.shape for g in groups) == [(2, 94), (8, 2)]


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "kernel"])
def test_slot_minus_one_is_not_written(decode_kernel):
    meta = make_step([3, 0], [1, 4], block_size=4, num_blocks=8, seed=0)
    meta.slot_mapping[2] = -1
    shape = (8, 4, 2, 8)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    backend(decode_kernel).forward(torch.randn(5, 4, 8), k, v, k_cache, v_cache, meta, 0.3)
    written = meta.slot_mapping >= 0
    torch.testing.assert_close(k_cache.flatten(0, 1)[meta.slot_mapping[written]], k[written])
    assert int((k_cache.flatten(0, 2).abs().sum(-1) > 0).sum()) == 4 * 2
    assert int((v_cache.flatten(0, 2).abs().sum(-1) > 0).sum()) == 4 * 2


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "kernel"])
def test_layout_is_rebuilt_for_each_step(decode_kernel):
    b = backend(decode_kernel)
    shape = (16, 4, 2, 8)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    for seed, (ctx, qlens) in enumerate([([0, 0], [3, 5]), ([3, 5], [1, 1]), ([7, 0], [2, 9])]):
        meta = make_step(ctx, qlens, 4, 16, seed)
        n = sum(qlens)
        q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        out = b.forward(q, k, v, k_cache, v_cache, meta, 0.35)
        torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.35), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("skip_slot", [False, True])
def test_a_decode_only_step_takes_the_short_layout_and_it_equals_the_general_one(skip_slot, monkeypatch):
    from executor_svc.attention import torch_backend

    kernel = backend(True).decode_kernel
    meta = make_step([5, 17, 2], [1, 1, 1], 4, 16, 3)
    if skip_slot:
        meta.slot_mapping[1] = -1
    general = torch_backend._build_layout(dataclasses.replace(meta, max_query_len=2), 4, kernel)  # not the short path
    taken = []
    short_layout = torch_backend._decode_only_layout
    monkeypatch.setattr(torch_backend, "_decode_only_layout", lambda *a: taken.append(1) or short_layout(*a))
    short = torch_backend._build_layout(meta, 4, kernel)
    assert taken == [1]
    if skip_slot:
        assert short.write_rows.tolist() == general.write_rows.tolist() == [0, 2]
    else:
        assert short.write_rows is None and general.write_rows is None
    assert torch.equal(short.write_slots, general.write_slots)
    (got,), (want,) = short.groups, general.groups
    assert got.token_rows == want.token_rows == slice(None) and got.kernel_split == want.kernel_split
    assert torch.equal(got.kernel_lens, want.kernel_lens) and torch.equal(got.block_table, want.block_table)


def test_decode_arguments_are_the_short_layouts_tensors_and_decline_what_it_would_change():
    """`decode_arguments` (the C decode step's fast path) gives the slots, table and lengths that
    `step_layout` gives for a decode-only step of the kernel's dtypes, and None where the layout
    would drop a slot (-1), convert a dtype, or where the step is not decode-only."""
    b = backend(True)
    meta = make_step([5, 17, 2], [1, 1, 1], 4, 16, 3)
    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.long(), block_table=meta.block_table.int(),
                               seq_lens=meta.seq_lens.int())
    slots, table, lens = b.decode_arguments(meta, 4)
    layout = b.step_layout(meta, 4)
    (group,) = layout.groups
    assert layout.write_rows is None and torch.equal(slots, layout.write_slots)
    assert torch.equal(table, group.block_table) and torch.equal(lens, group.kernel_lens)
    skipped = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone())
    skipped.slot_mapping[1] = -1
    assert b.decode_arguments(skipped, 4) is None
    assert b.decode_arguments(dataclasses.replace(meta, block_table=meta.block_table.long()), 4) is None
    assert b.decode_arguments(dataclasses.replace(meta, max_query_len=2), 4) is None


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


def test_decode_kernel_switch_and_fallback(monkeypatch, tmp_path):
    from executor_svc.attention import cpu_decode

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    assert not get_backend("torch", "cpu", decode_kernel=False).uses_decode_kernel  # the backend option: SDPA
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_decode.CpuDecodeKernel.load() is None  # SDPA instead, with a warning
    with pytest.raises(RuntimeError, match="could not be built"):
        TorchBackend("cpu", decode_kernel=True)
    if shutil.which("cc") or shutil.which("gcc"):
        monkeypatch.delenv("CC")
        assert cpu_decode.CpuDecodeKernel.load() is not None  # built into the empty cache folder
        assert list((tmp_path / "kernels").glob("paged_decode-*.so"))


def openmp_is_torchs() -> bool:
    """Whether a library of ours built with -fopenmp shares torch's OpenMP runtime in this process."""
    from executor_svc import cbuild
    from executor_svc.attention import cpu_decode

    return cbuild.load_openmp(cpu_decode.SOURCE, cpu_decode.CFLAGS, "decode attention")[1]


@pytest.mark.parametrize("num_threads", [1, 2, 5])
def test_decode_kernel_thread_split(num_threads):
    """Any split of the sequences among threads gives the same output as one thread."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for the CPU decode kernel")
    from executor_svc.attention.cpu_decode import CpuDecodeKernel

    kernel = CpuDecodeKernel.load(num_threads)
    meta = make_step([(53 * i) % 700 for i in range(11)], [1] * 11, block_size=16, num_blocks=600, seed=3)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(600, 16, 2, 64, generator=g), torch.randn(600, 16, 2, 64, generator=g)
    q = torch.randn(11, 8, 64, generator=g)
    bounds = kernel.split(meta.seq_lens)
    assert bounds[0] == 0 and bounds[-1] == 11 and len(bounds) == min(num_threads, 11) + 1
    out = kernel(q, k_cache, v_cache, meta.block_table, meta.seq_lens, 0.125)
    one = CpuDecodeKernel(kernel._library, 1, openmp=False)  # every sequence on the calling thread, in turn
    torch.testing.assert_close(out, one(q, k_cache, v_cache, meta.block_table, meta.seq_lens, 0.125), atol=0, rtol=0)
    # the ranges on torch's OpenMP team (where the library shares its runtime) or on a pool of ours: the same bits
    assert (kernel._parts is not None) == (num_threads > 1 and openmp_is_torchs())
    pool = CpuDecodeKernel(kernel._library, num_threads, openmp=False)
    torch.testing.assert_close(pool(q, k_cache, v_cache, meta.block_table, meta.seq_lens, 0.125), out, atol=0, rtol=0)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seq_lens", [[1000], [130], [127], [64, 1500, 3]], ids=str)
def test_one_long_sequence_is_split_over_the_threads_with_the_bits_of_one_thread(seq_lens, block_size):
    """A sequence of 128+ keys is attended in parts (split-K) that threads share, merged in order:
    the same bits on 1, 2 or 3 threads, as a one-thread call (parts or not), and the reference."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for the CPU decode kernel")
    from executor_svc.attention.cpu_decode import CpuDecodeKernel

    n = len(seq_lens)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    meta = make_step([s - 1 for s in seq_lens], [1] * n, block_size=block_size, num_blocks=num_blocks, seed=5)
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(num_blocks, block_size, 2, 128, generator=g)
    v_cache = torch.randn(num_blocks, block_size, 2, 128, generator=g)
    q = 3 * torch.randn(n, 8, 128, generator=g)  # peaked scores: the parts' maxima differ
    one = CpuDecodeKernel(CpuDecodeKernel.load(1)._library, 1, openmp=False)
    want = one(q, k_cache, v_cache, meta.block_table, meta.seq_lens, 0.09)
    for threads in (2, 3):
        kernel = CpuDecodeKernel.load(threads)
        got = kernel(q, k_cache, v_cache, meta.block_table, meta.seq_lens, 0.09)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(want, reference_attention(q, k_cache, v_cache, meta, 0.09), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [1, 7, 16, 100, 512])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 16), (9, 3, 64), (4, 1, 256)])
def test_decode_kernel_reads_only_a_sliding_window(window, block_size, num_heads, num_kv_heads, head_dim, kv_dtype):
    """Decodes of a sliding layer through the kernel (the portable loop at head_dim 16, the AVX-512
    one at 64 and 256, split into parts where the window holds 128+ keys): each sequence attends to
    its last `window` keys, from inside a block where the window starts there; the blocks wholly
    before the window hold NaN (freed, reused) and are never read; the same bits on 1, 2 and 3
    threads; the reference's outputs, and the backend takes this kernel for the step."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for the CPU decode kernel")
    from executor_svc.attention.cpu_decode import CpuDecodeKernel

    seq_lens = [1, window, window + 1, window + 3, 2 * window + 7, 1300, 37]
    n = len(seq_lens)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    meta = make_step([s - 1 for s in seq_lens], [1] * n, block_size=block_size, num_blocks=num_blocks, seed=11)
    g = torch.Generator().manual_seed(window)
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(kv_dtype) for _ in range(2))
    poison = num_blocks
    k_cache[poison], v_cache[poison] = float("nan"), float("nan")
    for i, s in enumerate(seq_lens):
        meta.block_table[i, : max(s - window, 0) // block_size] = poison
    # peaked scores (the parts' maxima differ), in the cache's dtype as the layer's own query is
    q = (3 * torch.randn(n, num_heads, head_dim, generator=g)).to(kv_dtype).float()
    scale = head_dim**-0.5
    one = CpuDecodeKernel(CpuDecodeKernel.load(1)._library, 1, openmp=False)
    want = one(q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale, window=window)
    assert torch.isfinite(want).all()
    for threads in (2, 3):
        got = CpuDecodeKernel.load(threads)(q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale, window=window)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    expected = reference_attention(q, k_cache.float(), v_cache.float(), meta, scale, window)
    torch.testing.assert_close(want, expected, atol=2e-5, rtol=1e-4)

    b = backend(True)  # the layer's own call: this step's K/V written, then this kernel over the window
    k = k_cache.flatten(0, 1)[meta.slot_mapping].to(kv_dtype)
    v = v_cache.flatten(0, 1)[meta.slot_mapping].to(kv_dtype)
    out = b.forward(q.to(kv_dtype), k, v, k_cache, v_cache, meta, scale, sliding_window=window)
    torch.testing.assert_close(out.float(), want.to(kv_dtype).float(), atol=0, rtol=0)


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "kernel"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (4, 2, 48), (4, 1, 256)])
@pytest.mark.parametrize("case", [1, 3, 7, 8])
def test_bf16_cache_matches_reference(case, num_heads, num_kv_heads, head_dim, decode_kernel):
    """bfloat16 q, k, v and cache (a `--dtype bfloat16` model): bfloat16 out, within bfloat16 rounding
    of the float64 reference on the same bfloat16 values; the kernel reads the cache as it is."""
    context_lens, query_lens = CASES[case]
    block_size = 16
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 4
    meta = make_step(context_lens, query_lens, block_size, num_blocks, seed=case)
    g = torch.Generator().manual_seed(200 + case)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).bfloat16()
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
    scale = head_dim**-0.5

    out = backend(decode_kernel).forward(q, k, v, k_cache, v_cache, meta, scale)

    assert out.dtype == torch.bfloat16
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], k)
    expected = reference_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=2**-7)
