"""The online feed: hidden states asked of the engines ahead of the trainer, within a disk budget.

:class:`SampleFeed` runs in the trainer's main process (threads). The training loop tells it, at
the start of each pass over a split, the order in which the samples will be read
(:meth:`SampleFeed.plan`); ``prefetch`` fetcher threads then work down that order, each row
through :class:`~eagleflow.extract.row_fetch.RowFetcher` (the extractor's own protocol and
checks) on the least busy engine that is up, published by rename into ``ready/hs_{row}``. The
trainer's transfer (:mod:`~eagleflow.train.online.backend`) takes each file, loads it and deletes
it.

Disk: a row is sent only when the bytes of the samples sent and not yet consumed, plus its own,
fit in ``window_bytes`` (one row always may go), so dumps + ready samples never exceed the window
plus one sample. With ``cache_bytes`` > 0 the first samples that fit go to ``cache/`` instead and
stay for later epochs, which then ask the engines only for the rest.

Several drafters (:mod:`~eagleflow.train.online.share`): the lead's feed stages each fetched sample,
links it into every follower's ``ready/`` and then publishes its own; a sample's bytes count in the
window until every copy is taken.

Faults: an engine that goes away is passed over (its row goes to another engine) and probed
until it answers again; when no engine answers for ``engine_wait`` seconds, or a row fails for
good, or the disk is full, the feed stops and writes ``failed.json`` naming it, and the trainer
stops with that reason (a retry resumes from the last checkpoint). Every request sent is in a
journal until settled; :func:`settle_journal` (at the next start, or by the step when the
trainer exits) aborts what is left and removes its dumps, so a killed trainer leaves no request
running and no dump behind.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagleflow.engine import EngineClient, Readiness, RowFailed, ServerGone, ServerInfo, check_ready
from eagleflow.extract import DiskFull, RowFetcher, SampleShape, StoreUnreachable, handoff_for
from eagleflow.files import atomic_write_json
from eagleflow.progress import format_bytes
from eagleflow.train.online.journal import settle_journal
from eagleflow.train.online.settings import EngineEndpoint, FeedSettings, held_bytes
from eagleflow.train.online.share import Followers, Heartbeat, record_pass

PROBE_EVERY_S = 2.0  # a gone engine is asked again this often
MONITOR_EVERY_S = 0.05  # bytes on disk are sampled this often (the peak goes to status.json)
STATUS_EVERY_S = 1.0


class FeedFailed(Exception):
    """The feed cannot give the trainer its samples; the message names the engine, row or folder."""


class _Engine:
    def __init__(
        self, endpoint: EngineEndpoint, settings: FeedSettings, largest: int, stop: threading.Event, say: Callable[[str], None]
    ) -> None:
        self.endpoint = endpoint
        self.client = EngineClient(endpoint.url, settings.request_timeout)
        shape = SampleShape(settings.n_slots, settings.hidden_size, settings.hidden_states_dtype)
        handoff = handoff_for(endpoint.dump_dir, endpoint.sample_store, largest)
        self.fetcher = RowFetcher(self.client, handoff, shape, settings.dump_wait, settings.max_retries, stop, say=say)
        self.in_flight = 0
        self.down_since: float | None = None
        self.down_reason = ""
        self.next_probe = 0.0

    @property
    def label(self) -> str:
        return f"{self.endpoint.name} at {self.endpoint.url}"


class SampleFeed:
    """Fetches the planned rows ahead of the trainer; see the module docstring.

    :param rows_of: the dataset's ``input_ids`` of a row (read lazily: a big dataset's ids do not fit in memory).
    :param lengths: every row's token count (the ``seq_len`` column), for the byte budget.
    """

    def __init__(
        self, settings: FeedSettings, rows_of: Callable[[int], list[int]], lengths: list[int], say: Callable[[str], None] = print
    ) -> None:
        self.settings, self.layout, self.rows_of, self.lengths, self.say = settings, settings.layout, rows_of, lengths, say
        self._shape = SampleShape(settings.n_slots, settings.hidden_size, settings.hidden_states_dtype)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        largest = self._shape.file_bytes(max(lengths, default=1))  # what a store's reader must take whole
        self._unreachable = ""  # the run's sample store did not answer at the start: the trainer stops naming it
        try:
            self._engines = [_Engine(e, settings, largest, self._stop, say) for e in settings.engines]
        except StoreUnreachable as exc:
            self._engines, self._unreachable = [], str(exc)
        self._reserved = 0  # bytes of rows sent and not yet consumed (in flight, or waiting in ready/)
        self._awaiting: dict[int, int] = {}  # row -> bytes, published in ready/ and not yet consumed
        self._cached: dict[int, int] = {}  # row -> bytes, kept in cache/ (or on its way there)
        self._cache_reserved = 0
        # rid -> {row, rid, url, dump_dir, sample_store}: each request sent and not collected (an aborted retry's dump may still come)
        self._journal: dict[str, dict[str, Any]] = {}
        self._latest: dict[int, str] = {}  # row -> the rid of its attempt under way
        self._threads: list[threading.Thread] = []
        self.failure: str | None = None
        self.fetched = 0
        self.fetched_bytes = 0
        self.peak_bytes = 0
        self.data_wait_s = 0.0  # the trainer's wait for batches (added by the loader wrapper)
        self._started = time.monotonic()
        self._heartbeat = Heartbeat(self.layout, "lead" if settings.followers else "alone")
        self.followers = Followers(settings.followers, settings.peer_wait, say) if settings.followers else None
        self._passes = 0

    # --- life ------------------------------------------------------------------------
    def start(self) -> SampleFeed:
        """Settle what an earlier attempt left, then start the fetchers and the disk monitor."""
        layout = self.layout
        for folder in (layout.ready, layout.cache):
            folder.mkdir(parents=True, exist_ok=True)
        settle_journal(layout, self.say)
        layout.failure.unlink(missing_ok=True)
        if self._unreachable:
            self._fail(self._unreachable)
            return self
        for stale in [*layout.ready.iterdir(), *(layout.staging.iterdir() if layout.staging.exists() else [])]:
            stale.unlink(missing_ok=True)  # an earlier attempt's prefetch: its order is not this one's
        for stale in layout.passes.glob("*.json") if layout.passes.exists() else []:
            stale.unlink(missing_ok=True)
        if self.followers is not None:
            layout.staging.mkdir(parents=True, exist_ok=True)
            self.followers.reset()
        self._heartbeat.start()
        for cached in sorted(layout.cache.glob("hs_*.safetensors")):
            row = int(cached.name[3:].split(".")[0])
            self._cached[row] = cached.stat().st_size
        self._cache_reserved = sum(self._cached.values())
        for index in range(self.settings.prefetch):
            thread = threading.Thread(target=self._fetch_loop, name=f"feed-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        monitor = threading.Thread(target=self._monitor, name="feed-monitor", daemon=True)
        monitor.start()
        self._threads.append(monitor)
        names = ", ".join(e.label for e in self._engines)
        self.say(
            f"online feed: {self.settings.prefetch} samples ahead of the trainer from {names}; at most "
            f"{format_bytes(self.settings.window_bytes)} fetched ahead, cache {format_bytes(self.settings.cache_bytes)}"
            + (f" ({len(self._cached)} samples kept from before)" if self._cached else "")
        )
        return self

    def stop(self) -> None:
        """Stop fetching; abort what is in flight and remove its dumps; drop what the trainer did not take."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        clients = {e.endpoint.url: e.client for e in self._engines}
        for entry in list(self._journal.values()):
            clients[entry["url"]].abort(entry["rid"])
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._write_journal()
        settle_journal(self.layout, self.say)
        for leftover in [*self.layout.ready.glob("*"), *self.layout.staging.glob("*")]:
            leftover.unlink(missing_ok=True)
        self._write_status()
        self._heartbeat.stop()  # followers still take the links of the last pass; then they see it finished

    # --- what the trainer says ---------------------------------------------------------
    def plan(self, rows: list[int]) -> None:
        """The next rows the trainer will read, in its order (one pass over a split).

        With followers, each of them must read the pass alike: the trainer waits here for them
        (at most ``peer_wait``; one that differs or does not come is dropped).
        """
        if self.followers is not None:
            digest = record_pass(self.layout, self._passes, rows)
            self.followers.handshake(self._passes, digest, self._stop)
        self._passes += 1
        with self._cond:
            self._queue.extend(rows)
            self._cond.notify_all()

    def add_data_wait(self, seconds: float) -> None:
        self.data_wait_s += seconds

    def status(self) -> dict[str, Any]:
        return {
            "fetched": self.fetched,
            "fetched_bytes": self.fetched_bytes,
            "cached": len(self._cached),
            "cached_bytes": sum(self._cached.values()),
            "peak_bytes": self.peak_bytes,
            "window_bytes": self.settings.window_bytes,
            "cache_bytes": self.settings.cache_bytes,
            "data_wait_s": round(self.data_wait_s, 3),
            "seconds": round(time.monotonic() - self._started, 3),
            "failure": self.failure,
            "shared_with": sorted(self.followers.active) if self.followers is not None else [],
            "updated": time.time(),
        }

    # --- the fetchers ------------------------------------------------------------------
    def _next_row(self) -> tuple[int, Path, int] | None:
        """The next row to fetch with its target and bytes, once the budget allows; None when stopping."""
        with self._cond:
            while not self._stop.is_set():
                self._release_consumed()
                if self._queue:
                    row = self._queue[0]
                    if row in self._cached:
                        self._queue.popleft()
                        continue
                    ready = self.layout.sample(self.layout.ready, row)
                    size = self._size(row)
                    # One row may always go; else it must fit in the window. A row whose previous copy the
                    # trainer has not taken yet waits for it (the same file name), in order.
                    fits = self._reserved == 0 or self._reserved + size <= self.settings.window_bytes
                    if fits and row not in self._awaiting and not ready.exists():
                        self._queue.popleft()
                        self._reserved += size
                        if self._cache_reserved + size <= self.settings.cache_bytes:
                            self._cache_reserved += size
                            self._cached[row] = size  # a later pass reads it from the cache, waiting if need be
                            return row, self.layout.sample(self.layout.cache, row), size
                        staged = self.followers is not None and bool(self.followers.active)
                        return row, self.layout.sample(self.layout.staging, row) if staged else ready, size
                self._cond.wait(timeout=MONITOR_EVERY_S)
        return None

    def _size(self, row: int) -> int:
        return self._shape.file_bytes(self.lengths[row])

    def _release_consumed(self) -> None:
        """Give back the bytes of ready samples every trainer has taken (deleted). Under ``_cond``."""
        for row, size in list(self._awaiting.items()):
            ready = self.layout.sample(self.layout.ready, row)
            if not ready.exists() and not (self.followers is not None and self.followers.holding(ready.name)):
                del self._awaiting[row]
                self._reserved -= size

    def _fetch_loop(self) -> None:
        while not self._stop.is_set():
            job = self._next_row()
            if job is None:
                return
            row, target, size = job
            try:
                if not self._fetch(row, target):
                    return  # stopping
            except FeedFailed as exc:
                self._fail(str(exc))
                return
            if target.parent == self.layout.staging:  # hand it to every follower, then to this trainer
                assert self.followers is not None
                self.followers.hand(target, target.name)
                target.replace(self.layout.sample(self.layout.ready, row))
            with self._cond:
                if target.parent == self.layout.cache:
                    self._cached[row] = target.stat().st_size
                    self._reserved -= size
                else:
                    self._awaiting[row] = size
                self.fetched += 1
                self.fetched_bytes += size
                self._cond.notify_all()

    def _fetch(self, row: int, target: Path) -> bool:
        """Fetch one row from an engine that is up, another one when it goes away; False when the feed stops.

        :raises FeedFailed: no engine answers within ``engine_wait``, the row fails for good, or the disk is full.
        """
        ids = self.rows_of(row)
        while not self._stop.is_set():
            engine = self._choose_engine()
            if engine is None:
                return False
            try:
                engine.fetcher.fetch(row, ids, target, on_rid=lambda rid, e=engine: self._journal_rid(row, e, rid))
                return True
            # A request that did not end well stays in the journal: its dump may still come, and the
            # stop's settle_journal removes it once written.
            except ServerGone as exc:
                self._engine_down(engine, exc.reason)
            except DiskFull as exc:
                raise FeedFailed(f"row {row}: {exc.reason}") from exc
            except StoreUnreachable as exc:
                raise FeedFailed(f"row {row}: {exc}") from exc
            except RowFailed as exc:
                if self._stop.is_set():
                    return False
                raise FeedFailed(f"row {row}: {engine.label}: {exc.reason}") from exc
            finally:
                with self._cond:
                    engine.in_flight -= 1
        return False

    def _choose_engine(self) -> _Engine | None:
        """The least busy engine that is up (probing gone ones); waits while none is, up to ``engine_wait``."""
        while not self._stop.is_set():
            now = time.monotonic()
            for engine in self._engines:
                if engine.down_since is not None and now >= engine.next_probe:
                    engine.next_probe = now + PROBE_EVERY_S
                    # Ready, not merely answering: a restarted engine answers 503 through its warmup.
                    if check_ready(ServerInfo.at(engine.endpoint.url), timeout=PROBE_EVERY_S).state is Readiness.READY:
                        self.say(f"online feed: {engine.label} answers again after {now - engine.down_since:.0f}s")
                        engine.down_since = None
            with self._cond:
                up = [e for e in self._engines if e.down_since is None]
                if up:
                    engine = min(up, key=lambda e: e.in_flight)
                    engine.in_flight += 1
                    return engine
            since = min(e.down_since or now for e in self._engines)
            if now - since > self.settings.engine_wait:
                reasons = "; ".join(f"{e.label}: {e.down_reason}" for e in self._engines)
                raise FeedFailed(f"no engine answered for {self.settings.engine_wait:.0f}s (engine_wait): {reasons}")
            self._stop.wait(0.2)
        return None

    def _engine_down(self, engine: _Engine, reason: str) -> None:
        with self._cond:
            if engine.down_since is None:
                engine.down_since = time.monotonic()
                engine.next_probe = engine.down_since + PROBE_EVERY_S
                engine.down_reason = reason
                self.say(f"online feed: {engine.label} is gone ({reason}); its rows go to the other engines meanwhile")

    def _fail(self, reason: str) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = reason
                self.say(f"online feed stopped: {reason}")
                atomic_write_json(self.layout.failure, {"error": reason, "time": time.time()})
            self._stop.set()
            self._cond.notify_all()

    # --- the journal and the monitor ---------------------------------------------------
    def _journal_rid(self, row: int, engine: _Engine, rid: str | None) -> None:
        """``rid`` is about to be sent for ``row``; None: the row's last rid was collected (its files are gone)."""
        with self._cond:
            if rid is None:
                self._journal.pop(self._latest.pop(row, ""), None)
            else:
                self._latest[row] = rid
                endpoint = engine.endpoint
                self._journal[rid] = {
                    "row": row, "rid": rid, "url": endpoint.url, "dump_dir": str(endpoint.dump_dir), "sample_store": endpoint.sample_store,
                }
            self._write_journal()

    def _write_journal(self) -> None:
        atomic_write_json(self.layout.journal, dict(self._journal))

    def _monitor(self) -> None:
        dump_dirs = {e.endpoint.dump_dir for e in self._engines if not e.endpoint.sample_store}  # a store's samples are not on disk
        folders = [self.layout.ready, self.layout.staging, self.layout.cache, *dump_dirs]
        folders += self.followers.folders() if self.followers is not None else []
        next_status = 0.0
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, held_bytes(folders))
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                self._write_status()
                if self.followers is not None:
                    self.followers.check_alive()
            with self._cond:
                self._release_consumed()
                self._cond.notify_all()
            self._stop.wait(MONITOR_EVERY_S)

    def _write_status(self) -> None:
        try:
            atomic_write_json(self.layout.status, self.status())
        except OSError:
            pass  # a full disk must not hide the error that matters
