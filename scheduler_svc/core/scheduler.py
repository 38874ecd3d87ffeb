"""The scheduler of one executor: a token budget over running, then waiting, requests.

One step is `schedule()` -> executor runs the `StepPlan` -> `update_from_output()`.
Steps may be planned ahead (async scheduling): `schedule()` can be called again while
earlier plans are in flight, and their results are applied in order. A step advances
`num_computed_tokens` when it is planned; a token it will sample is a placeholder
(`Request.num_output_placeholders`) until its result arrives, so the next step can
already feed it. A request that finishes with a token has the extra position planned
after it discarded (the executor drops it with the next plan).

Every request is (tokens, `num_computed_tokens`); a step grants it `num_scheduled_tokens`
tokens, so chunked prefill, decode, prefix hits, forks and resumption after preemption
are one rule::

    budget = max_num_batched_tokens
    1. running, by (priority, arrival):  grant min(num_tokens - num_computed, budget);
       no block for it -> preempt the running request with the largest
       (priority, arrival) -- maybe itself -- and retry
    2. waiting, by (priority, arrival), unless step 1 preempted: prefix hit, then
       min(num_tokens - hit, budget) tokens, while blocks and max_num_seqs allow;
       the first one that does not fit stops admission (no overtaking); an n > 1
       follower forks from its leader once the leader's prompt is computed
    3. nothing scheduled, yet a request waits while beams are held: preempt the
       latest held beam (one per step), so held beams never block admission

Fair shares between tenants (`Request.tenant`). While two tenants or more have work here
(running, waiting here, or waiting for an executor in the engine's queue: `set_waiting_elsewhere`),
a tenant's share of the running slots is `max_running_per_tenant`, or max_num_seqs // those
tenants. A tenant below its share that waits is *needy*; while one is:

    0. before step 1, if the free slots (max_num_seqs - running) or free blocks cannot take
       one request of each needy tenant, preempt the newest running request of the tenant
       furthest over its share, until they can or no tenant is over its share; and when
       step 1 must preempt for blocks, its victim is the newest unscheduled request of the
       tenant running the most;
    2'. a tenant at or over its share is not admitted (the others are: no stop);
    budget: a prefill chunk of a tenant gets at most budget // tenants tokens of the step
       (summed over its requests; decodes are never cut).

A preempted request keeps every token (it resumes, possibly elsewhere, like any preemption).
So a bystander's request waits at most one step for a slot however many another tenant runs.

Speculative decoding (`SchedulerConfig.speculative`): a running request at its end
(one token to compute, no token in flight) also gets up to k draft tokens from prompt
lookup (`spec_decode.NgramProposer`), within the budget, its length limits and free
blocks (drafts never preempt anyone). The step computes 1 + k positions and returns
1..k+1 tokens; the computed count then rolls back by the rejected drafts, whose blocks
stay in the table for the next step to overwrite. Blocks are cached only up to the
accepted tokens. Beams never draft.

Beams of beam search (`Request.is_beam`) are held after their token, neither
scheduled nor admitted, until `fork_beams` replaces them by their children (or they
are finished). Forked children start RUNNING on the parent's blocks; each is sent to
the executor as a new request in the next plan, with the block copies.

Images (`Request.images`): the executor encodes an image when a step first schedules one of its
placeholder tokens and keeps its rows until the request has computed them all. A step encodes at
most `SchedulerConfig.encoder_budget` placeholder tokens' worth of images (vLLM's encoder compute
budget): an image no request holds on the executor yet (none is part way through it, none earlier
in this step schedules it) costs its length; one that does not fit ends the request's chunk
before it (nothing, when the chunk starts inside it: a prefix hit part way), so it waits for a
later step. An image larger than the whole budget is encoded in a step that encodes nothing else.

Request states::

    add_requests -> WAITING --admit/fork--> RUNNING --stop/abort--> FINISHED
                       ^                        |
                       +------- PREEMPTED <-----+  (blocks freed, num_computed = 0)

The executor holds state for exactly the RUNNING requests: those leaving RUNNING are
listed in the plan's `finished_req_ids` (a preemption in its own step, a finish in
the next one).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagoda.step import BlockCopy, CachedRequestData, NewRequestData, SampledToken, StepPlan, StepResult
from scheduler_svc.core.config import SchedulerConfig, cdiv, fit_error
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.kv_events import KVCacheEvent
from scheduler_svc.core.outputs import RequestUpdate, SchedulerStats, SpecDecodeStats
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.sibling_groups import SiblingGroups
from scheduler_svc.core.spec_decode import DraftBackoff, NgramProposer

__all__ = ["RequestUpdate", "Scheduler", "SchedulerConfig", "SchedulerStats"]

_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True)
class _InFlight:
    """A planned step whose result is not applied yet: who was in it, and who will get a token."""

    plan: StepPlan
    requests: dict[str, Request]  # the scheduled requests as they were planned
    expects_token: set[str]  # never changed once made

    def num_placeholders(self, req_id: str) -> int:
        """Tokens the step may sample for `req_id`: 1, or 1 + its drafts."""
        if req_id not in self.expects_token:
            return 0
        return 1 + len(self.plan.scheduled_spec_decode_tokens.get(req_id, ()))


class _AdapterCap:
    """Which waiting requests a step may start under `max_loras`, without starving an adapter.

    The adapters the waiting requests need that are not running are taken in line, tenants in
    turns (the one using the fewest running adapters first, then the queue's order; tenants
    held back by "Fair shares" left out). The first of them that the free adapter slots hold start this step; when one
    more is in line (`next_in`), no new request of a running adapter starts: the running
    adapters drain, and the next one to finish makes room for it, however busy the others are
    and whichever tenant keeps them busy. The base model's requests always start.
    """

    def __init__(self, max_loras: int, running: set[str], in_line: list[str]) -> None:
        free = max(max_loras - len(running), 0)
        self.running = running
        self.starting = set(in_line[:free])
        self.next_in: str | None = in_line[free] if len(in_line) > free else None

    def admits(self, lora: str) -> bool:
        if not lora or lora in self.starting:
            return True
        return lora in self.running and self.next_in is None


@dataclass
class _Fairness:
    """One step's fair shares (see "Fair shares" above); None from `_fairness` with one tenant."""

    share: int  # running slots a tenant may hold while another is needy
    token_cap: int  # prefill tokens a tenant may get in one step
    running_of: Counter  # tenant -> its running requests (kept current through the step)
    needy: dict[str, int]  # tenant below its share that waits -> slots it needs now (1 each)
    tokens_of: Counter  # tenant -> prefill tokens granted in this step

    def holds_back(self, tenant: str) -> bool:
        """Whether `tenant` may not start another request now: at its share while another tenant is needy."""
        return self.running_of[tenant] >= self.share and any(t != tenant for t in self.needy)

    def tokens_left(self, tenant: str) -> int:
        return self.token_cap - self.tokens_of[tenant]


