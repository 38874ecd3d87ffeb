"""KvEventHub: the executors' prefix-cache events as the router's per-worker KV-event stream."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.core import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler_svc.core.block_hash import block_hashes_of
from scheduler_svc.vllm_engine import kv_events
from scheduler_svc.vllm_engine.kv_events import FellBehind, KvEventHub, OutOfRange, block_hash_id

BS = 2
TOKENS = [1, 2, 3, 4, 5, 6]
KEYS = block_hashes_of(TOKENS, BS)
HASHES = [k.hash_value for k in KEYS]


def stored(hashes, parent=None, salt=""):
    """BlockStored of the chain `hashes` (keys of KEYS, or of another salt's `keys`)."""
    by_hash = {k.hash_value: k for k in KEYS + ALICE_KEYS}
    return BlockStored(tuple(by_hash[h] for h in hashes), parent, salt)


def drain(subscription) -> list:
    batches = list(subscription.initial)
    subscription.initial.clear()
    while subscription._queue:
        batches.append(subscription._queue.popleft())
    return batches


def events_of(batches) -> list[tuple]:
    """(kind, [block hash ids], parent id | None) per event, in order."""
    out = []
    for batch in batches:
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                parent = event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
                out.append(("stored", [b.block_hash for b in event.stored.blocks], parent))
            elif kind == "removed":
                out.append(("removed", list(event.removed.block_hashes), None))
            else:
                out.append(("cleared", [], None))
    return out


IDS = [block_hash_id(h) for h in HASHES]
ALICE_KEYS = block_hashes_of(TOKENS, BS, "5:alice|")


def test_a_chain_is_stored_with_its_tokens_and_sequence_numbers_run_on():
    hub = KvEventHub(BS)
    sub = hub.subscribe("")
    hub.publish("a", [stored(HASHES[:2])])
    hub.publish("a", [stored(HASHES[2:], parent=HASHES[1])])
    batches = drain(sub)
    assert [b.sequence_number for b in batches] == [1, 2, 3]  # the snapshot (empty), then one batch per flush
    assert batches[0].snapshot.count == 1 and events_of(batches[:1]) == [("cleared", [], None)]
    assert events_of(batches[1:]) == [("stored", IDS[:2], None), ("stored", IDS[2:], IDS[1])]
    assert [list(b.token_ids) for b in batches[1].events[0].stored.blocks] == [[1, 2], [3, 4]]
    assert batches[1].events[0].stored.blocks[0].block_size == BS


def test_a_block_held_by_two_executors_is_removed_when_the_last_copy_goes():
    hub = KvEventHub(BS)
    sub = hub.subscribe("")
    drain(sub)
    hub.publish("a", [stored(HASHES[:1])])
    hub.publish("b", [stored(HASHES[:1])])  # a second copy: nothing new for the router
    hub.publish("a", [BlockRemoved((HASHES[0],))])  # one copy left
    assert events_of(drain(sub)) == [("stored", IDS[:1], None)]
    hub.publish("b", [AllBlocksCleared()])  # b is gone: the last copy with it
    assert events_of(drain(sub)) == [("cleared", [], None)]  # nothing of this salt is left
    assert hub.num_blocks("") == 0


def test_a_subscriber_sees_only_the_blocks_of_its_own_salt():
    hub = KvEventHub(BS)
    alice, bob = hub.subscribe("5:alice|"), hub.subscribe("3:bob|")
    drain(alice), drain(bob)
    alice_hashes = [k.hash_value for k in ALICE_KEYS]
    hub.publish("a", [stored(alice_hashes[:2], salt="5:alice|")])
    assert events_of(drain(alice)) == [("stored", [block_hash_id(h) for h in alice_hashes[:2]], None)]
    assert drain(bob) == []  # another tenant's tokens never reach bob, not even as a batch


def test_a_new_subscriber_gets_the_live_blocks_parents_first():
    hub = KvEventHub(BS)
    hub.publish("a", [stored(HASHES[:1]), stored(HASHES[1:2], parent=HASHES[0])])
    hub.publish("b", [stored(HASHES[:3])])
    hub.publish("a", [BlockRemoved((HASHES[0],))])  # b still holds it
    sub = hub.subscribe("")
    (snapshot,) = drain(sub)
    assert snapshot.sequence_number == 1 and snapshot.snapshot.blocks == 3
    assert events_of([snapshot]) == [("cleared", [], None), ("stored", IDS, None)]


def test_a_big_snapshot_comes_in_numbered_chunks_and_live_batches_follow(monkeypatch):
    monkeypatch.setattr(kv_events, "SNAPSHOT_CHUNK_TOKENS", 2)  # one block per chunk
    hub = KvEventHub(BS)
    early = hub.subscribe("")
    hub.publish("a", [stored(HASHES)])
    sub = hub.subscribe("")
    chunks = drain(sub)
    assert [(c.sequence_number, c.snapshot.index, c.snapshot.count) for c in chunks] == [(1, 0, 3), (2, 1, 3), (3, 2, 3)]
    assert events_of(chunks) == [("cleared", [], None)] + [("stored", [i], p) for i, p in zip(IDS, [None, *IDS[:2]])]
    assert [b.sequence_number for b in drain(early)] == [1, 2, 3]  # its own snapshot, its live batch, then an empty one
    hub.publish("a", [BlockRemoved((HASHES[2],))])
    (live,) = drain(sub)
    assert live.sequence_number == 4 and events_of([live]) == [("removed", IDS[2:], None)]


def test_a_resuming_subscriber_gets_what_it_missed_or_out_of_range():
    hub = KvEventHub(BS)
    first = hub.subscribe("")
    hub.publish("a", [stored(HASHES[:1])])
    hub.publish("a", [BlockRemoved((HASHES[0],))])
    assert [b.sequence_number for b in drain(first)] == [1, 2, 3]
    resumed = hub.subscribe("", start_sequence_number=2)
    assert [b.sequence_number for b in drain(resumed)] == [3]
    assert drain(hub.subscribe("", start_sequence_number=3)) == []
    with pytest.raises(OutOfRange, match="ahead"):  # a cursor from before this scheduler restarted
        hub.subscribe("", start_sequence_number=9)


def test_resuming_past_the_history_is_out_of_range(monkeypatch):
    monkeypatch.setattr(kv_events, "HISTORY", 2)
    hub = KvEventHub(BS)
    hub.subscribe("")
    for _ in range(3):
        hub.publish("a", [stored(HASHES[:1])])
        hub.publish("a", [BlockRemoved((HASHES[0],))])
    with pytest.raises(OutOfRange, match="no longer kept"):
        hub.subscribe("", start_sequence_number=1)


def test_a_subscriber_that_does_not_read_is_cut_off(monkeypatch):
    """It would make the hub hold its batches without bound; the router resubscribes on DATA_LOSS."""
    monkeypatch.setattr(kv_events, "MAX_PENDING", 3)

    async def scenario():
        hub = KvEventHub(BS)
        sub = hub.subscribe("")
        assert (await sub.next(0.1)).sequence_number == 1
        for i in range(4):  # one batch more than it may hold
            hub.publish("a", [stored(HASHES[:1]) if i % 2 == 0 else BlockRemoved((HASHES[0],))])
            await asyncio.sleep(0)  # the hub flushes on the loop's next turn: one batch each
        with pytest.raises(FellBehind):
            for _ in range(5):
                await sub.next(0.1)

    asyncio.run(scenario())


def test_next_waits_for_a_batch_or_times_out():
    async def scenario():
        hub = KvEventHub(BS)
        sub = hub.subscribe("")
        await sub.next(0.1)
        assert await sub.next(0.01) is None
        asyncio.get_running_loop().call_later(0.01, hub.publish, "a", [stored(HASHES[:1])])
        batch = await sub.next(5)
        assert events_of([batch]) == [("stored", IDS[:1], None)]

    asyncio.run(scenario())


def test_block_hash_ids_are_signed_64_bit():
    assert block_hash_id(b"\x00" * 8 + b"\xff" * 8) == -1
    assert block_hash_id(b"\xff" * 8 + b"\x00" * 7 + b"\x05") == 5
