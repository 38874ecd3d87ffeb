"""The model's tokenizer and chat template, loaded from the local model directory."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scheduler_svc.chat import hermes, uses_tools

try:  # transformers 5: the class of every tokenizer backed by the Rust `tokenizers`
    from transformers.tokenization_utils_tokenizers import TokenizersBackend as _TokenizersBackend
except ImportError:  # pragma: no cover - other transformers: always tokenizer.encode
    _TokenizersBackend = None


@dataclass(frozen=True)
class ModelSpec:
    """What the front end needs to know of the model, read from its directory."""

    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_elements_per_token: int = 0  # K and V of every layer (bounds what an executor may claim)
    max_token_chars: int = 64  # the most characters of text one token can stand for (see below)
    ignored_chars: frozenset[str] = frozenset()  # characters the tokenizer drops (no token at all)


def read_model_spec(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> ModelSpec:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text_config = config.get("text_config", config)
    eos: list[int] = []
    generation_config = Path(model_dir) / "generation_config.json"
    for source in (json.loads(generation_config.read_text()) if generation_config.exists() else {}, text_config):
        ids = source.get("eos_token_id")
        for token_id in ids if isinstance(ids, list) else [ids]:
            if isinstance(token_id, int) and token_id not in eos:
                eos.append(token_id)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return ModelSpec(
        max_position_embeddings=int(text_config.get("max_position_embeddings", 2048)),
        vocab_size=int(text_config["vocab_size"]),
        eos_token_ids=tuple(eos),
        kv_elements_per_token=_kv_elements_per_token(text_config),
        max_token_chars=max_token_chars(tokenizer),
        ignored_chars=ignored_chars(tokenizer),
    )


def _kv_elements_per_token(config: dict) -> int:
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return 2 * int(config["num_hidden_layers"]) * int(config.get("num_key_value_heads", heads)) * head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0


# A normalizer may shrink text before it is split (NFC joins a letter and its accent, say);
# this covers that generously.
_NORMALIZER_SLACK = 4


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters of input text one token covers.

    A token's vocabulary string is at least as long as the text it matches: byte-level BPE
    spells each byte as one character, and a character is at least one byte; SentencePiece
    and WordPiece pieces carry their text (plus markers). So a text of c characters has at
    least c / max_token_chars tokens: the front end refuses, before tokenizing, text that
    cannot fit max_model_len (`validation.max_prompt_chars`), not counting `ignored_chars`.
    """
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        longest *= _NORMALIZER_SLACK
    return longest


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    tools: list[dict] | None = None, max_tokens: int | None = None, template_kwargs: dict | None = None,
) -> list[int]:
    """The template's token ids; tools and tool calls go to a template that reads them, and are
    written in the Hermes form for one that does not (`scheduler_svc/chat.py`). More than
    `max_tokens` tokens raise TooManyTokens (`encode_at_most`)."""
    text = render_chat(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    return encode_at_most(tokenizer, text, False, max_tokens)


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    tools: list[dict] | None = None, template_kwargs: dict | None = None,
) -> str:
    """The chat template's text (see `apply_chat_template`)."""
    if (tools or any("tool_calls" in m for m in messages)) and not uses_tools(tokenizer, tools):
        messages, tools = hermes(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int | None = None) -> list[int]:
    return encode_at_most(tokenizer, text, True, max_tokens)


class TooManyTokens(Exception):
    """A text has more tokens than allowed: `num_tokens` (exact), or at least that many in its
    first `num_chars` characters (counted in pieces, the rest not read)."""

    def __init__(self, num_tokens: int, num_chars: int, exact: bool):
        self.num_tokens, self.num_chars, self.exact = num_tokens, num_chars, exact
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.exact:
            return f"{self.num_tokens} tokens"
        return f"at least {self.num_tokens} tokens (counted in its first {self.num_chars} characters)"


