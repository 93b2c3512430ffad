"""One forward pass at a time, and SGLang's ``/abort_request`` for requests still waiting their turn."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any


class FairLock:
    """A lock handed to its waiters in the order they came (a bare ``threading.Lock`` can go straight
    back to the thread that released it, so a request waiting between another's decode steps could
    wait for all of them)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Event] = deque()

    def acquire(self) -> None:
        with self._guard:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._waiters.append(turn)
        turn.wait()  # release() hands the lock over: it stays held, now by us

    def release(self) -> None:
        with self._guard:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._held = False

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class ForwardTurns:
    """The reference engine's forward lock, with the rids queued on it.

    ``abort(rid)`` marks a request that has not started its forward pass; ``turn(rid)`` then
    yields True and the request is answered as aborted instead of run (a running or finished
    request is not affected, as in SGLang).
    """

    def __init__(self) -> None:
        self.lock = FairLock()  # one forward at a time; requests queue on it, in order
        self._guard = threading.Lock()
        self._waiting: set[str] = set()
        self._aborted: set[str] = set()

    def abort(self, rid: str) -> None:
        with self._guard:
            if rid in self._waiting:
                self._aborted.add(rid)

    def pause(self) -> None:
        """Inside a turn: let every request already waiting run its forward, then continue."""
        self.lock.release()
        self.lock.acquire()

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
