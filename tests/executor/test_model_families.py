"""Every supported family (`executor_svc.models`), at the model runner, against transformers.

One tiny random model per family (`tests/model_families.py`), served through the core
scheduler in float32: a chat prompt and a prompt of several windows, prefilled in chunks of
8 tokens, 24 tokens generated; then the chat prompt again with more turns, which hits the
prefix cache. Greedy tokens equal transformers' token for token; every computed row's
log-probabilities are within 1e-4 of transformers'. The sliding families keep their windows
in their own KV cache groups, and transformers without the windows gives other tokens on
these prompts (so the windows are tested). The families transformers reads from GGUF are
also written as GGUF files and compared with transformers' reading of the same file; the MoE
families, which it cannot read, with transformers on the folder the file was written from
holding the file's weights. `gemma3_mm` is a `Gemma3ForConditionalGeneration` (a tiny vision
tower), compared on text with transformers' model of that class.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from executor_svc.loader import UnsupportedModelError, load_config
from executor_svc.model import PackedLinear
from executor_svc.model_runner import ModelRunner
from executor_svc.models import SUPPORTED_ARCHITECTURES
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import GGUFEmbedding, GGUFLinear
from pagoda.step import SamplingParams
from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from tests.executor.plans import run_with_scheduler
from tests.executor.test_model_runner import hf_greedy
from tests.gguf_blocks import T
from tests.model_families import (
    FAMILIES,
    GGUF_ARCHITECTURES,
    GGUF_CONFIG,
    GGUF_TYPES,
    MOE_GGUF_ARCHITECTURES,
    MOE_GGUF_CONFIG,
    SLIDING,
    WINDOW,
    build_family,
    gguf_model_dir,
    load_reference,
    write_gguf,
)

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, default_model_dir):
    return {kind: build_family(kind, tmp_path_factory.mktemp(f"family-{kind}"), default_model_dir) for kind in FAMILIES}


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> dict[str, list[int]]:
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chat_ids = default_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    more = chat + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    more_ids = default_tokenizer.apply_chat_template(more, add_generation_prompt=True, tokenize=True, return_dict=False)
    long = torch.randint(3, 40000, (4 * WINDOW + 5,), generator=torch.Generator().manual_seed(5)).tolist()
    return {"chat": list(chat_ids), "long": long, "more": list(more_ids)}


def serve_recording_logits(runner: ModelRunner, *batches: list[Request]) -> dict[str, list[torch.Tensor]]:
    """Serve each batch through the core scheduler (chunks of 8 tokens) once the one before is
    done; returns each request's logits, one row per computed token, in order."""
    config = SchedulerConfig(
        num_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        kv_cache_groups=runner.kv_cache_groups,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    scheduler = Scheduler(config)
    rows: dict[str, list[torch.Tensor]] = {}

    def execute(plan):
        result, logits = runner.execute_with_logits(plan)
        for req_id, lg in logits.items():
            rows.setdefault(req_id, []).append(lg)
        return result

    runner.execute = execute  # (an instance attribute: this runner only)
    for batch in batches:
        for request in batch:
            scheduler.add_requests([request])
        run_with_scheduler(runner, scheduler)
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not runner.requests
    assert scheduler.num_preemptions == 0
    return rows


def assert_runner_equals_transformers(runner: ModelRunner, reference, prompts) -> None:
    """The chat and long prompts at once, then the longer chat (a prefix hit): greedy tokens equal
    transformers'; every computed row's log-probabilities within 1e-4."""
    first = [Request(name, prompts[name], GREEDY, max_tokens=MAX_TOKENS) for name in ("chat", "long")]
    again = Request("more", prompts["more"], GREEDY, max_tokens=MAX_TOKENS)
    rows = serve_recording_logits(runner, first, [again])
    assert again.num_cached_tokens >= 8  # the chat prompt's blocks (the windowed groups' last ones)
    for request in (*first, again):
        expected = hf_greedy(reference, request.prompt_token_ids, MAX_TOKENS)
        assert len(expected) >= 8, request.req_id
        assert request.output_token_ids[: len(expected)] == expected, request.req_id
    for request in first:  # every row computed: the prompt's and each decode's
        tokens = request.prompt_token_ids + request.output_token_ids
        ours = torch.cat(rows[request.req_id]).log_softmax(-1)
        with torch.no_grad():
            theirs = reference(torch.tensor([tokens[:-1]])).logits[0].float().log_softmax(-1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_equals_transformers(kind, family_dirs, prompts):
    model_dir = family_dirs[kind]
    reference = load_reference(model_dir)
    runner = ModelRunner(model_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=160)
    windows = {g.sliding_window for g in runner.kv_cache_groups}
    assert windows == ({None, WINDOW} if kind in ("qwen2", "qwen3", "gemma2", "gemma3", "gemma3_mm") else {WINDOW} if kind in SLIDING else {None})
    assert_runner_equals_transformers(runner, reference, prompts)
    if kind in SLIDING:
        unwindowed = load_reference(model_dir, sliding_window=10_000)  # wider than any sequence here
        assert hf_greedy(unwindowed, prompts["long"], MAX_TOKENS) != hf_greedy(reference, prompts["long"], MAX_TOKENS)


@pytest.mark.parametrize("kind", list(GGUF_ARCHITECTURES))
def test_family_gguf_file_equals_transformers_reading_it(kind, tmp_path, default_model_dir, prompts):
    """The family as a GGUF file of quantized blocks (llama.cpp's naming and layout), read by the
    runner -- every projection, the embedding and the LM head kept in their blocks -- and by
    transformers' own GGUF loading: the same tokens and log-probabilities."""
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_dir = tmp_path / "hf", tmp_path / "gguf"
    build_family(kind, hf_dir, default_model_dir, **GGUF_CONFIG.get(kind, {}))
    path = write_gguf(kind, hf_dir, tmp_path / f"tiny-{kind}.gguf")
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    runner = ModelRunner(gguf_model_dir(path, hf_dir, gguf_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=160)
    assert runner.config.architecture == load_config(hf_dir).architecture
    if get_kernel() is not None:
        assert runner.quantization == "gguf"
        assert_blocks_kept(runner.model, merged=kind == "phi3")
    if kind == "gemma2":  # the window survives the file (attention.sliding_window)
        assert {g.sliding_window for g in runner.kv_cache_groups} == {None, WINDOW}
    assert_runner_equals_transformers(runner, reference, prompts)


@pytest.mark.parametrize("kind", list(MOE_GGUF_ARCHITECTURES))
def test_moe_gguf_file_equals_transformers_on_the_weights_it_holds(kind, tmp_path, default_model_dir, prompts):
    """A Qwen3-MoE (`qwen3moe`) or Mixtral ("llama" with experts) GGUF file of quantized blocks, its
    config read from the metadata: the same tokens and log-probabilities as transformers on the
    folder it was written from with the file's weights (transformers cannot read these files).
    The attention projections keep their blocks (q/k of the Mixtral file unpermuted), the experts
    and the router are floats; the top-k weights are renormalised and no window is set, as llama.cpp does."""
    from executor_svc.model import SparseMoE

    hf_dir, gguf_dir, reference_dir = tmp_path / "hf", tmp_path / "gguf", tmp_path / "reference"
    build_family(kind, hf_dir, default_model_dir, **MOE_GGUF_CONFIG[kind])
    path = write_gguf(kind, hf_dir, tmp_path / f"tiny-{kind}.gguf", reference_dir)
    reference = load_reference(reference_dir)
    runner = ModelRunner(gguf_model_dir(path, hf_dir, gguf_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=160)
    config = runner.config
    assert config.architecture == load_config(hf_dir).architecture
    assert config.norm_topk_prob and config.sparse_layers == (True,) * config.num_layers
    assert {g.sliding_window for g in runner.kv_cache_groups} == {None}
    assert all(isinstance(layer.mlp, SparseMoE) for layer in runner.model.layers)
    if get_kernel() is not None:
        assert runner.quantization == "gguf"
        qkv = [layer.self_attn.qkv_proj for layer in runner.model.layers]
        assert all(isinstance(m, GGUFLinear) and m.types == [T.Q8_0, T.Q4_1] for m in qkv)
        assert isinstance(runner.model.embed_tokens, GGUFEmbedding) and isinstance(runner.model.lm_head, GGUFLinear)
    assert_runner_equals_transformers(runner, reference, prompts)


def test_gemma3_multimodal_checkpoint_of_the_newer_layout_serves_its_language_model(family_dirs, tmp_path, prompts):
    """`Gemma3ForConditionalGeneration` as transformers >= 4.52 names it (`model.language_model.*`,
    `model.vision_tower.*`, `lm_head`) serves the same text model as the older layout
    (`language_model.model.*`, the layout `test_family_equals_transformers[gemma3_mm]` reads)."""
    import shutil

    from safetensors.torch import load_file, save_file

    older = family_dirs["gemma3_mm"]
    for file in older.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    renamed = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}
    tensors = {}
    for name, tensor in load_file(str(older / "model.safetensors")).items():
        prefix = next(p for p in renamed if name.startswith(p))
        tensors[renamed[prefix] + name.removeprefix(prefix)] = tensor
    assert any(name.startswith("model.vision_tower.") for name in tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    runner = ModelRunner(tmp_path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=160)
    assert runner.config.architecture == "Gemma3ForConditionalGeneration"
    assert_runner_equals_transformers(runner, load_reference(older), prompts)


def _metadata_only_gguf(path, arch: str, **keys) -> None:
    """A GGUF file of `arch` with a MoE model's metadata (`keys` more) and only a token embedding."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "keys", "named"),
    [
        ("qwen2moe", {}, "'qwen2_moe' is not supported"),  # transformers reads it; no family of ours
        ("llama", {"expert_shared_count": 1}, "llama.expert_shared_count: shared experts"),
        ("qwen3moe", {"rope_scaling_type": gguf.RopeScalingType.YARN}, "qwen3moe.rope.scaling.type 'yarn'"),
    ],
)
def test_moe_gguf_file_we_cannot_serve_is_refused_in_one_line_naming_why(arch, keys, named, tmp_path):
    _metadata_only_gguf(tmp_path / "moe.gguf", arch, **keys)
    with pytest.raises(UnsupportedModelError) as error:
        load_config(tmp_path / "moe.gguf")
    assert "\n" not in str(error.value) and named in str(error.value)


def assert_blocks_kept(model, merged: bool) -> None:
    """Every linear of the model is a `GGUFLinear` of the file's types (`GGUF_TYPES`), the embedding a
    `GGUFEmbedding`; q/k/v one module of a Q8_0 and a Q4_1 segment (`merged`: Phi-3's one Q8_0 tensor)."""
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear, GGUFLinear))]
    assert linears and all(isinstance(m, GGUFLinear) for m in linears), [type(m).__name__ for m in linears]
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    qkv = [m for name, m in model.named_modules() if name.endswith("qkv_proj")]
    types = [T.Q8_0] if merged else [T.Q8_0, T.Q4_1]
    assert len(qkv) == model.config.num_layers and all(m.types == types for m in qkv)


# the vision-language families whose tiny models (and processors) tests/executor/test_images.py builds
VISION_LANGUAGE = {"LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}


def test_every_registered_architecture_has_a_tiny_model(family_dirs):
    built = {load_config(path).architecture for path in family_dirs.values()}
    assert built | VISION_LANGUAGE == set(SUPPORTED_ARCHITECTURES)


def test_unknown_architecture_is_refused_in_one_line_naming_it_and_the_supported(family_dirs, tmp_path):
    import json
    import shutil

    shutil.copy(family_dirs["gemma2"] / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as error:
        load_config(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "'FalconForCausalLM'" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


# the families' GGUF files whose decode steps run as C calls (executor_svc/cpu_decode_path.py), and those
# whose layers it does not cover: Gemma 2's attention soft cap
C_DECODE_PATH = {"llama": True, "qwen3": True, "phi3": True, "gemma3": True, "gemma2": False}


@pytest.mark.parametrize("kind", list(C_DECODE_PATH))
def test_family_gguf_decode_steps_through_the_c_path_equal_transformers(kind, tmp_path, default_model_dir, prompts):
    """A GGUF file's decode steps as C calls (q/k norms, Gemma's 1 + w and sandwich norms, GeGLU,
    the embedding scale, Gemma 3's local rotary tables, merged q/k/v of two block types, sliding
    layers read from their window's first key, inside a block of 4): the same tokens and
    log-probabilities as transformers reading the file, the decodes past a window included."""
    from transformers import AutoModelForCausalLM

    if get_kernel() is None:
        pytest.skip("no C compiler: no GGUF kernel, no C decode path")
    hf_dir, gguf_dir = tmp_path / "hf", tmp_path / "gguf"
    build_family(kind, hf_dir, default_model_dir, **GGUF_CONFIG.get(kind, {}))
    path = write_gguf(kind, hf_dir, tmp_path / f"tiny-{kind}.gguf")
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    runner = ModelRunner(gguf_model_dir(path, hf_dir, gguf_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=160)
    step = runner.backend.decode_step
    assert (step is not None) == C_DECODE_PATH[kind]
    if step is None:
        return
    windows = {g.sliding_window for g in runner.kv_cache_groups} - {None}
    taken = past_window = 0
    forward = step.forward

    def counting(input_ids, positions, kv_caches, meta):
        nonlocal taken, past_window
        out = forward(input_ids, positions, kv_caches, meta)
        taken += out is not None
        longest = (meta if not isinstance(meta, tuple) else meta[0]).max_seq_len
        past_window += out is not None and any(longest > w for w in windows)
        return out

    step.forward = counting
    assert_runner_equals_transformers(runner, reference, prompts)
    assert taken >= 2 * MAX_TOKENS - 4, taken  # (the decodes of the three requests, some together)
    if kind == "gemma3":  # its file keeps the window (16: the long prompt is 4 windows and more)
        assert windows == {WINDOW} and past_window >= MAX_TOKENS, (windows, past_window)


@pytest.mark.parametrize("chunk", [1, 16], ids=["one-row-steps", "prompt-chunks"])
def test_gguf_int8_activations_quality_bound(chunk, tmp_path, default_model_dir, monkeypatch):
    """`--gguf-int8-activations` (opt-in, not transformers' numbers): a tiny Llama GGUF file whose
    layers are all Q5_0, teacher-forced one token a step (every step a one-row step through the C decode
    path) or 16 a step (prompt chunks: the multi-row int8 loops), against the same runner with float32 x:
    the log-probabilities within 0.1, 0.01 on average (measured max 0.029, mean 0.004, both ways: a row's
    Q5_0 int8 product is the same bits in a chunk as alone), and the same top-1 token at >= 90 % of the
    positions (measured 97.9 %).
    (The Gemma-3-shaped Q4_K_M file of the benchmarks, Q5_0 and Q4_K layers, one decode step: max 0.033,
    mean 0.006.)"""
    kernel = get_kernel()
    if kernel is None or not kernel.int8_activations_supported:
        pytest.skip("no int8 loop in this build of the GGUF kernel (no AVX2)")
    from executor_svc.backend import BackendOptions
    from tests.executor.test_quantized_runner import _teacher_forced_logprobs

    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        monkeypatch.setitem(GGUF_TYPES, name, "Q5_0")
    hf_dir, gguf_dir = tmp_path / "hf", tmp_path / "gguf"
    # weights of std 0.05: nearer a trained model's scale than the family tests' 0.2, under which any rounding
    # grows layer after layer (there: max 0.91, mean 0.070, top-1 87.5 %)
    build_family("llama", hf_dir, default_model_dir, initializer_range=0.05)
    model_dir = gguf_model_dir(write_gguf("llama", hf_dir, tmp_path / "tiny-llama.gguf"), hf_dir, gguf_dir)
    tokens = torch.randint(3, 40000, (48,), generator=torch.Generator().manual_seed(9)).tolist()

    def logprobs(int8: bool) -> torch.Tensor:
        runner = ModelRunner(model_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                             backend=BackendOptions(gguf_int8_activations=int8))
        assert kernel.int8_activations == int8 and runner.backend.decode_step is not None
        return _teacher_forced_logprobs(runner, tokens, chunk_sizes=[chunk])

    try:
        float_x, int8_x = logprobs(False), logprobs(True)
    finally:
        kernel.set_int8_activations(False)
    diff = (float_x - int8_x).abs()
    agree = (float_x.argmax(-1) == int8_x.argmax(-1)).float().mean().item()
    print(f"int8 x: max |dlogprob| {diff.max():.4f}, mean {diff.mean():.5f}; top-1 agreement {agree:.3f}")
    assert diff.max() > 0  # (the int8 loop ran)
    assert diff.max() <= 0.1 and diff.mean() <= 0.01 and agree >= 0.9
