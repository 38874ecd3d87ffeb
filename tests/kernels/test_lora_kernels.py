"""kernels.lora (multi-LoRA shrink / expand) against its float64 torch reference, in the interpreter on CPU.

Odd shapes: K and N of 17, 100 and 257 (no multiple of a block), ranks 1, 8 and 16, slots of
ranks 1, 8, 16 zero-padded to 16; 1 to 4 slots used out of one more loaded, base rows (-1)
interleaved in a random order; one token and a 40-token prefill; float32 and bfloat16.
Tolerances: shrink's output is fp32 and 16-bit products are exact in fp32, so both dtypes
within 1e-5 of float64; expand within 1e-5 (fp32) and 1e-2 (bf16: the kernel rounds its fp32
sum once to bf16, the reference its float64 sum, at most one bf16 ulp, 2^-7 relative, apart).
Rows without an adapter and columns outside the expanded slice stay bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora import (
    lora_config,
    lora_expand,
    lora_expand_ref,
    lora_metadata,
    lora_shrink,
    lora_shrink_ref,
)

SHRINK_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
EXPAND_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def mixed_rows(num_tokens: int, num_used: int, num_loaded: int, device, seed: int = 0) -> torch.Tensor:
    """A token -> slot map in a random order: `num_used` random slots of `num_loaded`, each on at
    least one row, and base rows (-1) on about a quarter of the rest."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_loaded, generator=generator)[:num_used]
    token_lora = slots[torch.randint(num_used, (num_tokens,), generator=generator)]
    token_lora[:num_used] = slots[: min(num_used, num_tokens)]
    token_lora[num_used:][torch.rand(max(num_tokens - num_used, 0), generator=generator) < 0.25] = -1
    return token_lora[torch.randperm(num_tokens, generator=generator)].to(device)


def base_rows(token_lora: torch.Tensor) -> torch.Tensor:
    return token_lora < 0


def test_metadata_groups_rows_by_slot_base_rows_first():
    """The module docstring's picture."""
    meta = lora_metadata(torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32))
    assert meta.sorted_token_ids.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert meta.slot_ids.tolist() == [0, 2]
    assert meta.num_tokens_per_slot.tolist() == [2, 3]
    assert meta.slot_start_loc.tolist() == [2, 4]
    assert (meta.num_tokens, meta.num_slots, meta.max_tokens_per_slot, meta.max_slot_id) == (7, 2, 3, 2)
    assert all(t.dtype == torch.int32 for t in (meta.sorted_token_ids, meta.slot_ids, meta.slot_start_loc))


def test_metadata_of_a_base_only_step_has_no_slot():
    meta = lora_metadata(torch.tensor([-1, -1, -1]))
    assert meta.num_slots == 0 and meta.max_tokens_per_slot == 0 and meta.max_slot_id == -1
    assert meta.sorted_token_ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("token_lora", [[-1, -1, -1], []], ids=["base-only", "no-token"])
def test_base_only_step_gives_zeros_and_leaves_out_untouched(token_lora, device):
    token_lora = torch.tensor(token_lora, dtype=torch.int64, device=device)
    num_tokens = token_lora.numel()
    meta = lora_metadata(token_lora)
    x = torch.randn(num_tokens, 17, device=device)
    y = lora_shrink(x, torch.randn(2, 8, 17, device=device), meta)
    assert y.shape == (num_tokens, 8) and y.dtype == torch.float32 and not y.any()
    out = torch.randn(num_tokens, 100, device=device)
    before = out.clone()
    lora_expand(torch.randn(num_tokens, 8, device=device), torch.randn(2, 100, 8, device=device), meta, out)
    assert torch.equal(out, before)


@DTYPES
@pytest.mark.parametrize(
    ("num_tokens", "k", "rank", "num_used"),
    [(1, 257, 16, 1), (40, 17, 1, 2), (40, 100, 8, 3), (40, 257, 16, 4), (7, 257, 8, 4)],
)
def test_shrink_matches_reference(num_tokens, k, rank, num_used, dtype, device):
    token_lora = mixed_rows(num_tokens, num_used, num_used + 1, device)
    meta = lora_metadata(token_lora)
    x = torch.randn(num_tokens, k, device=device).to(dtype)
    a = (torch.randn(num_used + 1, rank, k, device=device) * k**-0.5).to(dtype)
    y = lora_shrink(x, a, meta, scale=0.5)
    assert y.shape == (num_tokens, rank) and y.dtype == torch.float32
    torch.testing.assert_close(y, lora_shrink_ref(x, a, token_lora, scale=0.5), **SHRINK_TOLERANCE)
    assert not y[base_rows(token_lora)].any()


