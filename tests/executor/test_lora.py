"""LoRA adapters at the model runner, against transformers + `peft` on the same weights.

Each family's tiny random base (`tests/model_families.py`) with two random PEFT adapters
(`init_lora_weights=False`): one on every projection, one on q and v only with rsLoRA and an
`alpha_pattern`. Served through the core scheduler in float32 in one batch that mixes them with
the base model on the same prompt (prefill chunks of 8 tokens, prefix caching on): greedy tokens
equal `PeftModel`'s token for token, log-probabilities within 1e-4, and base and adapters never
share a cached block. Then GGUF blocks, bfloat16 and int8 bases, preemption, loading and
unloading at run time, and each refusal.
"""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.lora import LoraError, LoraState
from executor_svc.model_runner import ModelRunner
from pagoda.step import SamplingParams, StepPlan
from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from tests.executor.plans import PlanBuilder, run_beam_searches, run_to_completion, run_with_scheduler
from tests.executor.test_model_runner import hf_greedy
from tests.model_families import build_family, load_reference

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 16
# the families whose every projection an adapter may target (the MoE ones: their attention)
DENSE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
MOE = ("qwen3_moe", "mixtral")
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, out_dir, targets, r=8, alpha=16, seed=0, **options):
    """A random PEFT adapter of `base_dir` (B not zero: `init_lora_weights=False`), saved to `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, **options)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random B is small; larger deltas make the adapters' tokens differ from the base's
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_reference(base_dir, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(base_dir), str(adapter_dir)).eval()


def serve(runner: ModelRunner, requests: list[Request], **config) -> dict[str, list[torch.Tensor]]:
    """Serve `requests` at once through the core scheduler (chunks of 8 tokens); each one's logits rows."""
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=runner.num_kv_blocks, block_size=runner.block_size, max_model_len=runner.max_model_len,
        kv_cache_groups=runner.kv_cache_groups, max_num_batched_tokens=config.pop("max_num_batched_tokens", 8),
        max_num_seqs=8, **config,
    ))
    rows: dict[str, list[torch.Tensor]] = {}
    execute = runner.execute

    def recording(plan):
        result, logits = runner.execute_with_logits(plan)
        for req_id, lg in logits.items():
            rows.setdefault(req_id, []).append(lg)
        return result

    runner.execute = recording
    try:
        for request in requests:
            scheduler.add_requests([request])
        run_with_scheduler(runner, scheduler)
    finally:
        runner.execute = execute
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not runner.requests
    return rows


@pytest.fixture(scope="module")
def prompt(default_tokenizer) -> list[int]:
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    return list(default_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


def family_adapters(kind, tmp_path, default_model_dir):
    base = build_family(kind, tmp_path / "base", default_model_dir)
    if kind in MOE:
        targets_a, targets_b = ["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "v_proj"]
    elif kind == "phi3":  # stored merged
        targets_a, targets_b = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj"]
    else:
        targets_a, targets_b = ALL_TARGETS, ["q_proj", "v_proj"]
    a = make_adapter(base, tmp_path / "a", targets_a, r=8, alpha=16, seed=1)
    b_options = dict(use_rslora=True)
    if kind not in ("phi3",):
        b_options["alpha_pattern"] = {"v_proj": 4}
    b = make_adapter(base, tmp_path / "b", targets_b, r=4, alpha=8, seed=2, **b_options)
    return base, a, b


@pytest.mark.parametrize("kind", DENSE + MOE)
def test_adapters_mixed_with_the_base_equal_peft(kind, tmp_path, default_model_dir, prompt):
    base, a, b = family_adapters(kind, tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, enable_lora=True)
    runner.add_lora("a", a)
    runner.add_lora("b", b)
    requests = [
        Request("base", prompt, GREEDY, max_tokens=MAX_TOKENS),
        Request("a", prompt, GREEDY, max_tokens=MAX_TOKENS, lora="a"),
        Request("b", prompt, GREEDY, max_tokens=MAX_TOKENS, lora="b"),
        Request("a-again", prompt + prompt[:6], GREEDY, max_tokens=MAX_TOKENS, lora="a"),
    ]
    rows = serve(runner, requests)
    references = {"": load_reference(base), "a": peft_reference(base, a), "b": peft_reference(base, b)}
    outputs = set()
    for request in requests:
        expected = hf_greedy(references[request.lora], request.prompt_token_ids, MAX_TOKENS)
        assert request.output_token_ids[: len(expected)] == expected, request.req_id
        outputs.add(tuple(expected))
    assert len(outputs) == 4  # each adapter changes the tokens
    # the same prompt: no hit across base and adapters, the adapter's own prefix hit
    assert requests[1].num_cached_tokens == 0 and requests[2].num_cached_tokens == 0
    for request in requests[1:3]:
        tokens = request.prompt_token_ids + request.output_token_ids
        ours = torch.cat(rows[request.req_id]).log_softmax(-1)
        with torch.no_grad():
            theirs = references[request.lora](torch.tensor([tokens[:-1]])).logits[0].float().log_softmax(-1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)  # (the adapters' deltas make larger logits)


def test_an_adapter_hits_its_own_prefix_cache_only(tmp_path, default_model_dir, prompt):
    """The adapter's cached blocks serve its next request, never the base model's of the same prompt."""
    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, enable_lora=True)
    runner.add_lora("a", a)
    cold = [Request("one", prompt, GREEDY, max_tokens=4, lora="a")]
    warm = [Request("two", prompt, GREEDY, max_tokens=4, lora="a"), Request("three", prompt, GREEDY, max_tokens=4)]
    scheduler = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=4, max_model_len=runner.max_model_len,
                                          kv_cache_groups=runner.kv_cache_groups, max_num_batched_tokens=64))
    scheduler.add_requests(cold)
    run_with_scheduler(runner, scheduler)
    for request in warm:
        scheduler.add_requests([request])
    run_with_scheduler(runner, scheduler)
    assert warm[0].num_cached_tokens >= len(prompt) - 4  # the adapter's blocks
    assert warm[1].num_cached_tokens == 0  # the base model never reads them
    assert warm[0].output_token_ids == cold[0].output_token_ids


