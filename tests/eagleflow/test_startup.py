"""The start-up block: the cyclic collector paused inside, what the block made frozen after, the collector back."""

from __future__ import annotations

import gc
import weakref

from eagleflow.startup import collector_paused


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_inside_only_reference_counting_runs_and_after_it_the_blocks_objects_are_frozen_and_the_collector_is_back() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        kept = [Node() for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(kept), "the block's objects are out of every later collection"

    # Made after the block, garbage in a cycle is collected as usual.
    later = Node()
    gone = weakref.ref(later)
    del later
    assert gone() is not None, "reference counting alone cannot free a cycle"
    gc.collect()
    assert gone() is None


def test_a_nested_block_leaves_the_collector_to_the_outer_one_and_an_error_still_restarts_it() -> None:
    try:
        with collector_paused():
            with collector_paused():
                pass
            assert not gc.isenabled(), "the inner block restarted the collector inside the outer one"
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.isenabled()
