"""Beam forks in the core: shared full blocks, a copied partial block, held beams, preemption.

The fake executor's fingerprint KV cache catches a missing or wrong block copy and any
write into a shared block; `step` checks the scheduler's integrity after every step.
"""

from __future__ import annotations

import math
import random

import pytest

from pagoda.step import BlockCopy, SampledToken
from scheduler_svc.beam_search import BeamSearch, BeamSearchParams, apply_beam_step
from scheduler_svc.core import FinishReason, Request, RequestStatus, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, FakeRequestState, make_request, step

VOCAB, STOP = 64, 0


def make(num_blocks=64, block_size=4, budget=64, max_num_seqs=64, caching=False):
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        enable_prefix_caching=caching,
    )
    return Scheduler(config), BeamFakeExecutor(block_size, num_blocks, VOCAB)


def fake_logprobs(fingerprint: int) -> list[float]:
    """A fixed next-token distribution per prefix (STOP boosted, so some beams end early)."""
    rng = random.Random(fingerprint)
    logits = [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]
    logits[STOP] += 2.0
    top = max(logits)
    log_sum = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_sum for x in logits]


def top_of(token_ids: list[int], k: int) -> list[tuple[int, float]]:
    fingerprint = FakeRequestState(list(token_ids), 0, None, [], 0).fingerprint(len(token_ids) - 1)
    logprobs = fake_logprobs(fingerprint)
    return sorted(enumerate(logprobs), key=lambda item: -item[1])[:k]