def test_gguf_blocks_base_keeps_its_blocks_and_equals_peft_on_the_file(tmp_path, default_model_dir, prompt):
    """A GGUF base (projections kept in their blocks): each adapter's tokens equal PeftModel's on
    transformers' reading of the same file; decode steps with adapter rows take the C decode path
    (the deltas added inside it), and so do base-only steps."""
    from transformers import AutoModelForCausalLM

    from executor_svc.quant.gguf_kernel import get_kernel
    from tests.model_families import gguf_model_dir, write_gguf

    if get_kernel() is None:
        pytest.skip("no C compiler: GGUF blocks are dequantized")
    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    path = write_gguf("llama", base, tmp_path / "tiny.gguf")
    runner = ModelRunner(gguf_model_dir(path, base, tmp_path / "gguf"), device="cpu", dtype="float32", block_size=4,
                         num_kv_blocks=200, enable_lora=True)
    assert runner.quantization == "gguf"
    runner.add_lora("a", a)
    decode_path = runner.backend.decode_step
    taken = []
    if decode_path is not None:
        original = decode_path.forward

        def recorded(*args):
            out = original(*args)
            taken.append(out is not None)
            return out

        decode_path.forward = recorded
    requests = [Request("base", prompt, GREEDY, max_tokens=MAX_TOKENS), Request("a", prompt, GREEDY, max_tokens=MAX_TOKENS, lora="a")]
    serve(runner, requests, max_num_batched_tokens=64)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    assert requests[0].output_token_ids == hf_greedy(hf, prompt, MAX_TOKENS)[:MAX_TOKENS]
    from peft import PeftModel

    with_adapter = PeftModel.from_pretrained(hf, str(a)).eval()
    expected = hf_greedy(with_adapter, prompt, MAX_TOKENS)
    assert requests[1].output_token_ids[: len(expected)] == expected
    if decode_path is not None:
        assert any(taken)  # decode steps holding the adapter's row went through the C step
        taken.clear()
        base_only = Request("base-alone", prompt, GREEDY, max_tokens=4)
        serve(runner, [base_only], max_num_batched_tokens=64)
        assert any(taken)  # a step of the base model alone still takes the C decode path


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("float32", "int8")])
def test_bf16_and_int8_bases_apply_the_adapter_in_floating_point(dtype, quantization, tmp_path, default_model_dir, prompt):
    """On a bfloat16 or int8 base the adapter's delta is computed in float32: the adapted model is no
    farther from PeftModel in float32 than that base's own rounding goes (bfloat16: PeftModel's own in
    bfloat16; int8: our base model's from transformers'), within 1.5x + 0.01 in mean |logprob
    difference|, and far from the base model."""
    from executor_svc.quant.gguf_kernel import get_kernel

    if quantization == "int8" and get_kernel() is None:
        pytest.skip("no C compiler: no int8")
    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype=dtype, quantization=quantization, block_size=4, num_kv_blocks=200,
                         enable_lora=True)
    runner.add_lora("a", a)
    rows = serve(runner, [Request("a", prompt, GREEDY, max_tokens=1, lora="a"), Request("base", prompt, GREEDY, max_tokens=1)])
    ours = {name: torch.cat(rows[name])[: len(prompt)].float().log_softmax(-1) for name in ("a", "base")}
    with torch.no_grad():
        adapted = peft_reference(base, a)(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        plain = load_reference(base)(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    to_adapted = (ours["a"] - adapted).abs().mean().item()
    base_error = (ours["base"] - plain).abs().mean().item()
    to_plain = (ours["a"] - plain).abs().mean().item()
    yardstick = base_error
    if dtype == "bfloat16":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        hf_bf16 = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
        with torch.no_grad():
            peft_bf16 = PeftModel.from_pretrained(hf_bf16, str(a)).eval()(torch.tensor([prompt])).logits[0]
        yardstick = (peft_bf16.float().log_softmax(-1) - adapted).abs().mean().item()
    print(f"{dtype}/{quantization}: mean |dlogprob| adapted to peft {to_adapted:.4f} (yardstick {yardstick:.4f}; base to "
          f"transformers {base_error:.4f}), adapted to the base model {to_plain:.4f}")
    assert to_adapted <= 1.5 * yardstick + 0.01
    assert to_plain > 4 * to_adapted


def test_preempted_adapter_request_resumes_identically(tmp_path, default_model_dir, prompt):
    base, a, b = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, enable_lora=True)
    runner.add_lora("a", a)
    runner.add_lora("b", b)

    def run(preempt: bool) -> dict[str, list[int]]:
        builder = PlanBuilder(block_size=4, num_blocks=200)
        builder.add("a", prompt, MAX_TOKENS, chunk_sizes=[5])
        builder.add("b", prompt[3:], MAX_TOKENS, chunk_sizes=[7])
        builder.add("base", prompt, MAX_TOKENS)
        adapters = {"a": "a", "b": "b", "base": ""}
        next_plan = builder.next_plan

        def plan_with_adapters():
            plan = next_plan()
            for new in plan.new_requests:
                new.lora = adapters[new.req_id]
            if preempt and builder.step_id == 12 and "a" in builder.requests:
                builder.preempt("a")
            return plan

        builder.next_plan = plan_with_adapters
        return run_to_completion(runner, builder)

    assert run(preempt=True) == run(preempt=False)
    expected = hf_greedy(peft_reference(base, a), prompt, MAX_TOKENS)
    assert run(preempt=True)["a"][: len(expected)] == expected


def test_load_and_unload_at_run_time(tmp_path, default_model_dir, prompt):
    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, enable_lora=True)
    plain = Request("plain", prompt, GREEDY, max_tokens=8)
    serve(runner, [plain])
    nbytes = runner.add_lora("a", a)
    assert 0 < nbytes < 1 << 20
    adapted = Request("a", prompt, GREEDY, max_tokens=8, lora="a")
    serve(runner, [adapted])
    assert adapted.output_token_ids != plain.output_token_ids
    runner.remove_lora("a")
    assert all(not m.adapters for m in runner.loras.modules.values())
    # a request naming an adapter no longer loaded fails alone: never a base-model answer
    builder = PlanBuilder(block_size=4, num_blocks=200)
    builder.add("gone", prompt, 4)
    builder.add("base", prompt, 4)
    plan = builder.next_plan()
    plan.new_requests[0].lora = "a"
    result = runner.execute(plan)
    assert [e.req_id for e in result.errors] == ["gone"] and "not loaded" in result.errors[0].message
    assert [t.req_id for t in result.sampled] == ["base"]
    with pytest.raises(LoraError, match="lora_name"):
        runner.remove_lora("a")


