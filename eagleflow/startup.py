"""A process's start-up: its heavy imports and loads without the cyclic garbage collector.

torch, transformers, datasets and speculators build a million or more objects at import, and
they live as long as the process. While they are built, the cyclic collector walks the growing
heap again and again for garbage that is not there: measured on 2 cores, a sixth to a fifth of
the CPU of a step's start-up (importing speculators' trainer: 7.2 -> 5.6 CPU-s; torch with a
transformers model class: 4.3 -> 3.4). Every step, engine and trainer rank pays it.

:func:`collector_paused` pauses the collector over such a block, then freezes what the block
made (``gc.freeze``): later collections skip it too, for the life of the process, and so does
the one at exit. Only reference counting runs inside the block, so it is for imports and loads,
not for a step's work. The few cycles the block left unreachable are frozen with the rest
rather than collected: 16,000 objects beside the 600,000 speculators' import keeps, where one
collection to free them would cost 0.4 CPU-s, a third of what the pause saves.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def pause_collector() -> bool:
    """Stop the cyclic collector; True when this call stopped it (it was running), for :func:`resume_collector`."""
    running = gc.isenabled()
    gc.disable()
    return running


def resume_collector(paused: bool) -> None:
    """Freeze what exists (never walked again) and restart the collector, if ``paused`` says we stopped it."""
    if not paused:
        return  # an outer block (or the host) stopped it; it resumes there
    gc.freeze()
    gc.enable()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block (imports, loading a model or tokenizer) with the collector paused, then freeze its objects."""
    paused = pause_collector()
    try:
        yield
    finally:
        resume_collector(paused)
