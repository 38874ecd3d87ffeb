"""The executor's KV cache groups: layer windows from Hugging Face configs, the grouping, the shared
tensors, and real models served through the core scheduler with one block table per group.

A model with only full attention split into several groups runs each group's layers on
their own block tables over shared K/V tensors: its greedy tokens must still equal
transformers', through chunked prefill, prefix hits, `n` forks (block copies per group)
and preemption. Models with sliding windows (a Mistral, a Qwen2 with full and windowed
layers) are served with their blocks outside the windows freed, and equal transformers
past their windows: with a reference attention that keeps each layer to its window
(`windowed_attention`), and with the model runner's own attention (each layer's window
passed to the backend, `executor_svc.models`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from executor_svc.kv_cache_spec import KVCacheLayout, kv_cache_groups, layer_sliding_windows
from executor_svc.model_runner import ModelRunner
from pagoda.step import KVCacheGroupSpec, SamplingParams
from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from tests.executor.plans import run_with_scheduler
from tests.executor.test_model_runner import hf_greedy
from tests.executor.windowed_attention import WindowedReferenceAttention

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (Gemma2Config(num_hidden_layers=4, sliding_window=64, max_position_embeddings=512), (64, None, 64, None)),
        (
            Gemma3TextConfig(num_hidden_layers=8, sliding_window=16, max_position_embeddings=512),
            (16, 16, 16, 16, 16, None, 16, 16),
        ),
        ({"num_hidden_layers": 7, "sliding_window": 16, "sliding_window_pattern": 3, "max_position_embeddings": 64}, (16, 16, None, 16, 16, None, 16)),
        ({"model_type": "gemma2", "num_hidden_layers": 3, "sliding_window": 8, "max_position_embeddings": 64}, (8, None, 8)),
        (MistralConfig(num_hidden_layers=3, sliding_window=32, max_position_embeddings=512), (32, 32, 32)),
        (MistralConfig(num_hidden_layers=2, sliding_window=4096, max_position_embeddings=512), (None, None)),
        (MistralConfig(num_hidden_layers=2, sliding_window=None), (None, None)),
        (Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, sliding_window=64), (None, 64, 64)),
        (Qwen2Config(num_hidden_layers=2), (None, None)),
        (LlamaConfig(num_hidden_layers=2), (None, None)),
    ],
)
def test_layer_windows_from_hf_configs(config, expected):
    assert layer_sliding_windows(config) == expected


def test_groups_have_one_size_and_full_attention_comes_first():
    gemma3_1b = layer_sliding_windows(Gemma3TextConfig(num_hidden_layers=26, sliding_window=512, max_position_embeddings=32768))
    groups = kv_cache_groups(gemma3_1b)
    assert [(g.sliding_window, g.layer_ids) for g in groups[:2]] == [(None, (5, 11, 17, 23)), (512, (0, 1, 2, 3))]
    assert [len(g.layer_ids) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert {g.sliding_window for g in groups[1:]} == {512}
    assert kv_cache_groups((None,) * 30) == (KVCacheGroupSpec(tuple(range(30))),)
    assert kv_cache_groups((32,) * 3) == (KVCacheGroupSpec((0, 1, 2), 32),)
    assert [g.layer_ids for g in kv_cache_groups((8, None, 8, None))] == [(1, 3), (0, 2)]


def test_layout_puts_the_ith_layer_of_every_group_on_the_ith_tensors():
    layout = KVCacheLayout(kv_cache_groups((8, 8, 8, None, 8)), num_layers=5)
    assert layout.num_tensors == 1 and layout.slot_of == (0,) * 5
    assert layout.group_of == (1, 2, 3, 0, 4)
    layout = KVCacheLayout((KVCacheGroupSpec((0, 2)), KVCacheGroupSpec((1,), 4)), num_layers=3)
    assert layout.num_tensors == 2 and layout.slot_of == (0, 0, 1) and layout.group_of == (0, 1, 0)
    with pytest.raises(ValueError, match="every one of 3 layers once"):
        KVCacheLayout((KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((1,))), num_layers=3)


def serve(runner: ModelRunner, *batches: list[list[Request]], **limits) -> Scheduler:
    """Each batch of request groups (n siblings share a prompt) served through the core scheduler
    once the one before is done (so a later one may hit the prefix cache)."""
    config = SchedulerConfig(
        num_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        kv_cache_groups=runner.kv_cache_groups,
        **limits,
    )
    scheduler = Scheduler(config)
    for batch in batches:
        for group in batch:
            scheduler.add_requests(group)
        run_with_scheduler(runner, scheduler)
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not runner.requests
    return scheduler


def greedy(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, list(prompt), GREEDY, max_tokens=max_tokens)


def assert_same_greedy(request: Request, reference) -> None:
    """Its tokens are transformers' greedy ones (which stop at EOS; the request does not)."""
    expected = hf_greedy(reference, request.prompt_token_ids, request.max_tokens)
    assert request.output_token_ids[: len(expected)] == expected, request.req_id


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs):
    return tiny_model_dirs["llama"], AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()


