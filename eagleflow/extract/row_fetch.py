"""One row's hidden states from one engine: send, wait for the dump, check it, publish it by rename.

The one owner of docs/design.md §3.4's per-row protocol, used by both consumers of the capture:
extraction (:mod:`eagleflow.extract.shard`, which publishes into ``dataset/hidden_states/``)
and online training (:mod:`eagleflow.train.online.feed`, which publishes into the trainer's
ready folder and deletes each sample after use). For one row:

- POST ``/generate`` (prefill only) under a new rid (:func:`~sglang_patch.request_ids.row_request_id`);
- refuse an answer that reused cached prefix tokens or counted another prompt length;
- wait for ``<dump_dir>/<rid>.safetensors`` (or the sample in the run's store) under the **same**
  rid while the engine's writer holds it (:func:`~eagleflow.extract.dump_wait.wait_for_dump`,
  through :mod:`~eagleflow.extract.handoff_reader`);
- check it (header, token ids, the writer's finiteness verdict) and rename it to ``target``.

Retryable failures (5xx, timeouts, "writer behind") are tried again under the engine client's one
policy (:func:`~eagleflow.engine.client.with_retries`) after ``/abort_request`` of the old rid, so the engine never works on one row twice; a 4xx or a bad
dump is final for the row; :class:`~eagleflow.engine.client.ServerGone` and
:class:`~eagleflow.extract.dump_wait.DiskFull` are for the caller to act on (every row would
fail the same way), and so is :class:`~eagleflow.extract.handoff_reader.StoreUnreachable`. Whatever
happens, no dump or error file (or store key) of the row's rids is left behind.
"""

from __future__ import annotations

import errno
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from eagleflow.engine import AnswerLost, EngineClient, RowFailed, with_retries
from eagleflow.extract.dump_wait import DiskFull, wait_for_dump
from eagleflow.extract.handoff_reader import HandOff
from eagleflow.extract.sample_store import publish_dump, validate
from sglang_patch.request_ids import row_request_id
from sglang_patch.sample_format import HiddenStatesDtype, sample_file_bytes



@dataclass(frozen=True)
class SampleShape:
    """What a captured sample of this run holds: slots (aux ids + the final state), hidden size, storage dtype."""

    n_slots: int
    hidden_size: int
    dtype: HiddenStatesDtype

    def file_bytes(self, num_tokens: int) -> int:
        """Bytes of one sample file of ``num_tokens`` tokens."""
        return sample_file_bytes(num_tokens, self.n_slots, self.hidden_size, self.dtype)


class RowFetcher:
    """Fetches rows from one engine into files; thread-safe (one call per row at a time).

    :param client: the engine's client.
    :param handoff: where its capture hands the samples over (its dump folder, or the run's store).
    :param shape: the samples' shape and storage dtype.
    :param dump_wait: seconds without a live capture writer before a dump is given up.
    :param max_retries: retries of a row after a retryable failure ("writer behind" does not count).
    :param stop: set when the caller stops; every call then ends with ``RowFailed``.
    :param in_flight: bounds the requests the engine works on at once (answers, not dump waits).
    :param publish_guard: held while a dump is renamed into place (the caller checks ``stop``
        under it, so a stopped caller publishes nothing more).
    :param say: where progress notes go (the step's log).
    """

    def __init__(
        self,
        client: EngineClient,
        handoff: HandOff,
        shape: SampleShape,
        dump_wait: float,
        max_retries: int,
        stop: threading.Event,
        in_flight: AbstractContextManager[object] | None = None,
        publish_guard: AbstractContextManager[object] | None = None,
        say: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.client, self.handoff, self.shape = client, handoff, shape
        self.dump_wait, self.max_retries, self.stop = dump_wait, max_retries, stop
        self.in_flight = in_flight or nullcontext()
        self.publish_guard = publish_guard or nullcontext()
        self.say, self.sleep = say, sleep

    def fetch(self, row: int, ids: list[int], target: Path, on_rid: Callable[[str | None], None] | None = None) -> tuple[int, int]:
        """Fetch ``row`` into ``target``, retrying what may succeed; return ``(tokens, bytes)``.

        :param on_rid: told each rid before it is sent and None once it is settled (the online
            feed journals them, so a killed trainer's requests can be aborted by the next one).
        :raises RowFailed: the row failed for good (or the caller stopped).
        :raises ServerGone: the engine went away or hangs.
        :raises DiskFull: the engine's writer or the target's folder is out of space.
        """
        rid = ""

        def attempt() -> tuple[int, int]:
            nonlocal rid
            if self.stop.is_set():
                raise RowFailed("stopped")
            rid = row_request_id(row)
            if on_rid:
                on_rid(rid)
            result = self.fetch_once(row, ids, rid, target)
            if on_rid:
                on_rid(None)
            return result

        def before_retry(exc: RowFailed, delay: float) -> None:
            self.client.abort(rid)
            self.say(f"row {row}: {exc.reason}; retrying in {delay:.0f}s")

        return with_retries(attempt, self.max_retries, before_retry=before_retry, sleep=self.stop.wait)

    def fetch_once(self, row: int, ids: list[int], rid: str, target: Path) -> tuple[int, int]:
        """One attempt under ``rid``; the row's dump and error files are gone when it returns or raises."""
        try:
            try:
                with self.in_flight:
                    _, meta = self.client.generate(row, ids, rid=rid)
            except AnswerLost as exc:
                # The engine may have run it: its dump would still come. Wait for it under this rid.
                self.say(f"row {row}: {exc.reason}; waiting for its dump")
                meta = {}
            answered_at = time.time()
            cached = int(meta.get("cached_tokens", 0) or 0)
            if cached:
                raise RowFailed(f"engine reused {cached} cached prefix tokens (radix cache on?); states would be short")
            prompt_tokens = meta.get("prompt_tokens")
            if prompt_tokens is not None and int(prompt_tokens) != len(ids):
                raise RowFailed(f"engine counted {prompt_tokens} prompt tokens, the row has {len(ids)}")
            needed = self.shape.file_bytes(len(ids))
            dump = wait_for_dump(self.handoff, rid, answered_at, self.dump_wait, self.stop, self.say, self.sleep, needed, target)
            check = validate(
                dump, ids, self.shape.n_slots, self.shape.hidden_size, self.shape.dtype, trust_writer_verdict=True
            )
            if not check.ok:
                raise RowFailed(f"dump {dump.name} is not usable: {check.reason}")
            try:
                with self.publish_guard:
                    if self.stop.is_set():
                        raise RowFailed("stopped")
                    publish_dump(dump, target)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(
                        f"disk full: {target.parent} has {shutil.disk_usage(target.parent).free} bytes free, "
                        f"row {row} needs {check.num_bytes} bytes",
                        str(target.parent), check.num_bytes,
                    ) from exc
                raise
            return len(ids), check.num_bytes
        finally:
            self.handoff.discard(rid, target)
