"""Several drafters trained online from one prefill: the lead's feed hands each sample to every trainer.

A run with several drafters and ``hidden_states_source=engine`` trains them side by side, one
trainer each. The first drafter's trainer is the *lead*: its :class:`~eagleflow.train.online.feed.SampleFeed`
asks the engines for each sample once per pass and hands it to every *follower* by a hard link into
the follower's ``ready/`` (same bytes on disk, one inode); a follower runs no fetcher, and its
trainer takes and deletes its link as a lone trainer does its file. The lead counts a sample in its
window until every copy is gone, so the disk holds at most the window, the cache (shared: a
follower reads the lead's ``cache/``) and one sample, whatever the number of drafters.

The protocol, through files in each trainer's feed folder (:class:`~eagleflow.layout.FeedLayout`):

- ``heartbeat.json``: each feed writes it every second while it runs, ``finished`` when it stops;
- ``passes/<k>.json``: the order of the trainer's pass ``k`` (a hash of the rows in order). At each
  pass the lead waits for every follower's same pass; a follower whose order differs (it resumed
  from another epoch), or that does not answer within ``peer_wait``, or whose heartbeat stops, is
  *dropped* (``dropped.json``, its links removed): sharing is an optimisation, never a reason to
  train on the wrong sample or to wait for ever;
- a follower joins only a lead that is running and has not gone past its first pass; else, or
  once dropped (its next try), it fetches alone as a lone trainer does.

Trainers that start together (the DAG's instances, each on a GPU slot) share every pass; after a
failure the retried trainer goes on alone while the other keeps running, paying the prefill twice
until both have finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json
from eagleflow.layout import FeedLayout

HEARTBEAT_EVERY_S = 1.0
HEARTBEAT_STALE_S = 30.0  # a feed silent this long is gone (killed, or its machine lost)
POLL_S = 0.05


def pass_hash(rows: Sequence[int]) -> str:
    """A short fingerprint of a pass's rows in order: two trainers read alike iff their hashes match."""
    return hashlib.sha256(json.dumps(list(rows)).encode()).hexdigest()[:16]


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def alive(layout: FeedLayout, stale_s: float = HEARTBEAT_STALE_S) -> bool:
    """Whether the feed in ``layout`` runs now (a fresh heartbeat, not finished)."""
    beat = read_json(layout.heartbeat)
    return bool(beat) and not beat.get("finished") and time.time() - float(beat.get("updated", 0)) < stale_s


def finished(layout: FeedLayout) -> bool:
    beat = read_json(layout.heartbeat)
    return bool(beat and beat.get("finished"))


def record_pass(layout: FeedLayout, index: int, rows: Sequence[int]) -> str:
    """Write pass ``index``'s order; return its hash."""
    digest = pass_hash(rows)
    layout.passes.mkdir(parents=True, exist_ok=True)
    atomic_write_json(layout.passes / f"{index}.json", {"hash": digest, "rows": len(rows), "time": time.time()})
    return digest