@DTYPES
@pytest.mark.parametrize("add", [True, False], ids=["add", "store"])
@pytest.mark.parametrize(
    ("num_tokens", "n", "rank", "num_used", "out_offset"),
    [(1, 257, 16, 1, 0), (40, 17, 1, 2, 3), (40, 100, 8, 3, 0), (40, 257, 16, 4, 5), (7, 100, 8, 4, 1)],
)
def test_expand_matches_reference_and_touches_only_its_rows_and_columns(
    num_tokens, n, rank, num_used, out_offset, add, dtype, device
):
    token_lora = mixed_rows(num_tokens, num_used, num_used + 1, device)
    meta = lora_metadata(token_lora)
    y = torch.randn(num_tokens, rank, device=device)
    b = (torch.randn(num_used + 1, n, rank, device=device) * rank**-0.5).to(dtype)
    out = torch.randn(num_tokens, out_offset + n + 2, device=device).to(dtype)
    before = out.clone()
    assert lora_expand(y, b, meta, out, add=add, out_offset=out_offset) is out
    expected = lora_expand_ref(y, b, token_lora, before.clone(), add=add, out_offset=out_offset)
    torch.testing.assert_close(out.float(), expected.float(), **EXPAND_TOLERANCE[dtype])
    columns = slice(out_offset, out_offset + n)
    assert torch.equal(out[base_rows(token_lora)], before[base_rows(token_lora)])
    assert torch.equal(out[:, :out_offset], before[:, :out_offset])
    assert torch.equal(out[:, columns.stop :], before[:, columns.stop :])
    assert not torch.equal(out[~base_rows(token_lora), columns], before[~base_rows(token_lora), columns])


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_zero_padded_slots_of_ranks_1_8_16_equal_their_unpadded_product(num_tokens, dtype, device):
    """Slot 0 rank 1, slot 1 rank 8, slot 2 rank 16 (stacked at 16), slot 3 loaded but unused: base
    + scale * B A x per row, against each slot's own unpadded matrices; y zero past a slot's rank."""
    k, n, ranks, scale = 100, 257, (1, 8, 16), 2.0
    token_lora = mixed_rows(num_tokens, 3, 3, device, seed=1) if num_tokens > 1 else torch.tensor([0], device=device)
    a = torch.zeros(4, 16, k, device=device, dtype=dtype)
    b = torch.zeros(4, n, 16, device=device, dtype=dtype)
    a[3], b[3] = torch.randn_like(a[3]), torch.randn_like(b[3])
    own = []
    for slot, rank in enumerate(ranks):
        a[slot, :rank] = (torch.randn(rank, k, device=device) * k**-0.5).to(dtype)
        b[slot, :, :rank] = (torch.randn(n, rank, device=device) * rank**-0.5).to(dtype)
        own.append((a[slot, :rank].double(), b[slot, :, :rank].double()))
    x = torch.randn(num_tokens, k, device=device).to(dtype)
    base = torch.randn(num_tokens, n, device=device).to(dtype)
    meta = lora_metadata(token_lora)
    y = lora_shrink(x, a, meta, scale=scale)
    out = lora_expand(y, b, meta, base.clone())
    expected = base.double()
    for row, slot in enumerate(token_lora.tolist()):
        if slot >= 0:
            own_a, own_b = own[slot]
            expected[row] += scale * own_b @ (own_a @ x[row].double())
            assert not y[row, ranks[slot] :].any()
    torch.testing.assert_close(out.double(), expected, **EXPAND_TOLERANCE[dtype])


