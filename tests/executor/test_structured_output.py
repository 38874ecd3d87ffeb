"""Structured output on the executor: constrained greedy equals transformers + xgrammar's logits processor.

The default model runs under the real core scheduler (`scheduler_svc.core`), with every
constraint kind in one batch, in each serving mode: plain steps, async scheduling (each
step planned before the last result is applied), chunked prefill with preemption (a
preempted request comes back in full and its matcher replays its output), and
speculative decoding (drafts checked against the grammar). The reference is transformers'
`generate` with `xgrammar.contrib.hf.LogitsProcessor` on the same weights
(`tests/structured_reference.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import pytest
import torch

from pagoda.constraint import Constraint
from pagoda.step import GRAMMAR_FAILED, GRAMMAR_PENDING, NewRequestData, SamplingParams, StepPlan
from scheduler_svc.core import FinishReason, Request, Scheduler, SchedulerConfig
from scheduler_svc.core.config import SpeculativeConfig
from tests.structured_reference import CASES, Reference

EOS = 2


@pytest.fixture(scope="module")
def reference(hf_default, default_model_dir):
    from transformers import AutoTokenizer

    return Reference(hf_default, AutoTokenizer.from_pretrained(str(default_model_dir)))


@pytest.fixture(scope="module")
def expected(reference):
    """case name -> (prompt ids, transformers' constrained greedy tokens)."""
    out = {}
    for case in CASES:
        prompt = reference.prompt_ids(case.prompt)
        out[case.name] = (prompt, reference.greedy(prompt, case.constraint, case.max_tokens))
    return out


def _requests(expected, tag: str, logprobs: bool = False) -> list[Request]:
    return [
        Request(
            f"{tag}-{case.name}",
            expected[case.name][0],
            SamplingParams(temperature=0.0, stop_token_ids=(EOS,), logprobs=logprobs, constraint=case.constraint),
            max_tokens=case.max_tokens,
            eos_token_ids=frozenset({EOS}),
            arrival_time=i,
        )
        for i, case in enumerate(CASES)
    ]


def _apply(scheduler: Scheduler, plan, result) -> list:
    """`update_from_output`, then what the engine does for a request whose grammar is still
    compiling on the executor (GRAMMAR_PENDING): take it out, to be admitted again."""
    step_updates = scheduler.update_from_output(plan, result)
    for error in result.errors:
        assert error.message.startswith(GRAMMAR_PENDING), error
        scheduler.defer(error.req_id)
    if result.errors:
        time.sleep(0.02)
    return step_updates


def _run(runner, scheduler: Scheduler, ahead: bool, updates: list | None = None) -> None:
    """Drive `scheduler` and `runner` to the end; `ahead`: each step planned before the last result is applied."""
    in_flight: deque = deque()
    for _ in range(5_000):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        in_flight.append((plan, runner.execute(plan)))
        while len(in_flight) > (1 if ahead else 0):
            step_updates = _apply(scheduler, *in_flight.popleft())
            if updates is not None:
                updates += step_updates
        scheduler.check_integrity()
    while in_flight:
        _apply(scheduler, *in_flight.popleft())
    runner.execute(scheduler.schedule())  # drop the finished requests' state
    assert not scheduler.has_unfinished()
    assert not runner.structured, "a finished request's matcher was kept"


SETTINGS = {
    "plain": (dict(num_blocks=256, max_num_batched_tokens=512), False),
    "async_scheduling": (dict(num_blocks=256, max_num_batched_tokens=512), True),
    "chunked_prefill_and_preemption": (dict(num_blocks=12, max_num_batched_tokens=24), True),
    "speculative": (dict(num_blocks=256, max_num_batched_tokens=512, speculative=SpeculativeConfig(4, prompt_lookup_min=1, prompt_lookup_max=3)), False),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_constrained_greedy_equals_transformers_with_xgrammar(default_runner, expected, reference, setting):
    config, ahead = SETTINGS[setting]
    scheduler = Scheduler(SchedulerConfig(block_size=16, **config))
    requests = _requests(expected, setting)
    for request in requests:
        scheduler.add_requests([request])
    _run(default_runner, scheduler, ahead)
    for case, request in zip(CASES, requests):
        want = expected[case.name][1]
        assert request.output_token_ids == want, (case.name, request.output_token_ids, want)
        ended = want[-1] == EOS
        assert request.finish_reason is (FinishReason.EOS if ended else FinishReason.LENGTH), case.name
        text = reference.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        assert case.valid(text) if ended else reference.is_valid_prefix(case.constraint, want), (case.name, text)
    assert sum(r.finish_reason is FinishReason.EOS for r in requests) >= 4  # the grammars' ends are reached
    if setting == "chunked_prefill_and_preemption":
        assert scheduler.num_preemptions > 0
    if setting == "speculative":
        assert sum(r.num_draft_tokens for r in requests) > 0


def test_logprobs_are_those_of_the_masked_distribution(default_runner, expected, reference, hf_default):
    import xgrammar as xgr

    scheduler = Scheduler(SchedulerConfig(num_blocks=256, block_size=16))
    requests = _requests(expected, "logprobs", logprobs=True)[:2]
    for request in requests:
        scheduler.add_requests([request])
    updates: list = []
    _run(default_runner, scheduler, ahead=True, updates=updates)
    for case, request in zip(CASES, requests):
        prompt, output = expected[case.name][0], request.output_token_ids
        with torch.inference_mode():
            logits = hf_default(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].contiguous()
        matcher = xgr.GrammarMatcher(reference.compile(case.constraint))
        mask = xgr.allocate_token_bitmask(len(output), logits.shape[-1])
        for i, token in enumerate(output):
            matcher.fill_next_token_bitmask(mask, i)
            assert matcher.accept_token(token)
        raw = logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]
        xgr.apply_token_bitmask_inplace(logits, mask)
        want = logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]
        got = torch.tensor([u.sampled.logprob for u in updates if u.req_id == request.req_id])
        assert torch.allclose(got, want, atol=2e-3), (case.name, (got - want).abs().max())
        assert (got - raw).max() > 0.5  # the mask matters: some token is far likelier than unmasked


