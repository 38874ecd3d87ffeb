"""Images in the scheduler core (issue 40): prefix-cache keys take the images' hashes, chunks do not
end inside an image where the executor says so (Register.whole_image_chunks), and every NewRequest
of a request (first scheduling, after preemption) carries its images."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda.step import ImageInput
from scheduler_svc.core import KVCacheManager, Scheduler, SchedulerConfig
from scheduler_svc.core.block_hash import block_hashes_of

from .fake_executor import FakeExecutor, make_request, run_to_completion, step

IMG = 99  # the placeholder token


def with_image(req_id: str, image_hash: str, offset: int = 5, length: int = 8, tail: int = 7, max_tokens: int = 4):
    """A prompt of `offset` text tokens, `length` placeholders, `tail` text tokens; its one image."""
    prompt = list(range(1, offset + 1)) + [IMG] * length + list(range(20, 20 + tail))
    request = make_request(req_id, prompt, max_tokens)
    request.images = (ImageInput(image_hash, offset, length, ()),)
    return request


def test_block_keys_take_the_hashes_of_the_images_they_hold():
    prompt = list(range(1, 6)) + [IMG] * 8 + list(range(20, 27))  # 20 tokens: blocks [0,4) .. [16,20)
    image = ImageInput("aa", 5, 8, ())
    plain = block_hashes_of(prompt, 4)
    keyed = block_hashes_of(prompt, 4, images=[image])
    other = block_hashes_of(prompt, 4, images=[dataclasses.replace(image, hash="bb")])
    assert keyed[0] == plain[0] and other[0] == plain[0]  # block 0 holds text only
    for index in range(1, 5):  # blocks 1..3 hold placeholders; block 4 inherits the chain
        assert keyed[index].hash_value != plain[index].hash_value != other[index].hash_value != keyed[index].hash_value


def test_the_same_image_hits_the_prefix_cache_and_another_does_not():
    manager = KVCacheManager(block_size=4, num_blocks=32, enable_prefix_caching=True)
    first = with_image("a", "aa")
    assert manager.allocate_slots(first, first.num_tokens) is not None
    first.num_computed_tokens = first.num_tokens
    manager.cache_full_blocks(first)
    assert manager.get_computed_blocks(with_image("same", "aa"))[1] == 16  # all but the block of the last token
    assert manager.get_computed_blocks(with_image("other", "bb"))[1] == 4  # the text before the image only
    assert manager.num_prefix_cached_tokens(first.all_token_ids, "", first.images) == 16
    assert manager.num_prefix_cached_tokens(first.all_token_ids, "", (ImageInput("bb", 5, 8, ()),)) == 4
    assert manager.num_prefix_cached_tokens(first.all_token_ids) == 4  # no image: placeholders alone never hit


def make(budget: int, whole: bool, num_blocks: int = 64, block_size: int = 4):
    config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                             enable_prefix_caching=False, whole_image_chunks=whole)
    return Scheduler(config), FakeExecutor(block_size, num_blocks)


def chunks(scheduler, executor, req_id: str) -> list[int]:
    sizes = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        sizes.append(plan.num_scheduled_tokens.get(req_id, 0))
        scheduler.update_from_output(plan, executor.execute(plan))
    return sizes


def test_chunks_end_before_an_image_where_the_executor_asks():
    scheduler, executor = make(budget=7, whole=True)
    scheduler.add_requests([with_image("a", "aa")])  # text [0,5), image [5,13), text [13,20)
    sizes = chunks(scheduler, executor, "a")
    assert sizes[0] == 5  # cut before the image: 5 + 7 would end inside it
    assert sizes[1] == 8  # the whole image, over the budget of 7: nothing else is in the step
    assert sizes[2] == 7


def test_chunks_may_end_inside_an_image_otherwise():
    scheduler, executor = make(budget=7, whole=False)
    scheduler.add_requests([with_image("a", "aa")])
    assert chunks(scheduler, executor, "a")[:3] == [7, 7, 6]


def test_a_whole_image_waits_for_a_step_with_room():
    scheduler, executor = make(budget=10, whole=True)
    scheduler.add_requests([make_request("t", list(range(1, 5)), max_tokens=8)])  # decodes beside it
    scheduler.add_requests([with_image("a", "aa", offset=2, length=9, tail=3)])  # image [2,11) > 10 - 4 - 2
    plans = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plans.append(dict(plan.num_scheduled_tokens))
        for req_id, n in plan.num_scheduled_tokens.items():
            request = scheduler._requests[req_id]
            start = request.num_computed_tokens - n
            for image in request.images:
                assert not image.offset < start + n < image.end, (req_id, start, n)
        scheduler.update_from_output(plan, executor.execute(plan))
    assert plans[0] == {"t": 4, "a": 2}
    assert any(p.get("a") == 9 for p in plans)


def test_every_new_request_carries_the_images_after_preemption_too():
    scheduler, executor = make(budget=64, whole=True, num_blocks=9, block_size=4)  # 8 usable blocks
    image = with_image("a", "aa", max_tokens=12)  # 20 + 12 tokens: 8 blocks
    scheduler.add_requests([make_request("b", list(range(1, 9)), max_tokens=12, arrival_time=0.0)])
    image.arrival_time = 1.0  # the later one: preempted first
    scheduler.add_requests([image])
    sent = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        sent += [(new.req_id, new.images) for new in plan.new_requests]
        scheduler.update_from_output(plan, executor.execute(plan))
    assert scheduler.num_preemptions > 0
    sent_a = [images for req_id, images in sent if req_id == "a"]
    assert len(sent_a) >= 2 and all(images == image.images for images in sent_a)
    assert all(images == () for req_id, images in sent if req_id == "b")


# ---- the encoder budget (SchedulerConfig.max_num_encoder_input_tokens) ---------------------------


def encoding_steps(scheduler, executor, max_steps: int = 200) -> list[tuple[dict[str, int], list[str]]]:
    """Run to the end; each step's chunks and the images an executor's encoder cache would encode
    in it (an image is encoded when a chunk overlaps it and no request holds it; a request holds it
    until it has computed all of its placeholders, or stops running)."""
    holders: dict[str, set[str]] = {}
    steps = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return steps
        plan = scheduler.schedule()
        for holding in holders.values():
            holding.intersection_update(r.req_id for r in scheduler._running)
        encoded = []
        for req_id, n in plan.num_scheduled_tokens.items():
            request = scheduler._requests[req_id]
            end = request.num_computed_tokens
            for image in request.images:
                if image.offset < end and image.end > end - n:
                    if not holders.get(image.hash):
                        encoded.append(image.hash)
                    holders.setdefault(image.hash, set()).add(req_id)
                    if end >= image.end:
                        holders[image.hash].discard(req_id)
        steps.append((dict(plan.num_scheduled_tokens), sorted(set(encoded))))
        scheduler.update_from_output(plan, executor.execute(plan))
    raise AssertionError(f"not done after {max_steps} steps")


def add(scheduler, *requests) -> None:
    for request in requests:  # one at a time (a list is the n samples of one prompt)
        scheduler.add_requests([request])


def make_encoder(budget: int, encoder_budget: int, whole: bool = False, prefix: bool = False):
    config = SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=budget, enable_prefix_caching=prefix,
                             whole_image_chunks=whole, max_num_encoder_input_tokens=encoder_budget)
    return Scheduler(config), FakeExecutor(4, 64)


def test_the_encoder_budget_defaults_to_the_step_budget_and_is_checked():
    assert SchedulerConfig(num_blocks=8, max_num_batched_tokens=96).encoder_budget == 96
    assert SchedulerConfig(num_blocks=8, max_num_encoder_input_tokens=40).encoder_budget == 40
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        SchedulerConfig(num_blocks=8, max_num_encoder_input_tokens=-1)


def test_an_image_past_the_encoder_budget_waits_for_the_next_step():
    scheduler, executor = make_encoder(budget=64, encoder_budget=12)
    add(scheduler, with_image("a", "aa"), with_image("b", "bb"))  # images [5,13) each: 8 + 8 > 12
    steps = encoding_steps(scheduler, executor)
    assert steps[0] == ({"a": 20, "b": 5}, ["aa"])  # b stops before its image
    assert steps[1] == ({"a": 1, "b": 15}, ["bb"])
    assert all(sum(8 for _ in encoded) <= 12 for _, encoded in steps)


def test_an_image_the_executor_holds_costs_nothing():
    scheduler, executor = make_encoder(budget=64, encoder_budget=8)
    add(scheduler, with_image("a", "aa"), with_image("b", "aa"), with_image("c", "cc"))
    steps = encoding_steps(scheduler, executor)
    assert steps[0] == ({"a": 20, "b": 20, "c": 5}, ["aa"])  # b shares a's image; c's would be 16 > 8


def test_a_chunk_part_way_through_an_image_does_not_encode_it_again():
    scheduler, executor = make_encoder(budget=12, encoder_budget=8)
    add(scheduler, with_image("a", "aa"), with_image("b", "bb", offset=0, length=4, tail=1))  # a: image [5,13)
    steps = encoding_steps(scheduler, executor)
    assert steps[0] == ({"a": 12}, ["aa"])
    # a's chunk [12,20) reads the cached rows, so b's image fits the encoder budget beside it
    assert steps[1] == ({"a": 8, "b": 4}, ["bb"])


def test_an_image_over_the_whole_encoder_budget_is_encoded_alone():
    scheduler, executor = make_encoder(budget=64, encoder_budget=6)
    add(scheduler, with_image("a", "aa"), with_image("b", "bb"))  # 8-token images > 6
    steps = encoding_steps(scheduler, executor)
    assert steps[0] == ({"a": 20, "b": 5}, ["aa"])
    assert steps[1] == ({"a": 1, "b": 15}, ["bb"])


def test_a_prefix_hit_inside_an_image_waits_for_encoder_room():
    scheduler, executor = make_encoder(budget=64, encoder_budget=8, prefix=True)
    scheduler.add_requests([with_image("a", "aa", offset=1, length=14, tail=1, max_tokens=1)])  # image [1,15)
    encoding_steps(scheduler, executor)  # blocks [0,4) .. [8,12) cached: a later "aa" hits 12 tokens
    add(scheduler, with_image("c", "cc", offset=0), with_image("d", "aa", offset=1, length=14, tail=1))
    steps = encoding_steps(scheduler, executor)
    assert steps[0] == ({"c": 15}, ["cc"])  # d's chunk would start inside "aa" (a hit of 12): no room, it waits
    assert steps[1][1] == ["aa"] and steps[1][0]["d"] == 4
