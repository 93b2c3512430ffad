"""Waiting for one request's dump in the hand-off folder: late, lost, writer behind, disk full.

The engine answers when its forward pass is done; its writer publishes the dump later, when
the disk gets to it (on a slow disk, long after the answer). For request ``rid``:

- ``<rid>.safetensors`` appears: done;
- ``<rid>.error.json`` appears: a :class:`RowFailed` (retryable as its kind says; "writer
  behind" does not use up a retry), or :class:`DiskFull`, which stops the shard: every row
  would fail the same way;
- neither yet: keep waiting on the **same** rid while a live writer holds it (its status file
  lists it), however long that takes; a slow disk is no reason to send the row again and write
  it twice. The row is sent again only when a live writer's status, taken after the answer,
  does not hold it (the engine restarted, or the request never reached the capture), and the
  shard aborts the old rid before it does;
- no live writer at all after ``--dump-wait``: the capture is not writing to this folder;
- the writer holds it but cannot even rewrite its status, and the folder has no room for the
  dump: :class:`DiskFull` (the writer's own record did not fit either).

The status files are :mod:`sglang_patch.handoff`'s; this module only reads them, through the
reader's hand-off (:mod:`eagleflow.extract.handoff_reader`: the folder, or the run's sample store).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from eagleflow.engine import RowFailed
from eagleflow.files import pid_alive
from eagleflow.extract.handoff_reader import FolderHandOff, HandOff
from eagleflow.progress import format_bytes, format_gb
from sglang_patch.handoff import (
    DISK_FULL,
    TOO_LARGE,
    WRITER_BEHIND,
    ErrorRecord,
    WriterStatus,
    read_writer_statuses,
    status_path,
)

CLOCK_MARGIN_S = 1.0  # a remote engine's clock may differ from ours by this much
POLL_MAX_S = 0.02  # a dump is noticed at most this long after it appears
STATUS_POLL_S = 0.5  # the writers rewrite their statuses about this often
# How the engine's writer prints byte counts in its records: GB with two decimals ("0.00 GB" below 5 MB).
_GB = r"\d+(?:\.\d+)?"


class DiskFull(Exception):
    """The engine's writer (or our publishing) ran out of space; ``reason`` names the folder and bytes."""

    def __init__(self, reason: str, folder: str = "", needed_bytes: int | None = None, free_bytes: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.folder, self.needed_bytes, self.free_bytes = reason, folder, needed_bytes, free_bytes


def wait_for_dump(
    handoff: HandOff,
    rid: str,
    answered_at: float,
    dump_wait: float,
    stop: threading.Event,
    say: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
    needed_bytes: int = 0,
    beside: Path | None = None,
) -> Path:
    """Return the dump of ``rid`` as a file here once it is published; raise :class:`RowFailed` or :class:`DiskFull`.

    :param answered_at: ``time.time()`` when the answer came (or was lost).
    :param needed_bytes: the dump's size, for telling a full disk from a slow one.
    :param dump_wait: seconds without any live writer before giving up, and between "still
        queued" lines.
    :param stop: set when the shard stops (then this raises at once).
    :param beside: where the sample will be published: a store's sample is read into a part file
        beside it (:meth:`~eagleflow.extract.handoff_reader.HandOff.local_copy`).
    """
    delay = 0.002
    next_note = answered_at + dump_wait
    next_status = 0.0
    while True:
        # Two stats per poll; the writers' statuses (a listing and a JSON each) only twice a second.
        statuses = None
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + STATUS_POLL_S
            statuses = handoff.statuses()  # before the files: a rid leaves a status only once its file exists
        record = handoff.error_record(rid)
        if record is not None:
            raise_for_record(record)
        if handoff.has_sample(rid):
            return handoff.local_copy(rid, beside or Path(".") / rid)
        if stop.is_set():
            raise RowFailed("stopped")
        if statuses is not None:
            next_note = _judge(statuses, handoff, rid, answered_at, dump_wait, next_note, needed_bytes, say)
        sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


def _judge(
    statuses: list[WriterStatus], handoff: HandOff, rid: str, answered_at: float, dump_wait: float,
    next_note: float, needed_bytes: int, say: Callable[[str], None],
) -> float:
    """Neither file exists yet: decide from the writers' statuses whether to keep waiting; return the next note's time."""
    now = time.time()
    live = [s for s in statuses if s.fresh or _alive_here(s)]
    holders = [s for s in live if rid in s.pending]
    if not holders:
        if any(s.fresh and s.updated > answered_at + CLOCK_MARGIN_S for s in live):
            raise RowFailed(
                f"the engine's dump writer does not hold {rid} (the engine restarted, or the request never "
                "reached the capture); sending the row again",
                retryable=True,
            )
        if not live and now > answered_at + dump_wait:
            raise RowFailed(
                f"no dump {handoff.sample_name(rid)} in {handoff.describe()} within {dump_wait:.0f}s of the answer and no "
                "live capture writer there (is the capture hook on, and is --dump-dir the engine's dump folder?)",
                retryable=True,
            )
    elif now >= next_note:
        free = handoff.free_bytes()
        if not any(s.fresh for s in holders) and free is not None and free < needed_bytes:
            raise DiskFull(
                f"disk full: {handoff.describe()} has {free} bytes free, the dump of {rid} needs {needed_bytes} bytes "
                "(the engine's writer cannot even update its status there)",
                handoff.describe(), needed_bytes, free,
            )
        say(_queued_note(rid, holders[0], now - answered_at))
        return now + dump_wait
    return next_note


def record_reason(record: ErrorRecord) -> str:
    """The engine's reason, its byte counts in units that show them (the record's details carry the bytes).

    The writer prints GB with two decimals, so a budget below one sample of a small model read "needs
    0.00 GB of dump buffer, more than the whole budget of 0.00 GB".
    """
    details, text = record.details, record.error
    budget = details.get("budget_bytes")
    if not isinstance(budget, int):
        return text
    needed, queued = details.get("needed_bytes"), details.get("queued_bytes")
    if record.kind == TOO_LARGE and isinstance(needed, int):
        text = re.sub(rf"needs {_GB} GB", f"needs {format_bytes(needed)}", text, count=1)
        text = re.sub(rf"budget of {_GB} GB", f"budget of {format_bytes(budget)}", text, count=1)
        at_least = f"{format_gb(needed)} GB"
        return f"{text} to at least {at_least}" if text.endswith("dump_queue_gb)") else f"{text} (dump_queue_gb: at least {at_least})"
    if record.kind == WRITER_BEHIND and isinstance(queued, int):
        return re.sub(rf"{_GB} of {_GB} GB", f"{format_bytes(queued)} of {format_bytes(budget)}", text, count=1)
    return text


def raise_for_record(record: ErrorRecord) -> None:
    """Turn the engine's error record into what the shard does about it."""
    reason = f"engine reported: {record_reason(record)}"
    if record.kind == DISK_FULL:
        details = record.details
        raise DiskFull(reason, str(details.get("folder", "")), details.get("needed_bytes"), details.get("free_bytes"))
    if record.kind == WRITER_BEHIND:
        raise RowFailed(reason, retryable=True, counts=False)
    raise RowFailed(reason, retryable=record.retryable)


def remove_dead_writer_statuses(handoff: HandOff) -> None:
    """Status files of writers on this host whose process is gone (an engine killed with SIGKILL).

    A store's statuses need no such care: a killed writer's status left in the store goes stale and
    is passed over as any stale status is."""
    if not isinstance(handoff, FolderHandOff):
        return
    dump_dir = handoff.dump_dir
    for status in read_writer_statuses(dump_dir):
        if status.host == socket.gethostname() and not pid_alive(status.pid):
            status_path(dump_dir, status.pid, status.host).unlink(missing_ok=True)


def _alive_here(status: WriterStatus) -> bool:
    """A stale status of a writer whose process still runs here: its disk hangs, it is not gone."""
    return status.host == socket.gethostname() and status.pid != os.getpid() and pid_alive(status.pid)


def _queued_note(rid: str, status: WriterStatus, waited: float) -> str:
    age = time.time() - status.updated
    stuck = f"; its status is {age:.0f}s old (disk hung?)" if not status.fresh else ""
    return (
        f"{rid}: dump still queued in the engine's writer after {waited:.0f}s ({len(status.pending)} requests, "
        f"{format_bytes(status.pending_bytes)} of {format_bytes(status.budget_bytes)} held{stuck}); waiting, not resending"
    )
