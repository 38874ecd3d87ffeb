import pytest
from transformers import AutoTokenizer

from pagoda import model_files
from scheduler_svc.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(model_files.resolve_model(None)))


TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 🎉🚀 and 🇫🇷 flags, 👩‍👩‍👧 family, café, naïve, 日本語のテキスト, Ελληνικά.",
    "  leading spaces\n\nand newlines\t tabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_valid_utf8_and_join_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = [detok.push(t) for t in ids]
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # strict: raises on a lone surrogate
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    if "🎉" in text:
        assert any(d == "" for d in deltas)  # some emoji span several tokens: held back, not broken


def test_special_tokens_are_skipped_or_shown(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2]
    shown = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    hidden = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(shown.push(t) for t in ids).endswith(tokenizer.convert_ids_to_tokens(2))
    assert "".join(hidden.push(t) for t in ids) == "Hi there"


def feed_all(matcher, pieces):
    sent, matched = "", None
    for piece in pieces:
        text, matched = matcher.feed(piece)
        sent += text
        if matched:
            return sent, matched
    return sent + matcher.flush(), None


def test_stop_string_split_across_deltas():
    assert feed_all(StopStringMatcher(["STOP"], False), ["abc S", "TO", "Pxyz"]) == ("abc ", "STOP")
    assert feed_all(StopStringMatcher(["STOP"], True), ["abc S", "TO", "Pxyz"]) == ("abc STOP", "STOP")


def test_text_that_only_looks_like_a_stop_is_released():
    matcher = StopStringMatcher(["STOP"], False)
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("X") == ("STX", None)
    assert feed_all(StopStringMatcher(["\n\n"], False), ["a\n", "b\n", "c"]) == ("a\nb\nc", None)


def test_earliest_of_several_stops_wins():
    assert feed_all(StopStringMatcher(["world", "lo w"], False), ["hello world"]) == ("hel", "lo w")
