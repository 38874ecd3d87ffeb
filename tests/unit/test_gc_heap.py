"""A service freezes its startup heap: garbage is collected first, live objects are frozen."""

from __future__ import annotations

import gc
import weakref

from pagoda.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_garbage_is_collected_first_and_what_lives_is_frozen():
    gc.disable()  # no collection of its own between the two objects' making and the freeze
    try:
        dead, alive = _Node(), _Node()
        dead_ref = weakref.ref(dead)
        del dead
        assert dead_ref() is not None  # a cycle: still there until a collection
        frozen = freeze_startup_heap("test")
        assert dead_ref() is None  # collected, not frozen for good
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # frozen objects leave the generations
    finally:
        gc.unfreeze()
        gc.enable()
    assert any(o is alive for o in gc.get_objects())