def test_lora_off_fails_an_adapter_request_alone(tmp_path, default_model_dir, prompt):
    base = build_family("llama", tmp_path / "base", default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    builder = PlanBuilder(block_size=4, num_blocks=64)
    builder.add("x", prompt, 2)
    plan = builder.next_plan()
    plan.new_requests[0].lora = "anything"
    result = runner.execute(plan)
    assert not result.sampled and "off" in result.errors[0].message
    with pytest.raises(LoraError, match="enable_lora"):
        runner.add_lora("a", tmp_path)


@pytest.fixture(scope="module")
def llama_runner(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("lora-refusals")
    base = build_family("llama", path / "base", default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=32, enable_lora=True, max_lora_rank=16)
    return base, runner


def _edit_config(folder, **changes):
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "case,field",
    [
        ("dora", "use_dora"),
        ("embedding", "target_modules"),
        ("lm_head", "target_modules"),
        ("rank", "r"),
        ("other_base", "lora_[AB]"),
        ("missing", "lora_path"),
        ("modules_to_save", "modules_to_save"),
        ("bias", "bias"),
    ],
)
def test_refusals_name_the_field_and_load_nothing(case, field, llama_runner, tmp_path, default_model_dir):
    base, runner = llama_runner
    folder = tmp_path / "adapter"
    if case == "dora":
        make_adapter(base, folder, ["q_proj"], use_dora=True)
    elif case == "embedding":
        make_adapter(base, folder, ["embed_tokens", "q_proj"])
    elif case == "lm_head":
        make_adapter(base, folder, ["lm_head"])
    elif case == "rank":
        make_adapter(base, folder, ["q_proj"], r=32, alpha=32)
    elif case == "other_base":
        other = build_family("llama", tmp_path / "other", default_model_dir, hidden_size=96)
        make_adapter(other, folder, ["q_proj", "o_proj"])
    elif case == "missing":
        folder = tmp_path / "nowhere"
    elif case == "modules_to_save":
        make_adapter(base, folder, ["q_proj"])
        _edit_config(folder, modules_to_save=["lm_head"])
    elif case == "bias":
        make_adapter(base, folder, ["q_proj"])
        _edit_config(folder, bias="all")
    with pytest.raises(LoraError, match=field) as info:
        runner.add_lora("bad", folder)
    print(case, "->", info.value)
    assert "bad" not in runner.loras.adapters
    assert all(not m.adapters for m in runner.loras.modules.values())


def test_rows_are_grouped_by_adapter():
    import numpy as np

    state = LoraState()
    state.set_step(np.array([-1, -1, -1]), torch.device("cpu"))
    assert not state.active
    state.set_step(np.array([0, 0, 0, -1, 1, 1, 0]), torch.device("cpu"))
    groups = dict(state.groups)
    assert groups[1] == slice(4, 6)
    assert groups[0].tolist() == [0, 1, 2, 6]
    state.set_step(None, torch.device("cpu"))
    assert not state.active


def test_the_step_plan_carries_the_adapter():
    from pagoda import wire
    from pagoda.step import NewRequestData
    from pagoda.v1 import executor_pb2 as pb

    plan = StepPlan(step_id=3, new_requests=[NewRequestData("r", [1, 2], 2, GREEDY, [1], 0, lora="sql")],
                    num_scheduled_tokens={"r": 2})
    back = wire.plan_from_proto(pb.StepPlan.FromString(wire.plan_to_proto(plan).SerializeToString()))
    assert back.new_requests[0].lora == "sql"


def test_drafts_are_verified_through_the_adapter(tmp_path, default_model_dir, prompt):
    """Speculative decoding: a step verifies an adapter request's drafts (several of its rows) beside a
    base request's: the adapter's own greedy tokens are accepted and its next one added, as PeftModel's."""
    from pagoda.step import NewRequestData

    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, enable_lora=True)
    runner.add_lora("a", a)
    adapted = hf_greedy(peft_reference(base, a), prompt, 5)
    plain = hf_greedy(load_reference(base), prompt, 5)
    assert adapted != plain
    blocks = {"x": list(range(1, 16)), "y": list(range(16, 31))}
    new = [NewRequestData("x", prompt, len(prompt), GREEDY, blocks["x"], 0, lora="a"),
           NewRequestData("y", prompt, len(prompt), GREEDY, blocks["y"], 0)]
    first = runner.execute(StepPlan(0, new_requests=new, num_scheduled_tokens={"x": len(prompt), "y": len(prompt)}))
    assert {t.req_id: t.token_id for t in first.sampled} == {"x": adapted[0], "y": plain[0]}
    drafts = {"x": adapted[1:4], "y": plain[1:4]}
    second = runner.execute(StepPlan(1, num_scheduled_tokens={"x": 4, "y": 4}, scheduled_spec_decode_tokens=drafts))
    out = {}
    for token in second.sampled:
        out.setdefault(token.req_id, []).append(token.token_id)
    assert out == {"x": adapted[1:5], "y": plain[1:5]}  # every draft accepted, one token more each