def test_drafts_the_grammar_rejects_are_never_accepted(default_runner, expected, reference, monkeypatch):
    """Drafts are the reference's own continuation (accepted), or tokens outside the grammar (rejected)."""
    monkeypatch.setattr(default_runner.structured, "defer", False)  # plans by hand: the step waits for its grammar
    case = next(c for c in CASES if c.name == "regex")
    prompt, want = expected[case.name]
    letters = reference.tokenizer("abc", add_special_tokens=False)["input_ids"]
    for tag, drafts, num_kept in (("good", want[1:4], 4), ("bad", letters[:3], 1)):
        req_id = f"drafts-{tag}"
        sampling = SamplingParams(temperature=0.0, stop_token_ids=(EOS,), constraint=case.constraint)
        new = NewRequestData(req_id, prompt, len(prompt), sampling, list(range(1, 8)), 0)
        first = default_runner.execute(StepPlan(0, new_requests=[new], num_scheduled_tokens={req_id: len(prompt)}))
        assert [t.token_id for t in first.sampled] == want[:1]
        # its first output token, then the drafts after it
        plan = StepPlan(1, num_scheduled_tokens={req_id: 1 + len(drafts)}, scheduled_spec_decode_tokens={req_id: drafts})
        tokens = [t.token_id for t in default_runner.execute(plan).sampled]
        assert tokens == want[1 : 1 + num_kept], (tag, tokens, want)
        default_runner.execute(StepPlan(2, finished_req_ids=[req_id]))


def test_a_choice_ends_with_eos_and_a_truncated_json_with_length(default_runner, expected):
    json_case = next(c for c in CASES if c.name == "json_schema")
    prompt = expected[json_case.name][0]
    scheduler = Scheduler(SchedulerConfig(num_blocks=256, block_size=16))
    greedy = dict(temperature=0.0, stop_token_ids=(EOS,))
    cut = Request("cut", prompt, SamplingParams(**greedy, constraint=json_case.constraint), max_tokens=5, eos_token_ids=frozenset({EOS}))
    # min_tokens beyond the grammar's end: the end wins (EOS is its only token)
    forced = Request("forced", prompt, SamplingParams(**greedy, min_tokens=6, constraint=Constraint.choice(["ok"])), max_tokens=8, eos_token_ids=frozenset({EOS}))
    scheduler.add_requests([cut])
    scheduler.add_requests([forced])
    _run(default_runner, scheduler, ahead=True)
    assert cut.finish_reason is FinishReason.LENGTH and cut.output_token_ids == expected[json_case.name][1][:5]
    assert forced.finish_reason is FinishReason.EOS and forced.output_token_ids[-1] == EOS


