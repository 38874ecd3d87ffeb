"""The sampler against transformers' logits processors, and its own contract (seeds, logprobs, penalties)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from executor_svc.sampler import Sampler, SamplingRow, filter_logits
from pagoda.step import SamplingParams

VOCAB = 500
GREEDY = SamplingParams(temperature=0.0)


def logits_for(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(params: SamplingParams, token_ids=(5, 6, 7), num_prompt_tokens: int = 2) -> SamplingRow:
    return SamplingRow(params, list(token_ids), num_prompt_tokens)


def processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return Sampler()._process(logits, rows)


def hf_filtered(logits: torch.Tensor, warpers) -> torch.Tensor:
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.int64)
    for w in warpers:
        logits = w(ids, logits)
    return logits


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(10, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (50, 0.8, 0.0), (40, 0.95, 0.05), (1, 1.0, 0.0), (0, 0.01, 0.0)],
)
def test_filters_match_transformers_warpers(top_k, top_p, min_p):
    logits = logits_for(4, seed=top_k)
    warpers = [TemperatureLogitsWarper(0.7)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    ours = filter_logits(logits / 0.7, [top_k] * 4, [top_p] * 4, [min_p] * 4)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf_filtered(logits, warpers)))
    torch.testing.assert_close(ours, hf_filtered(logits, warpers))


def test_filters_are_per_row():
    logits = logits_for(3, seed=3)
    ours = filter_logits(logits, [5, 0, 0], [1.0, 0.5, 1.0], [0.0, 0.0, 0.2])
    torch.testing.assert_close(ours[0:1], hf_filtered(logits[0:1], [TopKLogitsWarper(5)]))
    torch.testing.assert_close(ours[1:2], hf_filtered(logits[1:2], [TopPLogitsWarper(0.5)]))
    torch.testing.assert_close(ours[2:3], hf_filtered(logits[2:3], [MinPLogitsWarper(0.2)]))


def test_repetition_penalty_matches_transformers():
    logits = logits_for(2, seed=4)
    tokens = [[1, 2, 3, 3, 400], [7, 8, 9, 10]]
    rows = [row(SamplingParams(repetition_penalty=1.3), tokens[0], 2), row(GREEDY, tokens[1], 2)]
    ours = processed(logits, rows)
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([tokens[0]]), logits[0:1].clone())
    torch.testing.assert_close(ours[0:1], hf)
    torch.testing.assert_close(ours[1], logits[1])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = logits_for(1, seed=5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = processed(logits, [row(params, [9, 9, 4, 4, 4, 4, 11], num_prompt_tokens=3)])  # output: 4 4 4 11
    expected = logits.clone()
    expected[0, 4] -= 0.5 + 3 * 0.25
    expected[0, 11] -= 0.5 + 0.25
    torch.testing.assert_close(ours, expected)


def test_logit_bias_and_min_tokens():
    logits = logits_for(2, seed=6)
    params = SamplingParams(logit_bias=((3, 100.0), (4, -2.0)), min_tokens=2, stop_token_ids=(8, 9))
    rows = [row(params, [1, 2, 3], num_prompt_tokens=2), row(params, [1, 2, 3, 4], num_prompt_tokens=2)]
    ours = processed(logits, rows)
    expected = logits.clone()
    expected[:, 3] += 100.0
    expected[:, 4] -= 2.0
    expected[0, [8, 9]] = -float("inf")  # one token generated < min_tokens; row 1 has two
    torch.testing.assert_close(ours, expected)
    assert Sampler()(logits, rows).token_ids == [3, 3]


def test_greedy_is_argmax_and_untouched_logits_are_not_copied():
    logits = logits_for(5, seed=7)
    assert processed(logits, [row(GREEDY)] * 5) is logits
    assert Sampler()(logits, [row(GREEDY)] * 5).token_ids == logits.argmax(-1).tolist()


def test_logprobs_come_from_raw_logits():
    logits = logits_for(3, seed=8)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, repetition_penalty=2.0),
        SamplingParams(temperature=1.3, top_k=3, logprobs=True),
        GREEDY,
    ]
    out = Sampler()(logits, [row(p) for p in params])
    raw = logits.log_softmax(-1)
    for i in (0, 1):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    values, ids = raw[0].topk(5)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.logprobs[2] is None


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = logits_for(6, seed=9)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = Sampler()(logits[2:3], [row(seeded, [1] * 10)]).token_ids[0]
    others = [row(SamplingParams(temperature=0.9)), row(GREEDY), row(seeded, [1] * 10)] + [
        row(SamplingParams(temperature=1.0, seed=s)) for s in (1, 2, 3)
    ]
    for trial in range(3):
        torch.manual_seed(trial)
        assert Sampler()(logits[[0, 1, 2, 3, 4, 5]], others).token_ids[2] == alone


def test_seed_and_position_drive_the_draw():
    logits = torch.zeros(1, VOCAB)  # uniform: the draw alone picks the token
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [Sampler()(logits, [row(params, [0] * n)]).token_ids[0] for n in range(1, 30)]
    again = [Sampler()(logits, [row(params, [0] * n)]).token_ids[0] for n in range(1, 30)]
    assert draws == again
    assert len(set(draws)) > 20  # a fresh draw at each position
    other_seed = [
        Sampler()(logits, [row(SamplingParams(temperature=1.0, seed=8), [0] * n)]).token_ids[0] for n in range(1, 30)
    ]
    assert other_seed != draws


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [0.0] * 2]))
    rows = [row(SamplingParams(temperature=1.0))] * 4000
    counts = torch.bincount(torch.tensor(Sampler()(logits.expand(4000, -1), rows).token_ids), minlength=5)
    assert counts[3:].sum() == 0
    torch.testing.assert_close(counts[:3] / 4000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04, rtol=0)


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = logits_for(4, seed=10)
    params = [GREEDY, SamplingParams(temperature=5.0), GREEDY, SamplingParams(temperature=0.5, min_p=0.5)]
    out = Sampler()(logits, [row(p) for p in params]).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    kept = filter_logits(logits[3:4] / 0.5, [0], [1.0], [0.5])
    assert torch.isfinite(kept[0, out[3]])


def test_finite_rows_finds_every_nan_and_infinity_and_no_overflowing_sum():
    from executor_svc.model_runner import finite_rows

    logits = torch.randn(6, 1000)
    logits[1, 5], logits[2, 999], logits[3, 0] = float("nan"), float("inf"), -float("inf")
    logits[4, :2] = 3e38  # finite values whose float32 sum overflows: still finite rows
    logits[5, 7], logits[5, 8] = float("inf"), -float("inf")  # a NaN sum
    assert finite_rows(logits) == [True, False, False, False, True, False]
    assert finite_rows(torch.randn(3, 50)) == [True] * 3