@pytest.mark.parametrize(("num_kv_blocks", "preempts"), [(64, False), (17, True)])
def test_full_attention_split_into_groups_equals_transformers(tiny_llama, num_kv_blocks, preempts):
    """Two groups of one layer each: both layers' K and V on one tensor pair, a block table each."""
    model_dir, reference = tiny_llama
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,)))
    runner = ModelRunner(model_dir, block_size=4, num_kv_blocks=num_kv_blocks, kv_cache_groups=groups)
    assert len(runner.kv_cache_tensors) == 2 and runner.kv_caches[0] is runner.kv_caches[1]
    assert runner.kv_block_bytes == 2 * 4 * runner.config.kv_size * 4  # one layer's K and V per block
    prompts = [[1, 40 + 3 * i, 7, 300 + i, 9] * (2 + i) for i in range(3)]
    requests = [[greedy(f"p{i}", p, 12)] for i, p in enumerate(prompts)]
    requests.append([greedy(f"n{i}", prompts[0][:9], 8) for i in range(2)])  # n = 2: a fork, block copies
    again = [[greedy("again", prompts[1] + [5, 6], 12)]]  # a prefix hit on p1's blocks
    scheduler = serve(runner, requests, again, max_num_batched_tokens=16, max_num_seqs=4)
    assert (scheduler.num_preemptions > 0) == preempts
    for group in requests + again:
        for request in group:
            assert_same_greedy(request, reference)
    assert again[0][0].num_cached_tokens > 0 or preempts  # (a tiny pool evicts p1's blocks first)


def test_default_model_in_three_groups_equals_transformers(default_model_dir, hf_default):
    groups = tuple(KVCacheGroupSpec(tuple(range(start, start + 10))) for start in (0, 10, 20))
    runner = ModelRunner(default_model_dir, block_size=16, num_kv_blocks=64, kv_cache_groups=groups)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 2114, 253, 655, 28, 281, 253, 1345, 6702, 30]]
    requests = [[greedy(f"d{i}", p, 10)] for i, p in enumerate(prompts)]
    serve(runner, requests, max_num_batched_tokens=8)
    for (request,) in requests:
        assert_same_greedy(request, hf_default)


def windowed_runner(model_dir, own_attention: bool, **options) -> ModelRunner:
    """A runner whose KV cache groups follow the model's windows: with its own attention (where it
    keeps to the windows), or the reference one over the groups read from the HF config."""
    if own_attention:
        runner = ModelRunner(model_dir, **options)
        if not runner.honours_sliding_windows:
            pytest.skip("the model runner's attention does not keep to sliding windows yet (executor_svc/models: ModelConfig.layer_types)")
        return runner
    windows = layer_sliding_windows(AutoConfig.from_pretrained(model_dir))
    runner = ModelRunner(model_dir, kv_cache_groups=kv_cache_groups(windows), **options)
    runner.attention = WindowedReferenceAttention(windows)
    return runner