def test_n_siblings_fork_within_their_adapter(tmp_path, default_model_dir, prompt):
    """`n` samples of an adapter's request (siblings: the follower forks the leader's prompt blocks) beside
    the base model's siblings of the same prompt: each sibling's greedy tokens are its model's."""
    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, enable_lora=True)
    runner.add_lora("a", a)
    scheduler = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=4, max_model_len=runner.max_model_len,
                                          kv_cache_groups=runner.kv_cache_groups, max_num_batched_tokens=16))
    adapted = [Request(f"a{i}", prompt, GREEDY, max_tokens=8, lora="a") for i in range(2)]
    plain = [Request(f"b{i}", prompt, GREEDY, max_tokens=8) for i in range(2)]
    scheduler.add_requests(adapted)
    scheduler.add_requests(plain)
    run_with_scheduler(runner, scheduler)
    expected_adapted = hf_greedy(peft_reference(base, a), prompt, 8)
    expected_plain = hf_greedy(load_reference(base), prompt, 8)
    assert expected_adapted != expected_plain
    for request in adapted:
        assert request.output_token_ids[: len(expected_adapted)] == expected_adapted
    for request in plain:
        assert request.output_token_ids[: len(expected_plain)] == expected_plain


def test_beam_search_and_a_constraint_run_through_the_adapter(tmp_path, default_model_dir, prompt, default_tokenizer):
    """An adapter's beam search beside the base model's (each forked within its own model), then a
    JSON schema and a choice constraint on an adapter's request beside the base's: the best beams equal
    `PeftModel.generate(num_beams=3)`'s and the base's `generate`'s, the constrained greedy tokens
    transformers + xgrammar's processor on each model."""
    from scheduler_svc.beam_search import BeamSearch, BeamSearchParams
    from tests.structured_reference import CASES, Reference

    base, a, _ = family_adapters("llama", tmp_path, default_model_dir)
    runner = ModelRunner(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, enable_lora=True)
    runner.add_lora("a", a)
    models = {"a": peft_reference(base, a), "": load_reference(base)}
    width, n, max_tokens = 3, 2, 6
    eos = models[""].generation_config.eos_token_id
    eos = frozenset([eos] if isinstance(eos, int) else eos or ())
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, n=n, stop_token_ids=eos, eos_token_ids=eos,
                              vocab_size=runner.vocab_size)
    scheduler = Scheduler(SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=4, max_model_len=runner.max_model_len,
                                          kv_cache_groups=runner.kv_cache_groups, max_num_batched_tokens=32))
    searches = {lora: BeamSearch(f"beams-{lora or 'base'}", prompt, params, lora=lora) for lora in models}
    for search in searches.values():
        scheduler.add_requests([search.root()])
    run_beam_searches(runner, scheduler, searches.values(), on_step=scheduler.check_integrity)
    best = {}
    for lora, search in searches.items():
        assert search.done
        with torch.no_grad():
            rows = models[lora].generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                         num_beams=width, num_return_sequences=n, do_sample=False,
                                         max_new_tokens=max_tokens)
        want = [row[len(prompt):].tolist() for row in rows]
        want = [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in want]  # padded after EOS
        best[lora] = [list(h.output_token_ids) for h in search.best()]
        assert best[lora] == want, lora
    assert best["a"] != best[""]

    cases = [case for case in CASES if case.name in ("json_schema", "choice")]
    requests, wanted = [], {}
    reference = Reference(models[""], default_tokenizer)  # (one tokenizer info: the adapter keeps the vocabulary)
    for lora, model in models.items():
        reference.model = model
        for case in cases:
            ids = reference.prompt_ids(case.prompt)
            req_id = f"{case.name}-{lora or 'base'}"
            wanted[req_id] = reference.greedy(ids, case.constraint, case.max_tokens)
            requests.append(Request(req_id, ids, SamplingParams(temperature=0.0, stop_token_ids=(2,), constraint=case.constraint),
                                    max_tokens=case.max_tokens, eos_token_ids=frozenset({2}), lora=lora))
    runner.structured.defer = False  # the core loop here does not re-admit a request whose grammar is pending
    serve(runner, requests, max_num_batched_tokens=64)
    for request in requests:
        assert request.output_token_ids == wanted[request.req_id], request.req_id
    assert wanted["json_schema-a"] != wanted["json_schema-base"]