class BeamFakeExecutor(FakeExecutor):
    """The fake executor, plus top logprobs from `fake_logprobs` for requests that ask."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_top: dict[str, int] = {}

    def execute(self, plan):
        for new in plan.new_requests:
            self.num_top[new.req_id] = new.sampling.top_logprobs
        result = super().execute(plan)
        for i, token in enumerate(result.sampled):
            k = self.num_top[token.req_id]
            if k:
                prefix = self.states[token.req_id].token_ids[:-1]
                result.sampled[i] = SampledToken(token.req_id, token.token_id, 0.0, top_of(prefix, k))
        return result


def beam(req_id: str, prompt: list[int], output: list[int] = ()) -> Request:
    return Request(req_id=req_id, prompt_token_ids=prompt, output_token_ids=list(output), max_tokens=8, is_beam=True)


def children_of(parent: Request, tokens: list[int], prefix: str = "c") -> list[Request]:
    return [
        beam(f"{prefix}{i}", parent.prompt_token_ids, parent.output_token_ids[:-1] + [token])
        for i, token in enumerate(tokens)
    ]


def ref_counts(scheduler: Scheduler, block_ids: list[int]) -> list[int]:
    return [scheduler.kv_cache_manager.block_pool.blocks[b].ref_cnt for b in block_ids]


def assert_all_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.has_unfinished()
    assert pool.num_free_blocks == pool.num_total_blocks
    scheduler.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_fork_shares_full_blocks_and_copies_the_partial_block(caching):
    scheduler, executor = make(caching=caching)
    prompt = list(range(1, 11))  # 10 tokens: [1-4][5-8][9 10 . .]
    root = beam("root", prompt)
    scheduler.add_requests([root])
    step(scheduler, executor)
    assert root.num_output_tokens == 1 and root.num_computed_tokens == 10
    (root_ids,) = scheduler.kv_cache_manager.block_ids("root")
    plan = scheduler.schedule()  # held: never scheduled again
    assert plan.num_scheduled_tokens == {} and plan.new_requests == []
    scheduler.update_from_output(plan, executor.execute(plan))

    children = children_of(root, [31, 32, 33])
    scheduler.fork_beams("root", children)
    assert root.is_finished
    tables = {c.req_id: scheduler.kv_cache_manager.block_ids(c.req_id)[0] for c in children}
    assert tables["c0"] == root_ids  # the partial block is handed over to the first child
    for req_id in ("c1", "c2"):
        assert tables[req_id][:2] == root_ids[:2] and tables[req_id][2] not in root_ids
    assert ref_counts(scheduler, root_ids) == [3, 3, 1]
    scheduler.check_integrity()

    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["root"]
    assert plan.block_copies == [BlockCopy(root_ids[2], tables["c1"][2]), BlockCopy(root_ids[2], tables["c2"][2])]
    assert {n.req_id: (n.token_ids, n.num_computed_tokens) for n in plan.new_requests} == {
        c.req_id: (prompt + [31 + i], 10) for i, c in enumerate(children)
    }
    assert plan.num_scheduled_tokens == {"c0": 1, "c1": 1, "c2": 1}
    updates = scheduler.update_from_output(plan, executor.execute(plan))  # the fake executor checks the KV
    assert {u.req_id for u in updates} == {"c0", "c1", "c2"} and all(u.finish_reason is None for u in updates)
    scheduler.finish_requests(["c0", "c1", "c2"], FinishReason.LENGTH)
    step(scheduler, executor)
    assert_all_free(scheduler)


@pytest.mark.parametrize(("prompt_len", "num_copies"), [(8, 0), (9, 2), (1, 2), (4, 0)])
def test_fork_block_arithmetic(prompt_len, num_copies):
    scheduler, executor = make()
    root = beam("root", list(range(1, prompt_len + 1)))
    scheduler.add_requests([root])
    step(scheduler, executor)
    (root_ids,) = scheduler.kv_cache_manager.block_ids("root")
    scheduler.fork_beams("root", children_of(root, [7, 8, 9]))
    plan = scheduler.schedule()
    assert len(plan.block_copies) == num_copies
    num_full = prompt_len // 4
    for new in plan.new_requests:
        assert new.block_ids[0][:num_full] == root_ids[:num_full]
        assert len(new.block_ids[0]) == num_full + 1  # its own block for position prompt_len
    assert len({new.block_ids[0][-1] for new in plan.new_requests}) == 3
    scheduler.update_from_output(plan, executor.execute(plan))
    scheduler.check_integrity()


def test_children_beyond_free_blocks_or_max_num_seqs_wait_and_recompute():
    scheduler, executor = make(num_blocks=5, max_num_seqs=3)  # 4 blocks of 4
    root = beam("root", list(range(1, 7)))  # 2 blocks, the second partial
    scheduler.add_requests([root])
    step(scheduler, executor)
    children = children_of(root, [20, 21, 22, 23])
    scheduler.fork_beams("root", children)  # max_num_seqs 3: c3 waits; 2 free blocks: c0-c2 share
    assert [c.status for c in children] == [RequestStatus.RUNNING] * 3 + [RequestStatus.WAITING]
    assert children[3].num_computed_tokens == 0
    scheduler.check_integrity()
    for _ in range(20):
        for update in step(scheduler, executor):
            scheduler.finish_requests([update.req_id], FinishReason.LENGTH)
        if not scheduler.has_unfinished():
            break
    assert all(c.num_output_tokens == 2 for c in children)
    assert_all_free(scheduler)


def test_a_preempted_held_beam_forks_into_waiting_children():
    scheduler, executor = make(num_blocks=5, block_size=2)  # 4 blocks of 2
    root = beam("root", [1, 2, 3])
    scheduler.add_requests([root])
    step(scheduler, executor)
    scheduler.add_requests([make_request("other", [9, 9, 9, 9, 9], max_tokens=2, arrival_time=-1.0)])
    plan = scheduler.schedule()  # nothing can run but "other" waits: the held root is preempted
    assert plan.finished_req_ids == ["root"] and root.status is RequestStatus.PREEMPTED
    scheduler.update_from_output(plan, executor.execute(plan))
    step(scheduler, executor)  # "other" admitted; the held root is never readmitted
    assert root.status is RequestStatus.PREEMPTED and root.num_output_tokens == 1
    children = children_of(root, [5, 6])
    scheduler.fork_beams("root", children)
    assert all(c.status is RequestStatus.WAITING for c in children)
    while scheduler.has_unfinished():
        for update in step(scheduler, executor):
            if update.req_id in ("c0", "c1"):
                scheduler.finish_requests([update.req_id], FinishReason.LENGTH)
    assert [c.output_token_ids[:1] for c in children] == [[5], [6]]
    assert_all_free(scheduler)


def test_fork_checks_parent_and_children():
    scheduler, executor = make()
    root = beam("root", [1, 2, 3])
    scheduler.add_requests([root])
    with pytest.raises(ValueError, match="not a held beam"):
        scheduler.fork_beams("root", [])
    step(scheduler, executor)
    with pytest.raises(ValueError, match="last token replaced"):
        scheduler.fork_beams("root", [beam("x", [1, 2, 3], [4, 5])])
    with pytest.raises(ValueError, match="new beam"):
        scheduler.fork_beams("root", [Request(req_id="x", prompt_token_ids=[1, 2, 3], output_token_ids=[4])])
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.fork_beams("root", [beam("x", [1, 2, 3], [4]), beam("x", [1, 2, 3], [5])])
    scheduler.check_integrity()
    assert root.req_id in {r.req_id for r in scheduler.running}
    full = beam("full", list(range(63)))  # max_model_len 64: its one token fills it
    scheduler.add_requests([full])
    step(scheduler, executor)
    with pytest.raises(ValueError, match="no room"):
        scheduler.fork_beams("full", children_of(full, [1]))


# ---- whole searches through the core --------------------------------------------------------


def search_params(width=4, max_tokens=8, n=2):
    return BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, n=n, stop_token_ids=frozenset([STOP]), eos_token_ids=frozenset([STOP])
    )


def direct_search(prompt: list[int], params: BeamSearchParams):
    """The answer, without any scheduler: every live beam's candidates straight from `top_of`."""
    search = BeamSearch("r", prompt, params)
    live = {search.root().req_id: list(prompt)}
    while not search.done:
        step_ = None
        for req_id, token_ids in list(live.items()):
            step_ = search.on_sampled(SampledToken(req_id, 0, 0.0, top_of(token_ids, params.num_candidates))) or step_
        for req_id in step_.finished_req_ids:
            del live[req_id]
        for parent_id, children in step_.forks:
            del live[parent_id]
            live.update((c.req_id, list(c.all_token_ids)) for c in children)
    return search.best()


