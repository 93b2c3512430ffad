"""One forward pass at a time, and SGLang's ``/abort_request`` for requests still waiting their turn."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ForwardTurns:
    """The reference engine's forward lock, with the rids queued on it.

    ``abort(rid)`` marks a request that has not started its forward pass; ``turn(rid)`` then
    yields True and the request is answered as aborted instead of run (a running or finished
    request is not affected, as in SGLang).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one forward at a time; requests queue on it
        self._guard = threading.Lock()
        self._waiting: set[str] = set()
        self._aborted: set[str] = set()

    def abort(self, rid: str) -> None:
        with self._guard:
            if rid in self._waiting:
                self._aborted.add(rid)

    @contextlib.contextmanager
    def turn(self, rid: str) -> Iterator[bool]:
        """Hold the forward lock for ``rid``; yields True when it was aborted while it waited."""
        with self._guard:
            self._waiting.add(rid)
        try:
            self.lock.acquire()
        finally:
            with self._guard:
                self._waiting.discard(rid)
                aborted = rid in self._aborted
                self._aborted.discard(rid)
        try:
            yield aborted
        finally:
            self.lock.release()