class Scheduler:
    """Admission, token budget, preemption, n-sample and beam forks for one executor.

    Not thread-safe: one thread (the service's loop) makes every call. Between steps,
    `check_integrity()` holds; `num_preemptions` counts preemptions since construction.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._max_seq_len = config.max_seq_len
        self.kv_cache_manager = KVCacheManager(
            config.block_size,
            config.num_blocks,
            config.enable_prefix_caching,
            config.enable_kv_cache_events,
            kv_cache_groups=config.kv_cache_groups,
        )
        # The blocks of a request's next steps: through `_allocate` when sliding windows are freed
        self._allocate_slots = (
            self._allocate if self.kv_cache_manager.frees_outside_windows else self.kv_cache_manager.allocate_slots
        )
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}
        self._order: dict[str, tuple[int, float, int]] = {}
        self._waiting: list[Request] = []  # sorted by _key
        self._running: list[Request] = []  # sorted by _key
        self._siblings = SiblingGroups()
        self._finished_req_ids: list[str] = []
        self._held: set[str] = set()  # beams that sampled their token, awaiting fork_beams
        self._unsent: set[str] = set()  # running forked beams the executor does not hold yet
        self._block_copies: list[BlockCopy] = []  # for the next plan
        self._next_seq = 0
        self._next_step_id = 0
        self._in_flight: deque[_InFlight] = deque()  # oldest first
        self._proposer = NgramProposer(config.speculative) if config.speculative else None
        self._spec_stats = SpecDecodeStats()
        self._waiting_elsewhere: dict[str, Request] = {}  # tenant -> its next request in the engine's queue
        self._fair: _Fairness | None = None  # during schedule()
        # during schedule(): encoder budget left, and the hashes of the images the executor holds
        # in this step (None until an image asks; see "Images")
        self._encoder_budget = 0
        self._encoder_held: set[str] | None = None

    # ---- front end ------------------------------------------------------------------------

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence may ever reach `num_tokens` tokens (prompt + output) here.

        A prompt is servable when `can_fit(len(prompt) + 1)`; anything else would wait forever.
        """
        return 0 < num_tokens <= self._max_seq_len

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    def num_prefix_cached_tokens(self, request: Request) -> int:
        """Tokens of `request` this executor's prefix cache holds now (routing)."""
        return self.kv_cache_manager.num_prefix_cached_tokens(request.all_token_ids, request.prefix_salt, request.images)

    def can_admit(self, requests: Sequence[Request], num_cached_tokens: int = 0) -> bool:
        """Whether the next `schedule()` would likely start `requests` (one group; late binding).

        There must be room under `max_num_seqs` and free blocks for the first chunk of
        the first request (`num_cached_tokens` of it are a prefix hit), beyond what the
        requests already waiting here need. An estimate: a request bound here that does
        not start goes back to the engine with `take_movable()`.
        """
        waiting = [r for r in self._waiting if r.req_id not in self._held]
        if not requests or len(self._running) + len(waiting) >= self.config.max_num_seqs:
            return False
        if self.holds_back(requests[0].tenant):
            return False
        need = sum(self._first_chunk_blocks(r, 0) for r in waiting if self._siblings.leader_of(r.req_id) is None)
        need += self._first_chunk_blocks(requests[0], num_cached_tokens)
        return need <= self.kv_cache_manager.block_pool.num_free_blocks

    def set_waiting_elsewhere(self, heads: dict[str, Request]) -> None:
        """The tenants with requests waiting for an executor (the engine's queue), each with its next one.

        They count among the tenants with work for fair shares, and a step preempts over-share
        tenants to make them room (see "Fair shares").
        """
        self._waiting_elsewhere = heads

    def holds_back(self, tenant: str) -> bool:
        """Whether a new request of `tenant` must wait: it holds its share while another tenant is needy."""
        fair = self._fairness()
        if fair is None:
            return False
        for request in self._waiting:  # bound here, not started: they take its slots first
            if request.tenant == tenant and request.req_id not in self._held:
                fair.running_of[tenant] += 1
        return fair.holds_back(tenant)

    def _fairness(self) -> _Fairness | None:
        """This step's fair shares; None while fewer than two tenants have work here."""
        running_of = Counter(r.tenant for r in self._running)
        waiting_of = Counter(r.tenant for r in self._waiting if r.req_id not in self._held and not r.num_output_placeholders)
        tenants = running_of.keys() | waiting_of.keys() | self._waiting_elsewhere.keys()
        if len(tenants) < 2:
            return None
        share = self.config.max_running_per_tenant or max(1, self.config.max_num_seqs // len(tenants))
        needy = {
            t: 1 for t in (waiting_of.keys() | self._waiting_elsewhere.keys()) if running_of[t] < share
        }
        token_cap = max(1, self.config.max_num_batched_tokens // len(tenants))
        return _Fairness(share, token_cap, running_of, needy, Counter())

    def _make_room(self, fair: _Fairness, plan: StepPlan) -> None:
        """Step 0 of "Fair shares": preempt over-share tenants' newest requests until every needy tenant fits."""
        if not fair.needy:
            return
        need_blocks = 0
        for tenant in fair.needy:
            head = self._waiting_elsewhere.get(tenant) or next(r for r in self._waiting if r.tenant == tenant)
            need_blocks += self._first_chunk_blocks(head, 0)
        pool = self.kv_cache_manager.block_pool
        while (
            self.config.max_num_seqs - len(self._running) < len(fair.needy) or pool.num_free_blocks < need_blocks
        ):
            over = [t for t, n in fair.running_of.items() if n > fair.share]
            if not over:
                return
            heaviest = max(over, key=lambda t: fair.running_of[t])
            victim = next(r for r in reversed(self._running) if r.tenant == heaviest)
            self._preempt(victim, plan)
            fair.running_of[heaviest] -= 1

    def _first_chunk_blocks(self, request: Request, num_cached_tokens: int) -> int:
        """Blocks of the first chunk after a hit of `num_cached_tokens`, in every KV cache group."""
        num_tokens = min(request.num_tokens, num_cached_tokens + self.config.max_num_batched_tokens)
        num_blocks = cdiv(num_tokens, self.config.block_size) - num_cached_tokens // self.config.block_size
        return num_blocks * self.kv_cache_manager.num_groups

    def take_movable(self) -> list[Request]:
        """Remove and return the waiting requests free to resume on any executor.

        Those are the preempted (or never started) requests with no token in flight that
        are neither beams (a beam search's beams stay on one executor) nor waiting
        followers or leaders of `n` siblings. They hold no block; the engine queues them
        again, so they may resume wherever there is room first.
        """
        movable = [
            r
            for r in self._waiting
            if not r.is_beam
            and r.num_output_placeholders == 0
            and self._siblings.leader_of(r.req_id) is None
            and not self._siblings.followers_of(r.req_id)
        ]
        for request in movable:
            self._waiting.remove(request)
            self.kv_cache_manager.remove(request)
            del self._requests[request.req_id]
            del self._order[request.req_id]
        return movable

    def add_requests(self, requests: Sequence[Request]) -> None:
        """Queue one request, or the `n` sibling samples of one (same prompt, distinct ids).

        Siblings without output tokens share the prompt's KV: the first prefills, the
        others fork from it. A request that already has output tokens (moved here
        from a dead executor) resumes: it is sent as a new request with every token.
        Raises ValueError, adding nothing, for a request that can never run here.
        """
        self._validate_new(requests)
        for request in requests:
            request.status = RequestStatus.WAITING
            self._requests[request.req_id] = request
            self._order[request.req_id] = (request.priority, request.arrival_time, self._next_seq)
            self._next_seq += 1
            bisect.insort(self._waiting, request, key=self._key)
        if len(requests) > 1 and not any(r.output_token_ids for r in requests[1:]):
            self._siblings.add(requests[0].req_id, [r.req_id for r in requests[1:]])

    def finish_requests(self, req_ids: str | Iterable[str], reason: FinishReason) -> list[Request]:
        """Finish requests now (abort, stop string), freeing their blocks; unknown ids are ignored."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        finished = []
        for req_id in req_ids:
            request = self._requests.get(req_id)
            if request is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def defer(self, req_id: str) -> bool:
        """Take a running request out of the executor until it is admitted again (a preemption
        between steps: nothing is lost; the next plan tells the executor to drop it).

        For a request the executor could not sample yet (its grammar still compiling, GRAMMAR_PENDING).
        False, changing nothing, unless it is running.
        """
        request = self._requests.get(req_id)
        if request is None or request.status is not _RUNNING or req_id in self._held:
            return False
        self.kv_cache_manager.free(request)
        self._running.remove(request)
        self._siblings.discard(req_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        bisect.insort(self._waiting, request, key=self._key)
        if req_id in self._unsent:
            self._unsent.discard(req_id)
        else:
            self._finished_req_ids.append(req_id)
        return True

    def drain(self) -> list[Request]:
        """Remove every unfinished request, reset to resume elsewhere (no blocks, 0 computed).

        For an executor that died: its plan in flight is forgotten, nothing stays in use.
        """
        requests = sorted(self._requests.values(), key=self._key)
        for request in requests:
            self.kv_cache_manager.remove(request)
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.status = RequestStatus.WAITING
        self._requests.clear()
        self._order.clear()
        self._waiting.clear()
        self._running.clear()
        self._siblings.clear()
        self._finished_req_ids.clear()
        self._held.clear()
        self._unsent.clear()
        self._block_copies.clear()
        self._in_flight.clear()
        return requests

    def fork_beams(self, parent_id: str, children: Sequence[Request]) -> None:
        """Replace the held beam `parent_id` by `children`, then finish it.

        Each child is the parent's sequence with its last token (the executor's own
        pick) replaced by the one beam search chose. Children of a RUNNING parent run
        on at once from its KV (`KVCacheManager.fork_beams`: full blocks shared, the
        partial block copied); those beyond `max_num_seqs` or the free blocks, and every
        child of a preempted parent, wait to be admitted like any request.
        """
        parent = self._requests.get(parent_id)
        if parent is None or parent_id not in self._held:
            raise ValueError(f"request {parent_id!r} is not a held beam")
        self._validate_children(parent, children)
        num_sharing = 0
        if parent.status is _RUNNING:
            num_sharing = min(len(children), self.config.max_num_seqs - len(self._running) + 1)
            while num_sharing > 0:
                block_copies = self.kv_cache_manager.fork_beams(parent, children[:num_sharing])
                if block_copies is not None:
                    self._block_copies.extend(block_copies)
                    break
                num_sharing -= 1
        for index, child in enumerate(children):
            self._requests[child.req_id] = child
            self._order[child.req_id] = (child.priority, child.arrival_time, self._next_seq)
            self._next_seq += 1
            if index < num_sharing:
                child.num_computed_tokens = parent.num_computed_tokens
                child.num_cached_tokens, child.was_scheduled = parent.num_cached_tokens, True
                child.status = _RUNNING
                bisect.insort(self._running, child, key=self._key)
                self._unsent.add(child.req_id)
            else:
                child.status = RequestStatus.WAITING
                bisect.insort(self._waiting, child, key=self._key)
        self._finish(parent, FinishReason.LENGTH)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def requested_top_logprobs(self, step_id: int, req_id: str) -> int | None:
        """How many top logprobs a token of `req_id` in step `step_id`'s result may carry (None: it gets no token)."""
        for in_flight in self._in_flight:
            if in_flight.plan.step_id == step_id:
                return in_flight.requests[req_id].sampling.top_logprobs if req_id in in_flight.expects_token else None
        return None

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def pending_finished_req_ids(self) -> tuple[str, ...]:
        """Ids the executor still holds that the next plan tells it to drop."""
        return tuple(self._finished_req_ids)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's events since the last call ([] unless `enable_kv_cache_events`)."""
        return self.kv_cache_manager.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache if no request is here (True), else change nothing (False)."""
        if self._requests or self._in_flight:
            return False
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    def take_spec_decode_stats(self) -> SpecDecodeStats:
        """The speculative decoding counts since the last call (for metrics)."""
        stats, self._spec_stats = self._spec_stats, SpecDecodeStats()
        return stats

    def stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        slots, tokens = self.kv_cache_manager.kv_usage(self._running)
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preemptions=self.num_preemptions,
            num_total_blocks=pool.num_total_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            kv_slots_allocated=slots,
            kv_tokens_held=tokens,
        )

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step; the tokens of steps still in flight are placeholders."""
        plan = StepPlan(step_id=self._next_step_id, finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        self._next_step_id += 1
        plan.block_copies, self._block_copies = self._block_copies, []
        num_preemptions = self.num_preemptions
        self._fair = fair = self._fairness()
        if fair is not None:
            self._make_room(fair, plan)
        self._encoder_budget, self._encoder_held = self.config.encoder_budget, None
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if self.num_preemptions == num_preemptions:
            self._schedule_waiting(plan, budget)
        self._fair = None
        if not plan.num_scheduled_tokens:
            self._release_held(plan)
        if self._unsent:
            self._send_forked(plan)
        if plan.num_scheduled_tokens:
            self._in_flight.append(self._advance(plan))
        return plan

    def _advance(self, plan: StepPlan) -> _InFlight:
        """Count the planned tokens as computed; those that reach the end will sample a token."""
        requests: dict[str, Request] = {}
        expects_token: set[str] = set()
        known, spec = self._requests, plan.scheduled_spec_decode_tokens
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            request = requests[req_id] = known[req_id]
            num_drafts = len(spec[req_id]) if spec and req_id in spec else 0
            num_computed = request.num_computed_tokens = request.num_computed_tokens + num_scheduled
            # (_all_token_ids: Request.num_tokens without the property call, in this hot loop)
            if num_computed == len(request._all_token_ids) + request.num_output_placeholders + num_drafts:
                request.num_output_placeholders += 1 + num_drafts
                expects_token.add(req_id)
        return _InFlight(plan, requests, expects_token)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Apply the result of the oldest step in flight: append tokens, finish what stops.

        Requests finished (e.g. aborted) while the step ran are skipped; a request
        preempted since keeps its token. A request in `result.errors` (failed alone on the
        executor) gets no token and no update: its owner ends it.
        """
        self._check_result(plan, result)
        if not plan.num_scheduled_tokens:
            return []
        in_flight = self._in_flight.popleft()
        if not in_flight.plan.scheduled_spec_decode_tokens:
            return self._apply_without_drafts(in_flight, result)
        sampled: dict[str, list[SampledToken]] = {}
        for token in result.sampled:
            sampled.setdefault(token.req_id, []).append(token)
        updates = []
        for req_id, planned in in_flight.requests.items():
            request = self._requests.get(req_id)
            if request is not planned:
                continue
            request.num_output_placeholders -= in_flight.num_placeholders(req_id)
            drafts = in_flight.plan.scheduled_spec_decode_tokens.get(req_id)
            if drafts and req_id in sampled:  # (a request that failed alone has no token)
                self._roll_back_rejected(request, len(drafts), len(sampled[req_id]) - 1)
            if request.status is _RUNNING:
                self.kv_cache_manager.cache_full_blocks(request)
            for token in sampled.get(req_id, ()):
                updates.append(self._append_sampled(request, token))
                if request.is_finished:
                    break
        return updates

    def _apply_without_drafts(self, in_flight: _InFlight, result: StepResult) -> list[RequestUpdate]:
        """`update_from_output` for a step without drafts: at most one token per request (checked)."""
        sampled = {token.req_id: token for token in result.sampled}
        expects, known = in_flight.expects_token, self._requests
        applied, running = [], []
        for req_id, planned in in_flight.requests.items():
            if known.get(req_id) is not planned:
                continue
            if req_id in expects:
                planned.num_output_placeholders -= 1
            applied.append(planned)
            if planned.status is _RUNNING:
                running.append(planned)
        # Every block is cached before any token is appended: the same blocks as caching
        # each request just before its own token (appending to, or finishing, another
        # request neither evicts a cached block nor changes this request's table).
        self.kv_cache_manager.cache_full_blocks_of(running)
        max_seq_len = self._max_seq_len
        updates = []
        for request in applied:
            req_id = request.req_id
            token = sampled.get(req_id)
            if token is None:
                continue
            # _append_sampled, with _stop_reason called only when some stop rule may apply
            token_id = token.token_id
            request.append_output_token(token_id)
            if request.is_beam:
                self._held.add(req_id)
                updates.append(RequestUpdate(req_id, token, None))
                continue
            num_output_tokens = len(request.output_token_ids)
            reason = None
            if (
                num_output_tokens >= request.max_tokens
                or len(request._all_token_ids) >= max_seq_len
                or (
                    token_id in request._stop_token_ids
                    and (num_output_tokens >= request.sampling.min_tokens or request.sampling.constraint is not None)
                )
            ):
                reason = self._stop_reason(request)
                if reason is not None:
                    self._finish(request, reason)
            updates.append(RequestUpdate(req_id, token, reason))
        return updates

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Uncount the rejected drafts' positions; their blocks stay, to be written again."""
        if request.status is _RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted
        self._spec_stats.observe(num_drafts, num_accepted)
        DraftBackoff.on_verified(request, num_drafts, num_accepted)

    def check_integrity(self) -> None:
        """Raise AssertionError unless blocks, queues and requests agree (tests, idle checks)."""
        self.kv_cache_manager.check_integrity(self._running)
        if {r.req_id for r in self._running} | {r.req_id for r in self._waiting} != set(self._requests):
            raise AssertionError("running + waiting != known requests")
        if self.kv_cache_manager.req_ids() != {r.req_id for r in self._running}:
            raise AssertionError("the requests holding blocks are not exactly the running ones")
        for request in self._waiting:
            if request.num_computed_tokens != 0 or not request.is_waiting:
                raise AssertionError(f"waiting request {request.req_id!r} is not reset")
        for request in self._running:
            if request.status is not _RUNNING or not 0 <= request.num_computed_tokens < request.num_tokens + request.num_output_placeholders:
                raise AssertionError(f"running request {request.req_id!r} has a bad state")
        for request in self._requests.values():
            pending = sum(f.num_placeholders(request.req_id) for f in self._in_flight if f.requests.get(request.req_id) is request)
            if request.num_output_placeholders != pending:
                raise AssertionError(f"request {request.req_id!r}: {request.num_output_placeholders} placeholders, {pending} tokens in flight")
        if not self._held <= set(self._requests) or not self._unsent <= {r.req_id for r in self._running}:
            raise AssertionError("a held beam is unknown, or an unsent beam is not running")

    # ---- scheduling -----------------------------------------------------------------------

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        # One pass over every running request each step: what does not change within the
        # pass is looked up once, and the sets that are usually empty are not probed.
        # A request with tokens in flight only awaits a result when it is a beam (it lives
        # for one token), when its pending tokens reach a length limit (planning on would be
        # waste), or when it has drafts in flight (its length is not known yet).
        held, unsent, proposer, max_seq_len = self._held, self._unsent, self._proposer, self._max_seq_len
        fair = self._fair
        whole_images, full_budget = self.config.whole_image_chunks, self.config.max_num_batched_tokens
        drafts_in_flight = [f.plan.scheduled_spec_decode_tokens for f in self._in_flight if f.plan.scheduled_spec_decode_tokens]
        allocate_slots = self._allocate_slots
        cached_requests, num_scheduled_tokens = plan.cached_requests, plan.num_scheduled_tokens
        drafts: list[int] = []
        # with fair shares, the tenants running fewest go first (stable: key order within a tenant count),
        # so blocks run short for the heaviest tenant, whose newest request is then the victim
        running = list(self._running) if fair is None else sorted(self._running, key=lambda r: fair.running_of[r.tenant])
        for request in running:
            if budget == 0:
                break
            req_id = request.req_id
            if request.status is not _RUNNING or (held and req_id in held):  # preempted in this loop, or held
                continue
            pending = request.num_output_placeholders
            if pending and (  # nothing to plan until a token in flight is back (see below)
                request.is_beam
                or len(request.output_token_ids) + pending >= request.max_tokens
                or len(request._all_token_ids) + pending >= max_seq_len
                or (drafts_in_flight and any(req_id in drafts for drafts in drafts_in_flight))
            ):
                continue
            if proposer is not None:
                drafts, new_block_ids = self._draft(request, budget)
            if drafts:
                num_new = 1 + len(drafts)
            else:
                # (Request.num_tokens_to_compute, without the property calls)
                num_new = len(request._all_token_ids) + pending - request.num_computed_tokens
                if num_new > budget:
                    num_new = budget
                if fair is not None and num_new > 1:  # a prefill chunk: within its tenant's tokens
                    num_new = min(num_new, fair.tokens_left(request.tenant))
                    if num_new <= 0:
                        continue
                encoded = None
                if request.images:
                    if whole_images:
                        num_new = self._image_cut(request, request.num_computed_tokens, num_new, budget == full_budget)
                    if num_new:
                        num_new, encoded = self._encoder_cut(request, request.num_computed_tokens, num_new)
                    if num_new == 0:
                        continue
                if fair is not None and num_new > 1:
                    fair.tokens_of[request.tenant] += num_new
                new_block_ids = allocate_slots(request, num_new)
                if new_block_ids is None:
                    new_block_ids = self._preempt_for(request, num_new, plan)
                    if new_block_ids is None:
                        continue
                if encoded is not None:
                    self._encoder_commit(*encoded)
            if not unsent or req_id not in unsent:  # a forked beam is sent in full by _send_forked
                cached_requests.append(CachedRequestData(req_id, new_block_ids))
            num_scheduled_tokens[req_id] = num_new
            if drafts:
                plan.scheduled_spec_decode_tokens[req_id] = drafts
            budget = max(budget - num_new, 0)  # (a whole image may overrun an empty step's budget)
        return budget

    @staticmethod
    def _image_cut(request: Request, start: int, num_new: int, may_overrun: bool) -> int:
        """`num_new` tokens from `start`, cut so the chunk does not end inside an image's placeholder
        span (`SchedulerConfig.whole_image_chunks`): before the image, or, when the chunk would start
        at (or inside) it, the rest of the image if `may_overrun` (nothing else in the step yet), else 0."""
        end = start + num_new
        for image in request.images:
            if image.offset < end < image.offset + image.length:
                if image.offset > start:
                    return image.offset - start
                return image.offset + image.length - start if may_overrun else 0
        return num_new

    def _encoder_cut(self, request: Request, start: int, num_new: int) -> tuple[int, tuple[int, list[str]]]:
        """`num_new` tokens from `start`, cut before the first image the step's encoder budget cannot
        take (see "Images"), and (the budget its new images cost, the hashes of the images it
        schedules) for `_encoder_commit` once the chunk has its blocks."""
        end, cost, hashes, full = start + num_new, 0, [], self.config.encoder_budget
        for image in request.images:
            if image.offset >= end:
                break
            if image.offset + image.length <= start:
                continue
            if image.hash in hashes or image.hash in self._held_images():
                hashes.append(image.hash)
                continue
            left = self._encoder_budget - cost
            if image.length > left and not (cost == 0 and self._encoder_budget == full):
                return max(image.offset - start, 0), (cost, hashes)
            cost += image.length
            hashes.append(image.hash)
        return num_new, (cost, hashes)

    def _held_images(self) -> set[str]:
        """The hashes of the images the executor holds for this step so far: those of the running
        requests part way through an image, and (`_encoder_commit`) of the chunks scheduled."""
        if self._encoder_held is None:
            self._encoder_held = {
                image.hash
                for request in self._running
                if request.images and request.status is _RUNNING
                for image in request.images
                if image.offset < request.num_computed_tokens < image.offset + image.length
            }
        return self._encoder_held

    def _encoder_commit(self, cost: int, hashes: list[str]) -> None:
        self._encoder_budget = max(self._encoder_budget - cost, 0)  # (an image over the whole budget)
        self._held_images().update(hashes)

    def _draft(self, request: Request, budget: int) -> tuple[list[int], tuple[list[int], ...] | None]:
        """Draft tokens for a request at its end, and the new blocks they need; ([], None) if none.

        At most k, one step's budget less its last token, and what its length limits
        leave after the token the model adds; drafts that find no free block are dropped.
        """
        if (
            self._proposer is None
            or request.is_beam
            or request.num_output_placeholders
            or request.num_tokens_to_compute != 1
            or not DraftBackoff.may_draft(request)
        ):
            return [], None
        max_drafts = min(
            self._proposer.config.num_speculative_tokens,
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self._max_seq_len - request.num_tokens - 1,
        )
        drafts = self._proposer.propose(request.all_token_ids, max_drafts)
        if not drafts:
            return [], None
        new_block_ids = self._allocate_slots(request, 1 + len(drafts))
        return (drafts, new_block_ids) if new_block_ids is not None else ([], None)

    def _preempt_for(self, request: Request, num_new: int, plan: StepPlan) -> tuple[list[int], ...] | None:
        """Blocks for `num_new` more tokens, which the pool lacks now: preempt from the back
        of `running` until they fit.

        `running` is visited in key order, so the victim (the largest key) has not been
        scheduled in this step yet, or it is `request` itself (then None).
        """
        while True:
            victim = None
            if self._fair is not None:  # (not one scheduled in this step already: request itself at worst)
                victim = self._fair_victim(request, plan) or next(
                    r for r in reversed(self._running) if r is request or r.req_id not in plan.num_scheduled_tokens
                )
            if victim is None:
                victim = self._running[-1]
            self._preempt(victim, plan)
            if self._fair is not None:
                self._fair.running_of[victim.tenant] -= 1
            if victim is request:
                return None
            new_block_ids = self._allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids

    def _fair_victim(self, request: Request, plan: StepPlan) -> Request | None:
        """With fair shares: the newest request, not yet scheduled in this step, of the tenant running
        the most (None: none; the usual victim then)."""
        fair = self._fair
        if not fair.running_of:
            return None
        heaviest = max(fair.running_of, key=lambda t: fair.running_of[t])
        scheduled = plan.num_scheduled_tokens
        for candidate in reversed(self._running):
            if candidate.tenant == heaviest and (candidate is request or candidate.req_id not in scheduled):
                return candidate
        return None

    def _allocate(self, request: Request, num_new: int) -> tuple[list[int], ...] | None:
        """`allocate_slots` for a running request where sliding windows are freed: a leader whose
        `n` siblings wait to fork keeps the window of the last prompt token they recompute."""
        next_query_position = None
        if self._siblings.followers_of(request.req_id):
            next_query_position = request.num_prompt_tokens - 1
        return self.kv_cache_manager.allocate_slots(request, num_new, next_query_position=next_query_position)

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        adapters = self._adapter_cap()
        for request in list(self._waiting):
            if budget == 0 or len(self._running) >= self.config.max_num_seqs:
                return
            if request.req_id in self._held or request.num_output_placeholders:  # its token is not back yet
                continue
            fair = self._fair
            limit = budget
            if fair is not None:
                if fair.holds_back(request.tenant):
                    continue
                limit = min(budget, fair.tokens_left(request.tenant))
                if limit <= 0:
                    continue
            if adapters is not None and not adapters.admits(request.lora):
                continue
            leader_id = self._siblings.leader_of(request.req_id)
            if leader_id is None:
                num_scheduled = self._admit(request, plan, limit)
            elif self._ready_to_fork(self._requests[leader_id], request):
                num_scheduled = self._fork(request, self._requests[leader_id], plan)
            else:
                continue
            if num_scheduled == 0:
                if limit < budget:  # its tenant's tokens ran out, not the room
                    continue
                return
            budget = max(budget - num_scheduled, 0)  # (a whole image may overrun it)
            if fair is not None:
                fair.running_of[request.tenant] += 1
                fair.tokens_of[request.tenant] += num_scheduled
                if fair.running_of[request.tenant] >= fair.share:
                    fair.needy.pop(request.tenant, None)

    def _adapter_cap(self) -> _AdapterCap | None:
        """The step's LoRA adapters under `max_loras` (None: no limit, or no request with an adapter waits)."""
        if not self.config.max_loras or not any(r.lora for r in self._waiting):
            return None
        running = {r.lora for r in self._running if r.lora}
        fair = self._fair
        by_tenant: dict[str, list[str]] = {}  # tenant -> the adapters its waiting requests need, in queue order
        for r in self._waiting:
            if (r.lora and r.lora not in running and r.req_id not in self._held and not r.num_output_placeholders
                    and (fair is None or not fair.holds_back(r.tenant))):
                needs = by_tenant.setdefault(r.tenant, [])
                if r.lora not in needs:
                    needs.append(r.lora)
        # Tenants take turns at the adapter slots: the one using the fewest running adapters first
        # (then the queue's order), one adapter each a round.
        using = Counter(tenant for tenant, _ in {(r.tenant, r.lora) for r in self._running if r.lora})
        tenants = sorted(by_tenant, key=lambda t: using[t])  # (stable: the queue's order among equals)
        in_line: dict[str, None] = {}
        for round_ in itertools.zip_longest(*(by_tenant[t] for t in tenants)):
            in_line.update((lora, None) for lora in round_ if lora is not None)
        return _AdapterCap(self.config.max_loras, running, list(in_line))

    def _admit(self, request: Request, plan: StepPlan, budget: int) -> int:
        """Start a waiting request from its prefix hit; the tokens scheduled, 0 if no room."""
        computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, budget)
        encoded = None
        if request.images:
            if self.config.whole_image_chunks:
                num_new = self._image_cut(request, num_hit, num_new, budget == self.config.max_num_batched_tokens)
            if num_new:
                num_new, encoded = self._encoder_cut(request, num_hit, num_new)
            if num_new == 0:
                return 0
        if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks) is None:
            return 0
        if encoded is not None:
            self._encoder_commit(*encoded)
        request.num_computed_tokens = num_hit
        if not request.was_scheduled:
            request.num_cached_tokens, request.was_scheduled = num_hit, True
        self._start_running(request, plan, num_new)
        return num_new

    def _ready_to_fork(self, leader: Request, follower: Request) -> bool:
        return leader.status is _RUNNING and leader.num_computed_tokens >= follower.num_prompt_tokens

    def _fork(self, follower: Request, leader: Request, plan: StepPlan) -> int:
        """Share the leader's prompt blocks; the follower recomputes its last prompt token."""
        block_copies = self.kv_cache_manager.fork(leader, follower, follower.num_prompt_tokens)
        if block_copies is None:
            return 0
        plan.block_copies.extend(block_copies)
        follower.num_computed_tokens = follower.num_prompt_tokens - 1
        follower.num_cached_tokens, follower.was_scheduled = leader.num_cached_tokens, True
        self._siblings.discard(follower.req_id)
        self._start_running(follower, plan, 1)
        return 1

    def _start_running(self, request: Request, plan: StepPlan, num_scheduled: int) -> None:
        self._waiting.remove(request)
        request.status = _RUNNING
        bisect.insort(self._running, request, key=self._key)
        plan.new_requests.append(self._new_request_data(request))
        plan.num_scheduled_tokens[request.req_id] = num_scheduled

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.req_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling=request.sampling,
            block_ids=self.kv_cache_manager.block_ids(request.req_id),
            num_computed_tokens=request.num_computed_tokens,
            lora=request.lora,
            images=request.images,
            tenant=request.tenant,
        )

    def _send_forked(self, plan: StepPlan) -> None:
        """Announce the beams forked since the last plan, scheduled in this one or not.

        The plan always reaches the executor: it also drops their parents.
        """
        for request in self._running:
            if request.req_id in self._unsent:
                plan.new_requests.append(self._new_request_data(request))
        self._unsent.clear()

    def _release_held(self, plan: StepPlan) -> None:
        """Nothing could run: preempt the latest held beam if that may let a waiting request in."""
        if not any(request.req_id not in self._held for request in self._waiting):
            return
        held = [request for request in self._running if request.req_id in self._held]
        if held:
            self._preempt(held[-1], plan)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Back to the waiting queue with nothing held; the executor drops it this step.

        A held beam stays held: its token is out, it only waits for `fork_beams`.
        """
        self.kv_cache_manager.free(request)
        self._running.remove(request)
        self._siblings.discard(request.req_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self._waiting, request, key=self._key)
        if request.req_id in self._unsent:
            self._unsent.discard(request.req_id)
        else:
            plan.finished_req_ids.append(request.req_id)

    # ---- results and finishing ------------------------------------------------------------

    def _append_sampled(self, request: Request, sampled: SampledToken) -> RequestUpdate:
        request.append_output_token(sampled.token_id)
        if request.is_beam:
            self._held.add(request.req_id)
            return RequestUpdate(request.req_id, sampled, None)
        reason = self._stop_reason(request)
        if reason is not None:
            self._finish(request, reason)
        return RequestUpdate(request.req_id, sampled, reason)

    def _stop_reason(self, request: Request) -> FinishReason | None:
        """Stop token (once `min_tokens` are out) first, then the length limits.

        A constrained request's EOS ends it even before `min_tokens`: the executor lets EOS
        through early only when the grammar is complete (its end wins over min_tokens).
        """
        output_token_ids = request.output_token_ids
        num_output_tokens = len(output_token_ids)
        token_id = output_token_ids[-1]
        if token_id in request._stop_token_ids and (
            num_output_tokens >= request.sampling.min_tokens
            or (request.sampling.constraint is not None and token_id in request.eos_token_ids)
        ):
            return FinishReason.EOS if token_id in request.eos_token_ids else FinishReason.STOP_TOKEN
        if num_output_tokens >= request.max_tokens or len(request._all_token_ids) >= self._max_seq_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is _RUNNING:
            self._running.remove(request)
            if request.req_id in self._unsent:
                self._unsent.discard(request.req_id)
            else:
                self._finished_req_ids.append(request.req_id)
        else:
            self._waiting.remove(request)
        self._held.discard(request.req_id)
        self.kv_cache_manager.remove(request)
        self._siblings.discard(request.req_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.req_id]
        del self._order[request.req_id]

    # ---- validation -----------------------------------------------------------------------

    def _validate_new(self, requests: Sequence[Request]) -> None:
        if not requests:
            raise ValueError("add_requests needs at least one request")
        req_ids = [request.req_id for request in requests]
        if len(set(req_ids)) != len(req_ids):
            raise ValueError(f"duplicate req_id among siblings: {req_ids}")
        for request in requests:
            if request.req_id in self._requests:
                raise ValueError(f"req_id {request.req_id!r} is already in flight")
            if request.is_finished or request.num_computed_tokens != 0:
                raise ValueError(f"request {request.req_id!r} is finished or still held elsewhere")
            if request.prompt_token_ids != requests[0].prompt_token_ids:
                raise ValueError(f"sibling {request.req_id!r} has a different prompt")
            problem = fit_error(request.num_tokens, None, self._max_seq_len)
            if problem:
                raise ValueError(
                    f"request {request.req_id!r}: {problem[1]} (max_seq_len {self._max_seq_len}: max_model_len {self.config.max_model_len}, "
                    f"KV cache {self.config.num_usable_blocks} blocks of {self.config.block_size})"
                )

    def _validate_children(self, parent: Request, children: Sequence[Request]) -> None:
        req_ids = [child.req_id for child in children]
        if len(set(req_ids)) != len(req_ids):
            raise ValueError(f"duplicate req_id among the children of {parent.req_id!r}: {req_ids}")
        for child in children:
            if child.req_id in self._requests:
                raise ValueError(f"req_id {child.req_id!r} is already in flight")
            if not child.is_beam or child.is_finished or child.num_computed_tokens != 0:
                raise ValueError(f"child {child.req_id!r} must be a new beam")
            if (
                child.prompt_token_ids != parent.prompt_token_ids
                or child.num_tokens != parent.num_tokens
                or child.all_token_ids[:-1] != parent.all_token_ids[:-1]
            ):
                raise ValueError(f"child {child.req_id!r} is not {parent.req_id!r} with its last token replaced")
            if not self.can_fit(child.num_tokens + 1):
                raise ValueError(f"child {child.req_id!r}: {child.num_tokens} tokens leave no room to generate")

    def _check_result(self, plan: StepPlan, result: StepResult) -> None:
        """Raise ValueError, changing nothing, unless `result` answers the plan in flight."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} for plan {plan.step_id}")
        if not plan.num_scheduled_tokens:
            if result.sampled:
                raise ValueError(f"step {plan.step_id} scheduled nothing but has tokens")
            return
        if not self._in_flight or plan is not self._in_flight[0].plan:
            raise ValueError(f"plan {plan.step_id} is not the oldest step in flight")
        if not plan.scheduled_spec_decode_tokens and not result.errors:
            # The common case, without building the per-request lists below: exactly one
            # token for each request that expects one (they are all scheduled) passes every
            # check; anything else takes the full path, for its error.
            sampled_ids = {token.req_id for token in result.sampled}
            if len(sampled_ids) == len(result.sampled) and sampled_ids == self._in_flight[0].expects_token:
                return
        sampled: dict[str, list[int]] = {}
        for token in result.sampled:
            if token.req_id not in plan.num_scheduled_tokens:
                raise ValueError(f"step {plan.step_id}: token for unscheduled request {token.req_id!r}")
            sampled.setdefault(token.req_id, []).append(token.token_id)
        failed = {error.req_id for error in result.errors}
        if failed - set(plan.num_scheduled_tokens) or failed & set(sampled):
            raise ValueError(f"step {plan.step_id}: errors for unscheduled or sampled requests {sorted(failed)}")
        expects = self._in_flight[0].expects_token
        missing, extra = expects - set(sampled) - failed, set(sampled) - expects
        if missing or extra:
            raise ValueError(f"step {plan.step_id}: tokens missing for {sorted(missing)}, unexpected for {sorted(extra)}")
        for req_id, token_ids in sampled.items():
            drafts = plan.scheduled_spec_decode_tokens.get(req_id, [])
            if len(token_ids) > 1 + len(drafts) or token_ids[:-1] != drafts[: len(token_ids) - 1]:
                raise ValueError(f"step {plan.step_id}: request {req_id!r} got {token_ids} for drafts {drafts}")

    def _key(self, request: Request) -> tuple[int, float, int]:
        return self._order[request.req_id]