@DTYPES
def test_merged_qkv_one_shrink_then_an_expand_per_slice_at_its_offset(dtype, device):
    """q, k, v of sizes 100, 17, 17 in one [T, 134] output: A stacked along the rank, one shrink;
    each slice expanded from its column view of y into its columns; equals three separate LoRAs."""
    num_tokens, hidden, rank, sizes = 40, 100, 8, (100, 17, 17)
    token_lora = mixed_rows(num_tokens, 3, 4, device, seed=2)
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    slice_a = [(torch.randn(4, rank, hidden, device=device) * hidden**-0.5).to(dtype) for _ in sizes]
    slice_b = [(torch.randn(4, size, rank, device=device) * rank**-0.5).to(dtype) for size in sizes]
    base = torch.randn(num_tokens, sum(sizes), device=device).to(dtype)
    meta = lora_metadata(token_lora)
    y = lora_shrink(x, torch.cat(slice_a, dim=1), meta, scale=0.25)
    out, offset = base.clone(), 0
    for i, b in enumerate(slice_b):
        lora_expand(y[:, i * rank : (i + 1) * rank], b, meta, out, out_offset=offset)
        offset += b.shape[1]
    expected, offset = base.clone(), 0
    for a, b in zip(slice_a, slice_b, strict=True):
        lora_expand_ref(lora_shrink_ref(x, a, token_lora, scale=0.25), b, token_lora, expected, out_offset=offset)
        offset += b.shape[1]
    torch.testing.assert_close(out.float(), expected.float(), **EXPAND_TOLERANCE[dtype])
    assert torch.equal(out[base_rows(token_lora)], base[base_rows(token_lora)])


@pytest.mark.parametrize(
    ("shrink_config", "expand_config"),
    [
        (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=1), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)),
        (dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3), dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16)),
        # more K splits than K blocks: the surplus programs add nothing
        (dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, SPLIT_K=8), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32)),
    ],
    ids=["16", "32-split3", "64-split8"],
)
def test_block_sizes_give_the_reference_result(shrink_config, expand_config, device):
    """Rank 24 spans two 16-wide rank blocks; K 257 and N 100 end in partial blocks."""
    num_tokens, k, n, rank = 40, 257, 100, 24
    token_lora = mixed_rows(num_tokens, 2, 3, device, seed=3)
    meta = lora_metadata(token_lora)
    x = torch.randn(num_tokens, k, device=device)
    a = torch.randn(3, rank, k, device=device) * k**-0.5
    b = torch.randn(3, n, rank, device=device) * rank**-0.5
    y = lora_shrink(x, a, meta, config=shrink_config)
    torch.testing.assert_close(y, lora_shrink_ref(x, a, token_lora), **SHRINK_TOLERANCE)
    out = lora_expand(y, b, meta, torch.zeros(num_tokens, n, device=device), config=expand_config)
    expected = lora_expand_ref(y, b, token_lora, torch.zeros(num_tokens, n, device=device))
    torch.testing.assert_close(out, expected, **EXPAND_TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_tokens", [1, 16, 40, 300, 4096])
@pytest.mark.parametrize(("k", "n", "rank"), [(17, 17, 1), (4096, 4096, 16), (4096, 14336, 64), (14336, 4096, 128)])
def test_config_blocks_are_powers_of_two_and_splits_have_k_work(num_tokens, k, n, rank):
    shrink, expand = lora_config("shrink", num_tokens, k, n, rank), lora_config("expand", num_tokens, k, n, rank)
    for config in (shrink, expand):
        for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            assert config[key] >= 16 and config[key] & (config[key] - 1) == 0, (key, config)
        assert config["num_warps"] in (1, 2, 4, 8) and config["num_stages"] >= 1
    assert 1 <= shrink["SPLIT_K"] and (shrink["SPLIT_K"] - 1) * shrink["BLOCK_K"] < k
    assert set(expand) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}


def test_config_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be 'shrink' or 'expand'"):
        lora_config("bgmv", 1, 16, 16, 16)


