"""The beam search controller against transformers' own `generate(num_beams=W)` on tiny random models.

The controller is driven as the engine drives it, with the model's raw log-probabilities
standing in for the executor's top logprobs; EOS hits, several stop tokens, length
penalties, every `early_stopping` mode and `min_new_tokens` are all exercised.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagoda.step import SampledToken
from scheduler_svc.beam_search import BeamSearch, BeamSearchParams
from scheduler_svc.core import FinishReason

VOCAB, EOS, PAD = 48, 1, 1


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.5,  # peaked distributions: no near-ties
        bos_token_id=0,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 1.5  # EOS often among the best candidates
    return model


def run_search(model, prompt, params: BeamSearchParams, restart_at: int | None = None) -> BeamSearch:
    """Drive the controller as the engine does, a full forward per live beam."""
    search = BeamSearch("r", prompt, params)
    live = {search.root().req_id: list(prompt)}
    while not search.done:
        if search.generation == restart_at:
            live = {r.req_id: list(r.all_token_ids) for r in search.restart()}
            restart_at = None
        step = None
        for req_id, token_ids in list(live.items()):
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(torch.tensor([token_ids])).logits[0, -1].float(), dim=-1)
            values, ids = logprobs.topk(params.num_candidates)
            top = list(zip(ids.tolist(), values.tolist()))
            step = search.on_sampled(SampledToken(req_id, top[0][0], top[0][1], top)) or step
        assert step is not None
        for req_id in step.finished_req_ids:
            del live[req_id]
        for parent_id, children in step.forks:
            del live[parent_id]
            live.update((child.req_id, list(child.all_token_ids)) for child in children)
    assert not live
    return search


def hf_beams(model, prompt, num_beams, max_new_tokens, n, **kwargs) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=num_beams,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            pad_token_id=PAD,
            **kwargs,
        )
    return [row[len(prompt) :].tolist() for row in out]


OPTIONS = [
    {},
    {"length_penalty": 0.5},
    {"length_penalty": 2.0},
    {"early_stopping": True},
    {"early_stopping": "never"},
    {"length_penalty": -0.5, "early_stopping": "never"},
]


def test_same_sequences_as_transformers_generate():
    num_eos_endings = num_early_stops = 0
    for seed in range(40):
        model = tiny_model(seed)
        generator = torch.Generator().manual_seed(seed)
        prompt_len = int(torch.randint(1, 9, (1,), generator=generator))
        prompt = torch.randint(2, VOCAB, (prompt_len,), generator=generator).tolist()
        options = OPTIONS[seed % len(OPTIONS)]
        stop_ids = [EOS] if seed % 3 else [EOS, 3]
        min_tokens = 3 if seed % 4 == 0 else 0
        width, max_tokens = 2 + seed % 4, 6 + seed % 9
        n = 1 + seed % width
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            n=n,
            stop_token_ids=frozenset(stop_ids),
            eos_token_ids=frozenset([EOS]),
            min_tokens=min_tokens,
            **options,
        )
        search = run_search(model, prompt, params)
        ours = search.best()
        hf_kwargs = dict(options, eos_token_id=stop_ids, min_new_tokens=min_tokens or None)
        theirs = hf_beams(model, prompt, width, max_tokens, n, **hf_kwargs)
        assert len(ours) == n
        assert [h.score for h in ours] == sorted((h.score for h in ours), reverse=True)
        for hypothesis, row in zip(ours, theirs):
            tokens = list(hypothesis.output_token_ids)
            assert row[: len(tokens)] == tokens and set(row[len(tokens) :]) <= {PAD}, (seed, tokens, row)
            ends_on_stop = tokens[-1] in stop_ids
            assert ends_on_stop or len(tokens) == max_tokens
            assert len(tokens) >= min(min_tokens + 1, max_tokens) or not ends_on_stop
            if ends_on_stop:
                want = FinishReason.EOS if tokens[-1] == EOS else FinishReason.STOP_TOKEN
            else:
                want = FinishReason.LENGTH
            assert hypothesis.finish_reason is want
            num_eos_endings += ends_on_stop
        num_early_stops += search.generation < max_tokens
    assert num_eos_endings >= 10 and num_early_stops >= 3  # the interesting paths were taken


def test_restart_of_the_live_beams_gives_the_same_answer():
    model = tiny_model(7)
    params = BeamSearchParams(
        beam_width=3, max_tokens=9, n=3, stop_token_ids=frozenset([EOS]), eos_token_ids=frozenset([EOS])
    )
    plain = run_search(model, [5, 9, 2], params)
    for restart_at in (0, 4):
        restarted = run_search(model, [5, 9, 2], params, restart_at=restart_at)
        assert restarted.best() == plain.best()


def test_logprobs_follow_each_hypothesis():
    model = tiny_model(3)
    params = BeamSearchParams(
        beam_width=4,
        max_tokens=8,
        n=2,
        stop_token_ids=frozenset([EOS]),
        eos_token_ids=frozenset([EOS]),
        logprobs=True,
        top_logprobs=2,
    )
    prompt = [4, 8, 15]
    for hypothesis in run_search(model, prompt, params).best():
        tokens = list(hypothesis.output_token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.float(), dim=-1)
        assert [entry.token_id for entry in hypothesis.logprobs] == tokens
        for i, entry in enumerate(hypothesis.logprobs):
            assert entry.logprob == pytest.approx(reference[i, tokens[i]].item(), abs=1e-5)
            assert [t for t, _ in entry.top_logprobs] == reference[i].topk(2).indices.tolist()
        total = sum(entry.logprob for entry in hypothesis.logprobs)
        assert hypothesis.score == pytest.approx(total / len(tokens), abs=1e-5)


def test_params_are_checked():
    with pytest.raises(ValueError, match="n must be"):
        BeamSearchParams(beam_width=2, max_tokens=4, n=3)
    assert BeamSearchParams(beam_width=4, max_tokens=4, stop_token_ids=frozenset([1, 2])).num_candidates == 6
    assert BeamSearchParams(beam_width=2, max_tokens=4, top_logprobs=20).num_candidates == 20
