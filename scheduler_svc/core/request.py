"""One sequence the scheduler owns: its tokens, its progress and its lifecycle.

Accounting, the same on both sides of the step protocol (see `pagoda.step`)::

    all_token_ids        prompt_token_ids + output_token_ids
    num_computed_tokens  tokens whose KV is in the cache (0 while waiting)
    num_output_placeholders
                         tokens that steps in flight will sample (async scheduling:
                         a step is planned before the previous one's result is back)
    num_tokens + num_output_placeholders - num_computed_tokens
                         tokens still to compute; 1 for a decode, more during a prefill

`num_computed_tokens` counts what has been *scheduled*: it advances when a step is
planned, so the next step can be planned while this one runs. A step that brings it up
to `num_tokens + num_output_placeholders` will sample a token: the placeholder count
grows by one until that step's result is applied. Hence a running request always has at
least one token to compute. A step that also verifies k draft tokens (speculative
decoding) counts them as computed and reserves k + 1 placeholders; its result rolls the
computed count back by the drafts the model rejected.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda.step import ImageInput, SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended; the values are the protobuf enum's (`pagoda.v1.FinishReason`)."""

    EOS = 1
    STOP_SEQUENCE = 2
    STOP_TOKEN = 3
    LENGTH = 4
    ABORTED = 5


class RequestStatus(enum.Enum):
    """Where a request is. PREEMPTED is a waiting request that has run before."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    """A sequence to generate.

    Invariants kept by the scheduler:
      * WAITING / PREEMPTED: `num_computed_tokens == 0` and no KV block is held;
      * RUNNING: `0 <= num_computed_tokens < num_tokens + num_output_placeholders`;
      * `output_token_ids` only grows, through `append_output_token`.

    `num_cached_tokens` is the prefix-cache hit measured the first time the request
    was scheduled (kept across preemption and across executors); for an `n > 1`
    sibling that forked from its leader it is the leader's figure.

    A beam of beam search (`is_beam`) lives for one token: the scheduler appends the
    executor's sampled token but applies no stop rule, then holds the beam (never
    scheduled again) until its controller forks it (`Scheduler.fork_beams`) or
    finishes it.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    was_scheduled: bool = False
    is_beam: bool = False
    cache_salt: str = ""  # tenant + GenerateRequest.cache_salt: prefix-cache hits only among equal salts
    tenant: str = ""  # who sent it (the API key's tenant, "" when keys are off): fair shares of running slots
    lora: str = ""  # the LoRA adapter it runs with (its name as executors know it), "" for the base model
    # a vision-language prompt's images (pagoda.step.ImageInput, in prompt order): every NewRequest
    # for it carries them (first scheduling, after preemption, on another executor)
    images: tuple[ImageInput, ...] = ()
    # speculative decoding: drafts verified, of them accepted; the backoff of `spec_decode`
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    draft_misses: int = 0
    draft_pause: int = 0
    _all_token_ids: list[int] = field(init=False, repr=False)
    _stop_token_ids: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.req_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        self._stop_token_ids = frozenset(self.sampling.stop_token_ids)

    @property
    def prefix_salt(self) -> str:
        """What its prefix-cache hashes start from: the salt, and the adapter (base and adapters never share KV).

        The service's salts are "" or start with a digit (`scheduler_svc.auth.prefix_cache_salt`), so no
        request of the base model can spell an adapter's, and the adapter's name is length-prefixed."""
        return f"lora:{len(self.lora)}:{self.lora}|{self.cache_salt}" if self.lora else self.cache_salt

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only view: do not mutate."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_token_ids

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_waiting(self) -> bool:
        return self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