def _bitmask(num_rows: int, vocab: int, allowed: list[int]) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return torch.tensor([signed] * num_rows, dtype=torch.int32)


def test_the_mask_applies_before_every_sampling_rule():
    """The model's favourite token is outside the grammar: no rule, whatever its order, may bring it back."""
    from executor_svc.sampler import Sampler, SamplingRow

    vocab, allowed = 64, [3, 10, 40]
    rules = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=1, seed=1),
        dict(temperature=1.0, top_p=0.05, seed=2),
        dict(temperature=1.0, min_p=0.9, seed=3),
        dict(temperature=0.0, logit_bias=((0, 100.0), (5, 100.0))),
        dict(temperature=0.5, repetition_penalty=2.0, presence_penalty=1.0, seed=4),
        dict(temperature=0.0, min_tokens=4, stop_token_ids=(3, 10, 40)),  # the grammar allows only stop tokens
    ]
    constraint = Constraint.regex("x")  # any: the rows' masks are given
    rows = [SamplingRow(SamplingParams(**rule, logprobs=True, constraint=constraint), [0, 1, 2, 0], 2) for rule in rules]
    logits = torch.randn(len(rules), vocab)
    logits[:, 0] = 20.0
    out = Sampler()(logits, rows, _bitmask(len(rules), vocab, allowed))
    assert all(token in allowed for token in out.token_ids), out.token_ids
    assert torch.isinf(logits[:, [t for t in range(vocab) if t not in allowed]]).all()  # masked in place
    masked = logits.log_softmax(-1)
    for i, token in enumerate(out.token_ids):
        assert abs(out.logprobs[i] - float(masked[i, token])) < 1e-5  # the masked distribution's


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_masks_through_the_shared_sampler(backend, tmp_path, default_model_dir):
    """A tiny random Llama with the default tokenizer, float32 weights (no GGUF decode path):
    constrained greedy on the torch and Triton backends equals transformers + xgrammar's processor."""
    from transformers import AutoTokenizer

    from executor_svc.model_runner import ModelRunner
    from tests.executor.plans import PlanBuilder, run_to_completion
    from tests.service.test_tiny_models import build_tiny

    hf = build_tiny("llama", tmp_path, default_model_dir, shard=False)
    reference = Reference(hf, AutoTokenizer.from_pretrained(str(tmp_path)))
    runner = ModelRunner(tmp_path, device="cpu", num_kv_blocks=32, attention_backend=backend)
    runner.structured.defer = False  # plans by hand: the step waits for its grammar
    builder = PlanBuilder(num_blocks=32)
    cases = [c for c in CASES if c.name in ("regex", "choice", "json_object")]
    prompts = {c.name: reference.prompt_ids(c.prompt)[:24] for c in cases}
    for case in cases:
        builder.add(case.name, prompts[case.name], 12, SamplingParams(temperature=0.0, constraint=case.constraint), chunk_sizes=[10])
    outputs = run_to_completion(runner, builder)
    for case in cases:  # the plan builder ignores EOS: compare up to the reference's end
        want = reference.greedy(prompts[case.name], case.constraint, 12)
        assert outputs[case.name][: len(want)] == want, (backend, case.name)