def test_metadata_refuses_bad_mappings():
    with pytest.raises(ValueError, match="token_lora must be int32 or int64"):
        lora_metadata(torch.zeros(3))
    with pytest.raises(ValueError, match="token_lora must be >= -1"):
        lora_metadata(torch.tensor([0, -2]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=torch.zeros(3, 17, dtype=torch.float16)), "a must be \\[num_slots, rank, 17\\] of torch.float16"),
        (dict(a=torch.zeros(3, 8, 16)), "a must be \\[num_slots, rank, 17\\]"),
        (dict(x=torch.zeros(3, 17, dtype=torch.float64), a=torch.zeros(3, 8, 17, dtype=torch.float64)),
         "x must be \\[num_tokens, K\\]"),
        (dict(a=torch.zeros(2, 8, 17)), "meta names slot 2, the weights stack 2 slots"),
        (dict(x=torch.zeros(4, 17)), "meta is for 3 tokens, the input has 4"),
        (dict(config=dict(BLOCK_K=24)), "config.BLOCK_K must be a power of two >= 16"),
        (dict(config=dict(SPLIT_K=0)), "config.SPLIT_K must be >= 1"),
        (dict(config=dict(GROUP_M=8)), "config keys must be among"),
    ],
)
def test_shrink_refuses_bad_input_naming_it(change, message):
    args = dict(x=torch.zeros(3, 17), a=torch.zeros(3, 8, 17), meta=lora_metadata(torch.tensor([2, -1, 0])))
    with pytest.raises(ValueError, match=message):
        lora_shrink(**(args | change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(b=torch.zeros(3, 20, 4)), "b must be \\[num_slots, N, 8\\]"),
        (dict(out=torch.zeros(3, 20, dtype=torch.bfloat16)), "out must be \\[3, columns\\] of torch.float32"),
        (dict(out=torch.zeros(2, 20)), "out must be \\[3, columns\\]"),
        (dict(out_offset=1), "out_offset \\+ N must be within out's 20 columns, got 1 \\+ 20"),
        (dict(out_offset=-1), "out_offset \\+ N must be within"),
        (dict(y=torch.zeros(3, 8, dtype=torch.int32)), "y must be float"),
        (dict(b=torch.zeros(1, 20, 8)), "meta names slot 2, the weights stack 1 slots"),
        (dict(config=dict(BLOCK_N=8)), "config.BLOCK_N must be a power of two >= 16"),
    ],
)
def test_expand_refuses_bad_input_naming_it(change, message):
    args = dict(y=torch.zeros(3, 8), b=torch.zeros(3, 20, 8), meta=lora_metadata(torch.tensor([2, -1, 0])),
                out=torch.zeros(3, 20))
    with pytest.raises(ValueError, match=message):
        lora_expand(**(args | change))


def test_the_model_through_the_kernels_equals_its_torch_path(tmp_path):
    """A tiny Llama with two adapters and base rows in one step: the projections' deltas through
    kernels.lora (the interpreter here, CUDA's path) give the logits of the grouped torch path."""
    from executor_svc.model_runner import ModelRunner
    from pagoda import model_files
    from pagoda.step import SamplingParams
    from tests.executor.plans import PlanBuilder
    from tests.executor.test_lora import make_adapter
    from tests.model_families import build_family

    base = build_family("llama", tmp_path / "base", model_files.resolve_model(None, weights=False))
    adapters = {"a": make_adapter(base, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], r=8, seed=1),
                "b": make_adapter(base, tmp_path / "b", ["q_proj", "o_proj", "gate_proj"], r=4, seed=2, use_rslora=True)}
    logits = {}
    for kernels in (False, True):
        runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, enable_lora=True,
                             lora_kernels=kernels)
        for name, path in adapters.items():
            runner.add_lora(name, path)
        builder = PlanBuilder(block_size=4, num_blocks=64)
        for name in ("x", "y", "z", "w"):
            builder.add(name, list(range(3, 10 + ord(name) % 5)), 1, SamplingParams(temperature=0.0))
        plan = builder.next_plan()
        for new, lora in zip(plan.new_requests, ("a", "", "b", "a"), strict=True):
            new.lora = lora
        _, logits[kernels] = runner.execute_with_logits(plan)
        assert runner.loras.state.kernels is kernels and (runner.loras.state.meta is not None) is kernels
    for req_id in logits[False]:
        # (fp32 sums in another order, split over K: the logits of 4 layers agree to ~3e-4)
        torch.testing.assert_close(logits[True][req_id], logits[False][req_id], atol=1e-3, rtol=1e-4)
