"""Bounded before work (issue #43): a text over the token limit is refused having tokenized about the
limit's worth of it, in Generate and Tokenize, and the piecewise count never refuses a text that fits.

Before: both tokenized a text of any size in full (a 4 MB Tokenize: ~2 s of the tokenizer here,
9.9 s of CPU and 629 MB on a busy machine) and only then refused it.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda import model_files
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc import tokenizer as tokenizer_module
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.prompts import MAX_TOKENIZE_TOKENS, PromptWorker
from scheduler_svc.tokenizer import encode_at_most, load_tokenizer, read_model_spec, tokens_at_least
from scheduler_svc.validation import validate_generate


@pytest.fixture(scope="module")
def default_tokenizer():
    model_dir = model_files.resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    return tokenizer, read_model_spec(model_dir, tokenizer)


@pytest.fixture
def encoded_lengths(monkeypatch):
    """The length of every text handed to the tokenizer."""
    lengths: list[int] = []
    encode = tokenizer_module.encode

    def spy(tokenizer, text, add_special_tokens):
        lengths.append(len(text))
        return encode(tokenizer, text, add_special_tokens)

    monkeypatch.setattr(tokenizer_module, "encode", spy)
    return lengths


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=300)
       | st.text(st.sampled_from(list(" \n\tabcdé😀#_=")), max_size=300),
       st.integers(1, 40), st.booleans())
def test_the_piecewise_count_is_a_lower_bound(default_tokenizer, text, piece_chars, add_special_tokens):
    """Tiny pieces cut words and runs of spaces anywhere; the bound still never passes the true count."""
    tokenizer, _ = default_tokenizer
    bound, num_chars = tokens_at_least(tokenizer, text, add_special_tokens, 10**9, piece_chars=piece_chars)
    assert bound <= len(tokenizer.encode(text, add_special_tokens=add_special_tokens)) and num_chars == len(text)


@pytest.mark.parametrize("text", ["a" + " " * 3000, "hello world " * 10, "\n" + " " * 80 * 40 + "x"])
def test_a_text_that_fits_gets_the_tokenizers_ids_counted_or_not(default_tokenizer, text):
    tokenizer, _ = default_tokenizer
    want = tokenizer.encode(text, add_special_tokens=True)
    assert encode_at_most(tokenizer, text, True, len(want)) == want  # 3000 spaces: counted in pieces first


@pytest.mark.parametrize("prompt", ["text", "chat"])
def test_generate_refuses_a_prompt_over_max_model_len_having_tokenized_a_part(default_tokenizer, encoded_lengths,
                                                                             prompt):
    tokenizer, spec = default_tokenizer
    text = "hello world " * 6000  # 72,000 characters, under the character bound of 1024 tokens (82,944)
    req = pb.GenerateRequest(text=text) if prompt == "text" else pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]))
    with pytest.raises(InvalidArgument, match=f"prompt.{prompt}: at least .* tokens .* leave no room") as err:
        validate_generate(req, tokenizer, spec, 1024)
    assert "max_model_len" in err.value.message
    assert encoded_lengths and max(encoded_lengths) < len(text) / 2 and sum(encoded_lengths) < len(text) / 2


def test_tokenize_refuses_a_4_mb_text_having_tokenized_a_fifth_of_it(default_tokenizer, encoded_lengths):
    tokenizer, spec = default_tokenizer
    text = "hello world " * 340_000  # 4.08 MB, 680,000 tokens
    worker = PromptWorker(tokenizer, spec, 1024)
    try:
        with pytest.raises(InvalidArgument, match=f"text: at least .* more than the {MAX_TOKENIZE_TOKENS}"):
            asyncio.run(worker.tokenize(pb.TokenizeRequest(text=text)))
        assert sum(encoded_lengths) < len(text) / 4
        reply = asyncio.run(worker.tokenize(pb.TokenizeRequest(text="hello world " * 20_000)))
        assert len(reply.token_ids) == 40_001  # longer than max_model_len: Tokenize still counts it
    finally:
        worker.close()