def test_a_grammar_that_fails_on_the_executor_fails_its_request_alone(default_runner, monkeypatch):
    monkeypatch.setattr(default_runner.structured, "defer", False)
    greedy = SamplingParams(temperature=0.0)
    bad = NewRequestData("bad-grammar", [1, 2, 3, 4], 4, SamplingParams(temperature=0.0, constraint=Constraint.regex("(")), [1], 0)
    good = NewRequestData("good-neighbour", [1, 2, 3, 4], 4, greedy, [2], 0)
    result = default_runner.execute(StepPlan(0, new_requests=[bad, good], num_scheduled_tokens={"bad-grammar": 4, "good-neighbour": 4}))
    assert [t.req_id for t in result.sampled] == ["good-neighbour"]
    assert [e.req_id for e in result.errors] == ["bad-grammar"]
    assert result.errors[0].message.startswith(f"{GRAMMAR_FAILED}constraint.regex: ")
    assert "failed to compile on the executor: Regex parsing error" in result.errors[0].message
    default_runner.execute(StepPlan(1, finished_req_ids=["bad-grammar", "good-neighbour"]))


# issue 43: a grammar never stalls a step. Over the 1 s bound below here (the scheduler's check test
# measured 15 s for it); distinct field names per test, so no compile is shared.
def _slow(tag: str) -> Constraint:
    return Constraint.json_schema(
        {"type": "object", "properties": {f"{tag}{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(2000)}}
    )


def test_a_slow_grammar_waits_alone_and_one_over_the_time_bound_fails_only_its_request(default_runner, default_model_dir, monkeypatch):
    """The step runs the others while a grammar compiles (GRAMMAR_PENDING for its request, sent
    again in full each step as the scheduler would), and a compile over the bound fails that
    request alone, naming its constraint (GRAMMAR_FAILED)."""
    from executor_svc.structured_output import StructuredOutput

    structured = StructuredOutput(default_model_dir, timeout_s=1.0)
    monkeypatch.setattr(default_runner, "structured", structured)
    slow = NewRequestData("slow-grammar", [1, 2, 3, 4], 4, SamplingParams(temperature=0.0, constraint=_slow("s")), [1], 0)
    plain = NewRequestData("plain-neighbour", [1, 5, 6, 7], 4, SamplingParams(temperature=0.0), list(range(5, 45)), 0)
    plan = StepPlan(0, new_requests=[slow, plain], num_scheduled_tokens={"slow-grammar": 4, "plain-neighbour": 4})
    times, pending, error, started_all = [], 0, None, time.monotonic()
    try:
        for step_id in range(1, 400):
            started = time.monotonic()
            result = default_runner.execute(plan)
            times.append(time.monotonic() - started)
            assert [t.req_id for t in result.sampled] == ["plain-neighbour"]  # it never waits
            (mine,) = result.errors
            if not mine.message.startswith(GRAMMAR_PENDING):
                error = mine.message
                break
            pending += 1
            time.sleep(0.05)
            plan = StepPlan(
                step_id, finished_req_ids=["slow-grammar"], new_requests=[slow],
                num_scheduled_tokens={"slow-grammar": 4, "plain-neighbour": 1},
            )
    finally:
        default_runner.execute(StepPlan(10_000, finished_req_ids=["slow-grammar", "plain-neighbour"]))
        structured.close()
    compile_s = time.monotonic() - started_all  # its compile process's start-up, then 1 s of compiling
    assert pending >= 2 and error is not None, (pending, times)
    # no step waited for the compile (a step that did would take all of it): a generous bound for a loaded machine
    assert max(times) < compile_s / 2, (times, compile_s)
    assert error.startswith(f"{GRAMMAR_FAILED}constraint.json_schema: ") and "within 1 s (the limit)" in error, error
    assert structured.num_compiles == 1


def test_a_pending_request_is_taken_out_and_samples_once_its_grammar_is_ready(default_runner, expected, monkeypatch):
    """Under the core scheduler (as the engine drives it): a constrained request is deferred while its
    grammar compiles and then generates exactly transformers' constrained tokens; the others never wait."""
    from executor_svc.structured_output import StructuredOutput

    structured = StructuredOutput(default_runner.model_dir)  # cold: its compile process starts now
    monkeypatch.setattr(default_runner, "structured", structured)
    case = next(c for c in CASES if c.name == "json_schema")
    scheduler = Scheduler(SchedulerConfig(num_blocks=256, block_size=16))
    constrained = _requests(expected, "deferred")[[c.name for c in CASES].index("json_schema")]
    plain = Request("plain", [1, 2, 3], SamplingParams(temperature=0.0), max_tokens=40, arrival_time=-1.0)
    scheduler.add_requests([plain])
    scheduler.add_requests([constrained])
    pending_steps, step_times = 0, []
    try:
        for _ in range(5_000):
            if not scheduler.has_unfinished():
                break
            plan = scheduler.schedule()
            started = time.monotonic()
            result = default_runner.execute(plan)
            step_times.append(time.monotonic() - started)
            pending_steps += any(e.message.startswith(GRAMMAR_PENDING) for e in result.errors)
            _apply(scheduler, plan, result)
    finally:
        default_runner.execute(scheduler.schedule())
        structured.close()
    assert pending_steps >= 1  # its compile process was cold: it waited (alone) at least once
    assert len(plain.output_token_ids) == 40 and max(step_times) < sum(step_times) / 3  # no step waited for it
    assert constrained.output_token_ids == expected[case.name][1]
    assert structured.num_compiles == 1  # compiled once, though its request was sent several times


def test_a_row_the_grammar_leaves_no_token_fails_its_request_alone(default_runner, monkeypatch):
    """A mask of all zeros (no token of the vocabulary continues the grammar) makes every logit -inf and
    the log-softmax NaN: the request fails alone as GRAMMAR_FAILED naming its constraint, and no NaN
    log-probability is sent (the scheduler would drop the whole executor as lying: seen under the fuzzer)."""
    monkeypatch.setattr(default_runner.structured, "defer", False)
    dead = NewRequestData("dead-end", [1, 2, 3, 4], 4,
                          SamplingParams(temperature=0.0, logprobs=True, constraint=Constraint.regex("(yes|no)")), [1], 0)
    good = NewRequestData("good-neighbour", [1, 2, 3, 4], 4, SamplingParams(temperature=0.0, logprobs=True), [2], 0)
    bitmask = default_runner.structured.bitmask

    def no_token_for_dead_end(row_req_ids, *args):
        mask = bitmask(row_req_ids, *args)
        mask[row_req_ids.index("dead-end")] = 0
        return mask

    monkeypatch.setattr(default_runner.structured, "bitmask", no_token_for_dead_end)
    result = default_runner.execute(StepPlan(0, new_requests=[dead, good], num_scheduled_tokens={"dead-end": 4, "good-neighbour": 4}))
    assert [t.req_id for t in result.sampled] == ["good-neighbour"] and result.sampled[0].logprob <= 0.0
    assert [e.req_id for e in result.errors] == ["dead-end"]
    assert result.errors[0].message == f"{GRAMMAR_FAILED}constraint.regex: no token of the vocabulary continues it here"
    default_runner.execute(StepPlan(1, finished_req_ids=["dead-end", "good-neighbour"]))


@pytest.mark.parametrize("sent", ["the scheduler's grammar", "bytes that do not deserialize"])
def test_the_scheduler_compiled_grammar_is_taken_not_compiled_again(default_runner, expected, monkeypatch, sent):
    """Compiled once (issue 43): a request that carries its grammar as the scheduler's check compiled it
    (NewRequest.compiled_grammar, over the wire) is deserialized, never compiled on the executor, and
    generates exactly transformers' constrained tokens; bytes that do not deserialize fall back to the
    executor's own bounded compile, with the same tokens."""
    import xgrammar as xgr

    from executor_svc.structured_output import StructuredOutput
    from pagoda import wire
    from pagoda.grammars import compile_constraint, tokenizer_info

    case = next(c for c in CASES if c.name == "json_schema")
    if sent == "the scheduler's grammar":  # as the scheduler's compile process serializes it
        compiler = xgr.GrammarCompiler(tokenizer_info(default_runner.model_dir), max_threads=1)
        grammar = compile_constraint(compiler, case.constraint).serialize_json().encode()
    else:
        grammar = b'{"not": "a grammar"}'
    structured = StructuredOutput(default_runner.model_dir)
    monkeypatch.setattr(default_runner, "structured", structured)
    scheduler = Scheduler(SchedulerConfig(num_blocks=256, block_size=16))
    request = _requests(expected, f"sent-{len(grammar)}")[[c.name for c in CASES].index("json_schema")]
    request.sampling = dataclasses.replace(request.sampling, compiled_grammar=grammar)
    scheduler.add_requests([request])
    try:
        for _ in range(5_000):
            if not scheduler.has_unfinished():
                break
            plan = scheduler.schedule()
            sent_plan = wire.plan_from_proto(wire.plan_to_proto(plan))  # what the executor receives
            assert all(r.sampling.compiled_grammar == grammar for r in sent_plan.new_requests)
            _apply(scheduler, plan, default_runner.execute(sent_plan))
            assert not any(state.sampling.compiled_grammar for state in default_runner.requests.values())  # not kept
    finally:
        default_runner.execute(scheduler.schedule())
        structured.close()
    assert request.output_token_ids == expected[case.name][1]
    if sent == "the scheduler's grammar":
        assert (structured.num_received, structured.num_compiles) == (1, 0)
    else:
        assert (structured.num_received, structured.num_compiles) == (0, 1)


def test_the_executors_grammar_loads_take_tenants_in_turns(default_model_dir, monkeypatch):
    """The compile thread runs one load at a time, tenants in turns (NewRequest.tenant): a tenant's
    first grammar waits for the load running, not for another tenant's queue of them."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from executor_svc.structured_output import StructuredOutput

    structured = StructuredOutput(default_model_dir)
    structured._threads = ThreadPoolExecutor(1)  # (no compile process: the loads below are stand-ins)
    queued = threading.Event()  # the first load runs until every other one is queued
    monkeypatch.setattr(structured, "_load", lambda constraint, grammar: queued.wait(30) and constraint.value)
    try:
        for i in range(6):
            structured.add(f"f{i}", Constraint.regex(f"f{i}"), [], b"", "flooder")
        structured.add("b", Constraint.regex("b"), [], b"", "bystander")
        structured.add("f6", Constraint.regex("f6"), [], b"", "flooder")
        queued.set()
        structured._requests["f6"].compiled.result(timeout=30)
        assert structured._requests["b"].compiled.result() == "b"
    finally:
        structured.close()
    # f0 was running when the bystander's came; then the bystander, then the flooder's in order
    assert list(structured.turn_order) == ["flooder", "bystander", *["flooder"] * 6], structured.turn_order


def test_many_tools_are_compiled_here_not_carried_and_a_call_is_accepted(default_model_dir):
    """Issue 43 point 4: a grammar the compile process finds cheaper to compile again than to carry
    (64 tools' calls: ~0.1-0.3 s to compile, ~4 s to serialize to ~20 MB, ~1.5 s to deserialize) comes
    back as "compiles" alone and this process compiles it on its compile thread (num_local_compiles);
    a small one still comes back serialized. The matcher is the constraint's: a call of one of the
    tools in the hermes format is accepted to the end."""
    import json

    from bench.stall_probe import many_tools
    from executor_svc.structured_output import StructuredOutput
    from pagoda.tool_parsers import TOOL_PARSERS
    from scheduler_svc.tokenizer import load_tokenizer

    tools = many_tools(64, 901)
    tag = Constraint.structural_tag(TOOL_PARSERS["hermes"].constraint(tools, parallel=True)["structural_tag"])
    structured = StructuredOutput(default_model_dir)
    try:
        structured.add("small", Constraint.regex("[0-9]{2}"), [], b"", "a")
        structured.add("tools", tag, [], b"", "a")
        for req_id in ("small", "tools"):
            structured._requests[req_id].compiled.result(timeout=300)
        assert (structured.num_compiles, structured.num_local_compiles) == (2, 1)
        matcher = structured._requests["tools"].ready()
        name = tools[5]["function"]["name"]  # its parameters: urgent (required), amount, city
        call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps({"urgent": True}))
        tokenizer = load_tokenizer(default_model_dir)
        for token_id in tokenizer.encode(call, add_special_tokens=False):
            assert matcher.accept_token(token_id), tokenizer.decode([token_id])
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
        import xgrammar as xgr

        fresh = xgr.GrammarMatcher(structured._requests["tools"].compiled.result())
        assert not fresh.accept_token(tokenizer.encode("Hello", add_special_tokens=False)[0])  # a call is required
    finally:
        structured.close()
