"""Draft tokens for speculative decoding: prompt lookup (n-gram matching), and when to skip it.

The proposer looks for the request's last n tokens earlier in its own text (prompt and
output) and proposes what followed them there::

    tokens   ... a b c d e f ... x a b c
                 ^^^^^ earlier      ^^^^^ suffix, n = 3
    drafts   d e f                  (the k tokens after the match)

The largest n in [prompt_lookup_min, prompt_lookup_max] that occurs wins; among its
occurrences the most recent one, whose continuation is the freshest context. The
search runs on the bytes of an `array` (C speed, no Python loop over tokens).

A request whose drafts keep being rejected stops drafting for a while (`DraftBackoff`):
a verified draft costs a wider step, and text that prompt lookup cannot predict (most
of all random text) should cost next to nothing.
"""

from __future__ import annotations

from array import array

from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.request import Request

_ITEM = array("I").itemsize
# Steps a request skips drafting after consecutive fully rejected drafts: 2, 4, ... up to this.
MAX_DRAFT_PAUSE = 16


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the latest earlier match of the longest suffix."""
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens < self.config.prompt_lookup_min + 1:
            return []
        text = array("I", token_ids).tobytes()
        for n in range(min(self.config.prompt_lookup_max, num_tokens - 1), self.config.prompt_lookup_min - 1, -1):
            start = _rfind_aligned(text, text[(num_tokens - n) * _ITEM :], (num_tokens - 1) * _ITEM)
            if start is not None:
                follow = start + n
                return list(token_ids[follow : follow + max_drafts])
        return []


def _rfind_aligned(text: bytes, pattern: bytes, end: int) -> int | None:
    """The token index of the last occurrence of `pattern` in `text[:end]` on a token boundary."""
    while end > 0:
        offset = text.rfind(pattern, 0, end)
        if offset < 0:
            return None
        if offset % _ITEM == 0:
            return offset // _ITEM
        end = offset + len(pattern) - 1
    return None


class DraftBackoff:
    """Per request: after k fully rejected drafts in a row, skip drafting for 2**k steps (capped)."""

    @staticmethod
    def may_draft(request: Request) -> bool:
        if request.draft_pause > 0:
            request.draft_pause -= 1
            return False
        return True

    @staticmethod
    def on_verified(request: Request, num_drafts: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_drafts
        request.num_accepted_draft_tokens += num_accepted
        if num_accepted:
            request.draft_misses = 0
        else:
            request.draft_misses += 1
            request.draft_pause = min(2**request.draft_misses, MAX_DRAFT_PAUSE)