class Heartbeat:
    """Writes ``heartbeat.json`` every second from a thread; :meth:`stop` marks the feed finished."""

    def __init__(self, layout: FeedLayout, role: str) -> None:
        self.layout, self.role = layout, role
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="feed-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.layout.root.mkdir(parents=True, exist_ok=True)
        self._write(False)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._write(True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            self._write(False)

    def _write(self, done: bool) -> None:
        try:
            atomic_write_json(self.layout.heartbeat, {"role": self.role, "pid": os.getpid(), "updated": time.time(), "finished": done})
        except OSError:
            pass  # a full disk must not hide the error that matters


class Followers:
    """The lead's side: which followers take its samples, the handshake at each pass, the links, the drops.

    :param folders: each follower's feed folder, by drafter name.
    :param peer_wait: how long a pass waits for a follower before it is dropped.
    """

    def __init__(self, folders: dict[str, Path], peer_wait: float, say: Callable[[str], None]) -> None:
        self.layouts = {name: FeedLayout(folder) for name, folder in folders.items()}
        self.active = set(self.layouts)
        self.peer_wait, self.say = peer_wait, say
        self._lock = threading.Lock()

    def reset(self) -> None:
        """At the lead's start: what an earlier attempt left in the followers' folders goes."""
        for layout in self.layouts.values():
            layout.ready.mkdir(parents=True, exist_ok=True)
            for stale in [*layout.ready.iterdir(), *(layout.passes.glob("*.json") if layout.passes.exists() else [])]:
                stale.unlink(missing_ok=True)
            layout.dropped.unlink(missing_ok=True)

    def handshake(self, index: int, digest: str, stop: threading.Event) -> None:
        """Pass ``index`` of the lead (order ``digest``): wait for each active follower's same pass, dropping those that differ or do not come."""
        deadline = time.monotonic() + self.peer_wait
        waiting = set(self.active)
        while waiting and not stop.is_set():
            for name in sorted(waiting):
                layout = self.layouts[name]
                theirs = read_json(layout.passes / f"{index}.json")
                if theirs is not None:
                    waiting.discard(name)
                    if theirs.get("hash") != digest:
                        self.drop(name, f"it reads pass {index} in another order (it resumed from another epoch?)")
                elif index > 0 and not alive(layout):
                    waiting.discard(name)
                    self.drop(name, "its feed stopped")
            if waiting and time.monotonic() > deadline:
                for name in sorted(waiting):
                    self.drop(name, f"it did not start pass {index} within {self.peer_wait:.0f}s (online_peer_wait)")
                return
            if waiting:
                stop.wait(POLL_S)
        if index == 0 and self.active:
            self.say(f"online feed: handing every sample to {', '.join(sorted(self.active))} too (one prefill for all)")

    def drop(self, name: str, why: str) -> None:
        """Stop handing ``name`` samples; remove its links; tell it (its next try fetches alone)."""
        with self._lock:
            if name not in self.active:
                return
            self.active.discard(name)
        layout = self.layouts[name]
        atomic_write_json(layout.dropped, {"why": why, "time": time.time()})
        for link in layout.ready.glob("hs_*"):
            link.unlink(missing_ok=True)
        self.say(f"online feed: no longer handing samples to {name}: {why}; it fetches its own from its next try")

    def hand(self, staged: Path, name: str) -> None:
        """Link the staged sample ``name`` into every active follower's ``ready/``."""
        for follower in sorted(self.active):
            target = self.layouts[follower].ready / name
            try:
                os.link(staged, target)
            except FileExistsError:  # its earlier copy is still there: the same bytes, keep it
                pass
            except OSError as exc:
                self.drop(follower, f"its folder cannot take a link ({exc})")

    def holding(self, name: str) -> bool:
        """Whether an active follower still holds sample file ``name``."""
        return any((self.layouts[f].ready / name).exists() for f in list(self.active))

    def check_alive(self) -> None:
        """Drop a follower whose feed stopped (killed, or finished early): its links would hold the window for ever."""
        for name in sorted(self.active):
            layout = self.layouts[name]
            beat = read_json(layout.heartbeat)
            if beat is not None and not alive(layout):
                self.drop(name, "its feed stopped")

    def folders(self) -> list[Path]:
        return [layout.ready for layout in self.layouts.values()]


def join_lead(own: FeedLayout, lead: FeedLayout, wait: float, say: Callable[[str], None]) -> bool:
    """A follower's start: True to take the lead's samples, False to fetch alone (the lead finished, is gone, or is past its first pass)."""
    if own.dropped.exists():
        say(f"online feed: the lead dropped this trainer before ({(read_json(own.dropped) or {}).get('why')}); fetching alone")
        own.dropped.unlink(missing_ok=True)
        return False
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if finished(lead):
            break
        if alive(lead):
            if (lead.passes / "1.json").exists():
                say("online feed: the lead is past its first pass (this trainer started late, or restarted); fetching alone")
                return False
            return True
        time.sleep(POLL_S * 4)
    say("online feed: no lead feed is running; fetching alone")
    return False


class FollowerFeed:
    """A follower's side: no fetcher; it records each pass's order for the lead's handshake, beats, and keeps the figures."""

    def __init__(self, layout: FeedLayout, lead: FeedLayout, say: Callable[[str], None]) -> None:
        self.layout, self.lead, self.say = layout, lead, say
        self._heartbeat = Heartbeat(layout, "follower")
        self._passes = 0
        self._started = time.monotonic()
        self.failure: str | None = None
        self.data_wait_s = 0.0

    def start(self) -> FollowerFeed:
        self.layout.ready.mkdir(parents=True, exist_ok=True)
        self.layout.failure.unlink(missing_ok=True)
        self._heartbeat.start()
        self.say(f"online feed: taking the samples the lead's feed ({self.lead.root}) fetches; no request of its own")
        return self

    def plan(self, rows: list[int]) -> None:
        record_pass(self.layout, self._passes, rows)
        self._passes += 1

    def add_data_wait(self, seconds: float) -> None:
        self.data_wait_s += seconds

    def status(self) -> dict[str, Any]:
        return {"fetched": 0, "fetched_bytes": 0, "shared_from": str(self.lead.root), "data_wait_s": round(self.data_wait_s, 3),
                "seconds": round(time.monotonic() - self._started, 3), "failure": self.failure, "updated": time.time()}

    def stop(self) -> None:
        """Drop what the trainer did not take (the lead counts it held until then), say the figures, stop beating."""
        for leftover in self.layout.ready.glob("*"):
            leftover.unlink(missing_ok=True)
        try:
            atomic_write_json(self.layout.status, self.status())
        except OSError:
            pass
        self._heartbeat.stop()


def follower_wait_failure(own: FeedLayout, lead: FeedLayout) -> str | None:
    """Why a follower waiting for a sample will not get it: the lead failed, dropped it, finished or is gone; else None."""
    failed = read_json(lead.failure)
    if failed is not None:
        return f"the lead's feed stopped: {failed.get('error', 'unknown')}"
    dropped = read_json(own.dropped)
    if dropped is not None:
        return f"the lead no longer hands this trainer samples: {dropped.get('why')}"
    if finished(lead):
        return "the lead's training finished before this trainer's"
    beat = read_json(lead.heartbeat)
    if beat is not None and not alive(lead):
        return f"the lead's feed has been silent for over {HEARTBEAT_STALE_S:.0f}s (its trainer was killed?)"
    return None
