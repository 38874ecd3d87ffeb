"""The scheduler's prefix caches as one `SubscribeKvEvents` stream per subscriber (common.proto).

The engine hands over each executor's events after every step (`Engine.on_kv_events`); the hub
keeps the blocks they describe and tells subscribers what changed, as SMG's cache-aware routing
expects of one worker (`model_gateway/src/worker/kv_event_monitor.rs`):

    executors A, B  --events-->  KvEventHub: block -> (parent, tokens, salt, copies)
                                   | a block is "stored" when its first copy appears (in any
                                   | executor) and "removed" when its last copy goes, so the
                                   | router's one index per worker follows all the executors
                                   v
                     one View per cache salt: its own sequence numbers, history, subscribers

Views. A subscriber sees only the blocks its own requests could hit: those of its salt
(`prefix_cache_salt(tenant, "")`, what the protocol's requests, which carry no salt, get).
Another tenant's blocks, or salted ones, hold other people's tokens and never reach it.

Sequence numbers, per view, from 1, consecutive (the router treats a jump as a gap):

    start_sequence_number 0   a snapshot first: the view's blocks now, parents before children,
                              in chunks (`KvSnapshotChunk`) numbered up to the view's current
                              sequence (AllBlocksCleared first), then live batches
    start_sequence_number s   the batches after s from the history (the last `HISTORY` kept);
                              OUT_OF_RANGE if they are gone or s is ahead (this scheduler
                              restarted): the router then clears and resubscribes from 0

A subscriber that falls `MAX_PENDING` batches behind is cut off with DATA_LOSS (the router
clears and resubscribes): no subscriber can make the hub hold memory for it without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from smg_grpc_proto.generated import common_pb2

from scheduler_svc.core import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

HISTORY = 4096  # batches a view keeps for resuming subscribers (a step makes at most one)
MAX_PENDING = 4096  # batches a subscriber may fall behind before it is cut off
SNAPSHOT_CHUNK_TOKENS = 256 * 1024  # tokens per snapshot chunk: a few MiB, under gRPC's 4 MiB
_I64 = 2**63


def block_hash_id(hash_value: bytes) -> int:
    """A block's 16-byte key as the protocol's int64: its last 8 bytes, big-endian, signed
    (how SMG's relay folds a raw digest, `smg_grpc_servicer.kv_relay.fold_hash`)."""
    value = int.from_bytes(hash_value[-8:], "big")
    return value - 2 * _I64 if value >= _I64 else value


class OutOfRange(Exception):
    """A resume cursor the hub cannot serve."""


class FellBehind(Exception):
    """The subscriber did not read its batches in time."""


@dataclass
class _Block:
    parent: bytes | None
    token_ids: tuple[int, ...]
    salt: str
    copies: int = 0


@dataclass(eq=False)
class Subscription:
    """One subscriber's batches: `initial` first (snapshot or replay), then live ones."""

    view: _View
    initial: list[common_pb2.KvEventBatch]
    _queue: deque = field(default_factory=deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _fell_behind: bool = False

    def push(self, batch: common_pb2.KvEventBatch) -> None:
        if len(self._queue) >= MAX_PENDING:
            self._fell_behind = True
        else:
            self._queue.append(batch)
        self._ready.set()

    async def next(self, timeout: float) -> common_pb2.KvEventBatch | None:
        """The next batch, or None after `timeout` seconds without one; FellBehind if cut off."""
        if self.initial:
            return self.initial.pop(0)
        if not self._queue and not self._fell_behind:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return None
        if self._fell_behind:
            raise FellBehind(f"fell {MAX_PENDING} KV event batches behind")
        return self._queue.popleft()

    def close(self) -> None:
        self.view.subscribers.discard(self)


@dataclass
class _View:
    salt: str
    sequence_number: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    subscribers: set[Subscription] = field(default_factory=set)

    def append(self, events: list[common_pb2.KvCacheEvent]) -> common_pb2.KvEventBatch:
        self.sequence_number += 1
        batch = common_pb2.KvEventBatch(sequence_number=self.sequence_number, timestamp=time.time(), events=events)
        self.history.append(batch)
        for subscriber in self.subscribers:
            subscriber.push(batch)
        return batch


class KvEventHub:
    """Every executor's prefix-cache events in; per-salt batches out (see the module docstring)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[bytes, _Block] = {}
        self._held: dict[str, set[bytes]] = {}  # executor id -> the blocks it holds
        self._blocks_by_salt: Counter[str] = Counter()
        self._views: dict[str, _View] = {}
        self._pending: dict[str, list[tuple[str, bytes]]] = {}  # salt -> ("stored" | "removed", hash), in order
        self._flush_scheduled = False
        self._event_id = 0

    # ---- in: the engine's events ------------------------------------------------------------

    def publish(self, executor_id: str, events: list[KVCacheEvent]) -> None:
        """Take one executor's events (the engine's `on_kv_events`); batches go out on the next loop turn."""
        held = self._held.setdefault(executor_id, set())
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for block in event.blocks:
                    self._add_copy(held, block.hash_value, parent, block.token_ids, event.cache_salt)
                    parent = block.hash_value
            elif isinstance(event, BlockRemoved):
                for hash_value in event.block_hashes:
                    self._drop_copy(held, hash_value)
            elif isinstance(event, AllBlocksCleared):
                for hash_value in list(held):
                    self._drop_copy(held, hash_value)
        if not held:
            self._held.pop(executor_id, None)
        self._schedule_flush()

    def _add_copy(
        self, held: set[bytes], hash_value: bytes, parent: bytes | None, tokens: tuple[int, ...], salt: str
    ) -> None:
        if hash_value in held:
            return
        held.add(hash_value)
        block = self._blocks.get(hash_value)
        if block is None:
            block = self._blocks[hash_value] = _Block(parent, tokens, salt)
            self._blocks_by_salt[salt] += 1
            self._pending.setdefault(salt, []).append(("stored", hash_value))
        block.copies += 1

    def _drop_copy(self, held: set[bytes], hash_value: bytes) -> None:
        if hash_value not in held:
            return
        held.discard(hash_value)
        block = self._blocks[hash_value]
        block.copies -= 1
        if block.copies == 0:
            del self._blocks[hash_value]
            self._blocks_by_salt[block.salt] -= 1
            self._pending.setdefault(block.salt, []).append(("removed", hash_value))

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._pending:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (unit tests): flush now
                self.flush()

    def flush(self) -> None:
        """Send the pending changes: one batch per view that has any."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for salt, changes in pending.items():
            view = self._views.get(salt)
            if view is None:
                continue  # nobody follows this salt: the blocks are kept for a later snapshot
            if self._blocks_by_salt[salt] == 0 and all(kind == "removed" for kind, _ in changes):
                events = [self._event(cleared=common_pb2.KvCacheCleared())]
            else:
                events = self._events_for(changes)
            if events:
                view.append(events)

    def _events_for(self, changes: list[tuple[str, bytes]]) -> list[common_pb2.KvCacheEvent]:
        """Consecutive stores of one chain become one KvBlocksStored, consecutive removals one KvBlocksRemoved."""
        events: list[common_pb2.KvCacheEvent] = []
        last_stored: bytes | None = None
        for kind, hash_value in changes:
            if kind == "stored":
                block = self._blocks.get(hash_value)
                if block is None:  # stored and removed before this flush: nobody needs to hear of it
                    continue
                stored = events[-1].stored if events and events[-1].HasField("stored") else None
                if stored is None or last_stored != block.parent:
                    event = self._event(stored=common_pb2.KvBlocksStored())
                    if block.parent is not None:
                        event.stored.parent_block_hash = block_hash_id(block.parent)
                    events.append(event)
                    stored = event.stored
                stored.blocks.append(self._kv_block(hash_value, block))
                last_stored = hash_value
            else:
                if not (events and events[-1].HasField("removed")):
                    events.append(self._event(removed=common_pb2.KvBlocksRemoved()))
                events[-1].removed.block_hashes.append(block_hash_id(hash_value))
                last_stored = None
        return events

    def _event(self, **data) -> common_pb2.KvCacheEvent:
        self._event_id += 1
        return common_pb2.KvCacheEvent(event_id=self._event_id, **data)

    def _kv_block(self, hash_value: bytes, block: _Block) -> common_pb2.KvBlock:
        return common_pb2.KvBlock(
            block_hash=block_hash_id(hash_value), token_ids=block.token_ids, block_size=self.block_size
        )

    # ---- out: subscriptions -------------------------------------------------------------------

    def subscribe(self, salt: str, start_sequence_number: int = 0) -> Subscription:
        """A subscription to the blocks of `salt` (see the module docstring); OutOfRange if it cannot resume."""
        self.flush()  # what happened before this call is in the view's state and history
        view = self._views.setdefault(salt, _View(salt))
        if start_sequence_number:
            initial = self._replay(view, start_sequence_number)
        else:
            initial = self._snapshot(view)
        subscription = Subscription(view, initial)
        view.subscribers.add(subscription)
        return subscription

    def _replay(self, view: _View, start: int) -> list[common_pb2.KvEventBatch]:
        if start > view.sequence_number:
            raise OutOfRange(
                f"start_sequence_number {start} is ahead of this scheduler's {view.sequence_number} "
                f"(it restarted): resubscribe from 0"
            )
        oldest = view.history[0].sequence_number if view.history else view.sequence_number + 1
        if start + 1 < oldest:
            raise OutOfRange(f"the batches after {start} are no longer kept (oldest {oldest}): resubscribe from 0")
        return [batch for batch in view.history if batch.sequence_number > start]

    def _snapshot(self, view: _View) -> list[common_pb2.KvEventBatch]:
        """The view's blocks now, parents first, in chunks numbered up to the view's sequence."""
        chunks: list[list[bytes]] = [[]]
        num_tokens = 0
        for hash_value in self._parents_first(view.salt):
            if num_tokens >= SNAPSHOT_CHUNK_TOKENS:
                chunks.append([])
                num_tokens = 0
            chunks[-1].append(hash_value)
            num_tokens += len(self._blocks[hash_value].token_ids)
        while view.sequence_number < len(chunks):  # numbers the chunks can take: others get empty batches
            view.append([])
        first = view.sequence_number - len(chunks) + 1
        num_blocks = sum(len(chunk) for chunk in chunks)
        batches = []
        for index, chunk in enumerate(chunks):
            events = [self._event(cleared=common_pb2.KvCacheCleared())] if index == 0 else []
            events += self._events_for([("stored", hash_value) for hash_value in chunk])
            batches.append(
                common_pb2.KvEventBatch(
                    sequence_number=first + index,
                    timestamp=time.time(),
                    events=events,
                    snapshot=common_pb2.KvSnapshotChunk(index=index, count=len(chunks), blocks=num_blocks),
                )
            )
        return batches

    def _parents_first(self, salt: str) -> list[bytes]:
        order: list[bytes] = []
        seen: set[bytes] = set()
        for hash_value, block in self._blocks.items():
            if block.salt != salt or hash_value in seen:
                continue
            chain = [hash_value]
            parent = block.parent
            while parent is not None and parent in self._blocks and parent not in seen:
                chain.append(parent)
                parent = self._blocks[parent].parent
            for link in reversed(chain):
                seen.add(link)
                order.append(link)
        return order

    def num_blocks(self, salt: str) -> int:
        """Blocks of `salt` cached in at least one executor."""
        return self._blocks_by_salt[salt]