def full_attention_differs(model_dir, prompts: list[list[int]], max_tokens: int) -> bool:
    """Whether transformers without the windows gives other tokens (so the prompts test them)."""
    config = AutoConfig.from_pretrained(model_dir)
    config.sliding_window = None
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    unwindowed = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    windowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return any(hf_greedy(unwindowed, p, max_tokens) != hf_greedy(windowed, p, max_tokens) for p in prompts)


@pytest.mark.parametrize("own_attention", [False, True], ids=["reference-attention", "runner-attention"])
def test_windowed_mistral_equals_transformers_past_its_window(windowed_model_dirs, own_attention):
    """A tiny Mistral, window 32, block size 8: prompts of 42-66 tokens and 30 more generated, in
    chunks of 16, while its blocks outside the window are freed; then a prefix hit that finds
    the window before it cached (its first blocks were freed long before)."""
    model_dir = windowed_model_dirs["mistral"]
    runner = windowed_runner(model_dir, own_attention, block_size=8, num_kv_blocks=48)
    assert runner.kv_cache_groups == (KVCacheGroupSpec(tuple(range(runner.config.num_layers)), 32),)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[1, 17 + i, 300, 41, 5 + i, 900] * (7 + 2 * i) for i in range(3)]
    assert full_attention_differs(model_dir, prompts, 30)
    requests = [[greedy(f"w{i}", p, 30)] for i, p in enumerate(prompts)]
    again = [[greedy("again", prompts[0] + [3], 30)]]  # needs only the window before its hit
    scheduler = serve(runner, requests, again, max_num_batched_tokens=16, max_num_seqs=3)
    assert scheduler.max_seq_len == 512 > 47 * 8  # a sequence holds at most 7 blocks: the window's
    for group in requests + again:
        for request in group:
            assert_same_greedy(request, reference)
    assert again[0][0].num_cached_tokens == 40


@pytest.mark.parametrize(("num_kv_blocks", "preempts"), [(200, False), (40, True)])
def test_full_and_windowed_layers_equal_transformers(windowed_model_dirs, num_kv_blocks, preempts):
    """A tiny Qwen2, layer 0 full attention, layers 1-2 within 24 tokens: three groups of one layer
    (one K/V tensor pair), block size 4, chunks of 13, `n` = 2 forks and a prefix hit; with a
    small pool, preemptions (and sequences capped at what it holds)."""
    model_dir = windowed_model_dirs["qwen2"]
    runner = windowed_runner(model_dir, own_attention=False, block_size=4, num_kv_blocks=num_kv_blocks)
    assert [g.sliding_window for g in runner.kv_cache_groups] == [None, 24, 24]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[1, 17 + i, 300, 41, 5 + i, 900, 77] * (5 + 2 * i) for i in range(3)]
    assert full_attention_differs(model_dir, prompts, 30)
    requests = [[greedy(f"q{i}", p, 30)] for i, p in enumerate(prompts)]
    requests.append([greedy(f"n{i}", prompts[1], 12) for i in range(2)])
    again = [[greedy("again", prompts[2] + [3, 4], 20)]]
    scheduler = serve(runner, requests, again, max_num_batched_tokens=13, max_num_seqs=4)
    assert (scheduler.num_preemptions > 0) == preempts
    for group in requests + again:
        for request in group:
            expected = hf_greedy(reference, request.prompt_token_ids, request.max_tokens)
            num_compared = min(len(expected), request.num_output_tokens)  # (a small pool caps the length)
            assert num_compared >= 10 and request.output_token_ids[:num_compared] == expected[:num_compared], request.req_id
    assert again[0][0].num_cached_tokens == 60 or preempts
