"""What the scheduler reports: per-request updates after a step, and its load figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagoda.step import SampledToken
from scheduler_svc.core.request import FinishReason


class RequestUpdate(NamedTuple):
    """One request's news from a step: the token it got, and why it ended if it did."""

    req_id: str
    sampled: SampledToken | None
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of one executor's scheduler.

    `num_free_blocks` counts ref-count-0 blocks, cached-but-evictable ones included, so
    it equals `num_total_blocks` (null block excluded) when idle. `kv_slots_allocated`
    is in-use blocks * block_size; `kv_tokens_held` the computed tokens in them, a
    shared block counted once.
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_slots_allocated: int
    kv_tokens_held: int

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated slots holding no computed token (0 when nothing is held)."""
        if self.kv_slots_allocated == 0:
            return 0.0
        return 1.0 - self.kv_tokens_held / self.kv_slots_allocated


@dataclass
class SpecDecodeStats:
    """Speculative decoding since the last `Scheduler.take_spec_decode_stats()` (vLLM's counters).

    `num_accepted_tokens_per_pos[i]`: drafts whose i-th token was accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1