def core_search(scheduler, executor, prompt, params, others=()):
    search = BeamSearch("r", prompt, params, arrival_time=1.0)
    scheduler.add_requests([search.root()])
    for request in others:
        scheduler.add_requests([request])
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        for update in step(scheduler, executor):
            if update.req_id in search.live_req_ids:
                beam_step = search.on_sampled(update.sampled)
                if beam_step is not None:
                    apply_beam_step(scheduler, beam_step)
    assert search.done
    return search.best()


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "budget", "max_num_seqs", "caching"),
    [
        (64, 4, 64, 64, False),  # room for everything
        (64, 4, 64, 64, True),
        (64, 3, 5, 64, True),  # chunked prefill, children left out of some steps
        (64, 4, 64, 3, False),  # max_num_seqs below the width: children wait
        (9, 4, 64, 64, False),  # 8 blocks: preemption, held beams released
        (9, 4, 64, 64, True),
        (10, 2, 7, 4, True),  # 9 blocks of 2, budget 7, 4 sequences
    ],
)
def test_search_through_the_core_equals_the_direct_search(num_blocks, block_size, budget, max_num_seqs, caching):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    others = [make_request(f"o{i}", [40 + i] * (3 + i), max_tokens=6, arrival_time=float(i)) for i in range(3)]
    num_preemptions = 0
    for seed_prompt in range(4):
        params = search_params(width=2 + seed_prompt, n=1 + seed_prompt // 2)
        scheduler, executor = make(num_blocks, block_size, budget, max_num_seqs, caching)
        want = direct_search(prompt + [seed_prompt], params)
        got = core_search(scheduler, executor, prompt + [seed_prompt], params, others if seed_prompt % 2 else ())
        assert got == want
        assert_all_free(scheduler)
        num_preemptions += scheduler.num_preemptions
        if seed_prompt % 2:
            assert all(o.is_finished for o in others)
            others = [make_request(o.req_id, o.prompt_token_ids, 6, arrival_time=o.arrival_time) for o in others]
    assert num_preemptions > 0 or num_blocks > 10


def test_some_searches_end_on_the_stop_token_before_max_tokens():
    endings = [direct_search([3, 1, 4, i], search_params(n=4))[0].finish_reason for i in range(12)]
    assert FinishReason.EOS in endings and FinishReason.LENGTH in endings


def test_abort_mid_search_frees_every_block():
    scheduler, executor = make(caching=True)
    search = BeamSearch("r", [1, 2, 3, 4, 5], search_params(max_tokens=30))
    scheduler.add_requests([search.root()])
    for _ in range(4):
        for update in step(scheduler, executor):
            beam_step = search.on_sampled(update.sampled)
            if beam_step is not None:
                apply_beam_step(scheduler, beam_step)
    assert len(search.live_req_ids) == 4
    scheduler.finish_requests(search.live_req_ids, FinishReason.ABORTED)
    step(scheduler, executor)
    assert_all_free(scheduler)
