"""Incremental, UTF-8-safe detokenization and stop-string matching for one output stream.

Text is produced by decoding a short window of ids and diffing it against the window
without the newest ids (the prefix/read offsets of TGI and vLLM):

    ids:   ... p p p p p | o o o o | n
                 prefix_offset    read_offset
    delta = decode(ids[prefix:]) - decode(ids[prefix:read])

A window that ends inside a multi-byte character decodes to U+FFFD: the delta is held back
until the character completes, so every delta is valid UTF-8 and the deltas join to the
full decode.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context (leading-space handling)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > 64:  # keep the window short
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds stop strings across token boundaries and holds back text that may start one.

    `feed(delta)` returns (text safe to send, matched stop or None). Text that could be the
    beginning of a stop string stays pending until it is ruled out; `flush()` releases it
    when the stream ends for another reason.
    """

    def __init__(self, stops: list[str], include_stop: bool):
        self._stops = stops
        self._include = include_stop
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        if not self._stops:
            return delta, None
        self._pending += delta
        match = self._earliest_match()
        if match is not None:
            index, stop = match
            end = index + len(stop) if self._include else index
            text, self._pending = self._pending[:end], ""
            return text, stop
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, None

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _earliest_match(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._pending.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_stop_prefix_suffix(self) -> int:
        pending = self._pending
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