# A text longer than this many characters per allowed token is counted in pieces before it is
# encoded. Text averages 3-6 characters a token (SmolLM2: README.md 3.0, "hello world " 6.0), so a
# text that fits is counted first only when it is mostly long tokens (runs of spaces), and one that
# does not fit is refused after about `max_tokens` tokens of work instead of all of its own.
COUNT_ABOVE_CHARS_PER_TOKEN = 8
# Pieces of about this many characters, cut just before a whitespace character that follows a
# non-whitespace one (where regex and Metaspace pre-tokenizers split), searched for up to
# CUT_SEARCH_CHARS further; a text without such a place is cut where the piece ends.
PIECE_CHARS = 16_384
CUT_SEARCH_CHARS = 1_024
_CUT = re.compile(r"\S\s")
# Tokens that the pieces' counts may exceed the whole text's by, per cut (a word split in two, a
# prefix space added to a piece): subtracted, so that a text that fits is never refused.
SLACK_PER_CUT = 4


def encode_at_most(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool, max_tokens: int | None
) -> list[int]:
    """`encode`, refusing (TooManyTokens) a text of more than `max_tokens` tokens (None: no bound);
    a long one (COUNT_ABOVE_CHARS_PER_TOKEN) is counted in pieces first, so it is refused having
    encoded about `max_tokens` tokens of it, not all of it."""
    if max_tokens is not None and len(text) > COUNT_ABOVE_CHARS_PER_TOKEN * max_tokens:
        num_tokens, num_chars = tokens_at_least(tokenizer, text, add_special_tokens, max_tokens)
        if num_tokens > max_tokens:
            raise TooManyTokens(num_tokens, num_chars, exact=False)
    ids = encode(tokenizer, text, add_special_tokens)
    if max_tokens is not None and len(ids) > max_tokens:
        raise TooManyTokens(len(ids), len(text), exact=True)
    return ids


def tokens_at_least(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool, stop_above: int,
    piece_chars: int = PIECE_CHARS,
) -> tuple[int, int]:
    """(a lower bound on the tokens of `text`, the characters read for it): the text is encoded in
    pieces, the bound is the pieces' tokens less SLACK_PER_CUT a cut, and reading stops once the
    bound passes `stop_above`."""
    special = tokenizer.num_special_tokens_to_add(pair=False) if add_special_tokens else 0
    counted, start, num_cuts = 0, 0, 0
    while start < len(text):
        end = len(text) if start + piece_chars >= len(text) else _cut(text, start + piece_chars)
        counted += len(encode(tokenizer, text[start:end], add_special_tokens=False))
        num_cuts += end < len(text)
        bound = counted - SLACK_PER_CUT * num_cuts + special
        if bound > stop_above:
            return bound, end
        start = end
    return counted - SLACK_PER_CUT * num_cuts + special, len(text)


def _cut(text: str, pos: int) -> int:
    found = _CUT.search(text, pos - 1, pos + CUT_SEARCH_CHARS)
    return found.start() + 1 if found else pos


def encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`: the same ids, with less work holding the GIL.

    transformers' encode calls the Rust `encode_batch` (which releases the GIL), then builds,
    holding it, Python lists of the ids, the attention mask and more: for a 4 MB text (680 000
    tokens) each list is one 10-30 ms stretch during which no other thread, the event loop
    included, runs. Here `encode_batch_fast` (no offsets) and only the ids are converted. The
    Rust call is the one transformers makes, so the ids are the same, as long as transformers
    would not change the backend's settings first (truncation, padding, special-token
    splitting) and the tokenizer class does not override how it encodes; otherwise, or
    without a Rust backend, this is `tokenizer.encode` itself.
    """
    backend = _plain_backend(tokenizer)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _plain_backend(tokenizer: PreTrainedTokenizerBase):
    """The Rust tokenizer when calling it directly gives what `tokenizer.encode` would, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _TokenizersBackend is None or not isinstance(tokenizer, _TokenizersBackend) or not hasattr(backend, "encode_batch_fast"):
        return None
    cls = type(tokenizer)
    if cls.encode is not PreTrainedTokenizerBase.encode or cls._encode_plus is not _TokenizersBackend._encode_plus:
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(tokenizer.split_special_tokens):
        return None
    return backend



def ignored_chars(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """Characters that tokenize to nothing (SmolLM2 drops six control characters it has no byte for).

    Checked for every character below U+3000 and one of each 4096 above: for byte-level BPE
    that covers every lead and continuation byte, so nothing else can vanish.
    """
    chars = [chr(c) for c in (*range(0x3000), *range(0x3000, 0x110000, 0x1000)) if not 0xD800 <= c < 0xE000]
    ids = tokenizer(chars, add_special_tokens=False)["input_ids"]
    return frozenset(c for c, i in zip(chars, ids) if not i)
