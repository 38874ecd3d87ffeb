"""The front end's limits (issue #16): the early prompt bound is sound, beams never ask for more than the vocabulary."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda import model_files
from scheduler_svc.beam_search import BeamSearchParams
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.tokenizer import load_tokenizer, read_model_spec
from scheduler_svc.validation import check_fields, max_prompt_chars, validate_generate
from pagoda.v1 import generation_pb2 as pb


@pytest.fixture(scope="module")
def default_tokenizer():
    model_dir = model_files.resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    return tokenizer, read_model_spec(model_dir, tokenizer)


def test_max_token_chars_of_the_default_model(default_tokenizer):
    _, spec = default_tokenizer
    assert spec.max_token_chars == 81  # SmolLM2's longest token: a newline and 80 spaces, byte-level
    assert max_prompt_chars(spec, 8192) == 8192 * 81
    assert spec.ignored_chars == frozenset(map(chr, (0x4, 0x6, 0x13, 0x14, 0x16, 0x1D)))


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=400) | st.sampled_from(
    [" " * 1000, "\n" + " " * 80 * 5, "#" * 800, "aaaa" * 300, "\U0001f600" * 50]))
def test_a_text_has_at_least_chars_over_max_token_chars_tokens(default_tokenizer, text):
    """The early bound is sound: no text is refused that could fit max_model_len."""
    tokenizer, spec = default_tokenizer
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert num_tokens * spec.max_token_chars >= len(text) - sum(text.count(c) for c in spec.ignored_chars)


def test_a_text_just_over_the_bound_is_refused_before_tokenizing(default_tokenizer):
    tokenizer, spec = default_tokenizer

    class NoTokenizer:
        def __getattr__(self, name):
            raise AssertionError("tokenized")

    req = pb.GenerateRequest(text="x" * (max_prompt_chars(spec, 64) + 1))
    with pytest.raises(InvalidArgument, match="prompt.text"):
        validate_generate(req, NoTokenizer(), spec, 64)
    req = pb.GenerateRequest(text="x" * max_prompt_chars(spec, 64))
    with pytest.raises(InvalidArgument, match="leave no room"):  # tokenized, then too long
        validate_generate(req, tokenizer, spec, 64)
    req = pb.GenerateRequest(text="\x16" * (max_prompt_chars(spec, 64) + 1) + "hi")  # dropped characters do not count
    assert validate_generate(req, tokenizer, spec, 64).prompt_token_ids


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_float_must_be_finite(default_tokenizer, field, value):
    _, spec = default_tokenizer
    req = pb.GenerateRequest(text="hi")
    setattr(req.sampling, field, value)
    with pytest.raises(InvalidArgument, match=f"sampling.{field}: must be a finite number"):
        check_fields(req, spec, 8192)


def test_beam_candidates_are_bounded_by_the_vocabulary():
    params = BeamSearchParams(beam_width=2, max_tokens=4, stop_token_ids=frozenset(range(100)), vocab_size=64)
    assert params.num_candidates == 64
    assert BeamSearchParams(beam_width=2, max_tokens=4, stop_token_ids=frozenset({5}), vocab_size=64).num_candidates == 3


def test_a_text_of_dropped_characters_only_is_refused(default_tokenizer):
    tokenizer, spec = default_tokenizer
    with pytest.raises(InvalidArgument, match="prompt.text: has no tokens once tokenized"):
        validate_generate(pb.GenerateRequest(text="\x16\x04\x16"), tokenizer, spec, 8192)
