"""The hand-off folder between the capture (inside the engine) and the extractor: its files, defined once.

For each captured request ``rid`` exactly one of these appears in ``<dump_dir>``:

- ``<rid>.safetensors``: the sample (:mod:`sglang_patch.sample_file`), published by rename;
- ``<rid>.error.json``: why there is no sample, as an :class:`ErrorRecord`. Its ``kind`` tells
  the extractor what to do: :data:`WRITER_BEHIND` (send the row again later), :data:`DISK_FULL`
  (stop the shard: every row would fail), anything else (the row failed).

Beside them each live writer keeps ``.writer-<host>-<pid>.json`` (:class:`WriterStatus`),
rewritten about every second: the rids it holds and not yet wrote, its byte budget and the
peak it reached. That lets the extractor tell a late dump (its rid still queued: wait for it)
from a lost one (a fresh status without it: send again), without resending a row whose first
dump is still being written.

Standard library only: the hook imports this inside the SGLang server.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sglang_patch.file_mode import published_file_mode

DUMP_SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error.json"
STATUS_PREFIX = ".writer-"
STATUS_INTERVAL_S = 1.0  # a live writer rewrites its status at least this often
STATUS_STALE_S = 10.0  # older than this: the writer is gone (or its disk hangs)

# ErrorRecord kinds the extractor acts on.
WRITER_BEHIND = "writer_behind"
DISK_FULL = "disk_full"
NONFINITE = "nonfinite"
TOO_LARGE = "too_large"
PREFIX_REUSED = "prefix_reused"
CAPTURE_FAILED = "capture_failed"
WRITE_FAILED = "write_failed"


def dump_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    """Where the dump of request ``rid`` appears."""
    return Path(dump_dir) / f"{rid}{DUMP_SUFFIX}"


def error_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    """Where the error record of request ``rid`` appears instead of a dump."""
    return Path(dump_dir) / f"{rid}{ERROR_SUFFIX}"


@dataclass
class ErrorRecord:
    """Why request ``rid`` has no dump; ``retryable`` says whether sending it again can help."""

    rid: str
    error: str
    kind: str = WRITE_FAILED
    retryable: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def write(self, dump_dir: str | os.PathLike[str]) -> Path:
        return write_json(error_path(dump_dir, self.rid), asdict(self))

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ErrorRecord:
        """Load a record; a record of an older writer (``rid``/``error`` plus loose fields) is accepted."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ErrorRecord:
        known = {f.name for f in fields(cls)}
        details = dict(data.get("details") or {}) | {k: v for k, v in data.items() if k not in known}
        return cls(
            rid=str(data.get("rid", "")),
            error=str(data.get("error", "unknown error")),
            kind=str(data.get("kind", WRITE_FAILED)),
            retryable=bool(data.get("retryable", False)),
            details=details,
        )


@dataclass
class WriterStatus:
    """What one live dump writer holds; see the module docstring."""

    pid: int
    host: str
    started: float
    updated: float = 0.0
    pending: list[str] = field(default_factory=list)
    pending_bytes: int = 0
    budget_bytes: int = 0
    peak_pending_bytes: int = 0
    written: int = 0
    behind: int = 0
    failed: int = 0
    last_write: float | None = None

    @property
    def fresh(self) -> bool:
        return time.time() - self.updated < STATUS_STALE_S

    def write(self, dump_dir: str | os.PathLike[str]) -> Path:
        """Publish; ``updated`` is the time the snapshot was taken, not when it reached the disk."""
        return write_json(status_path(dump_dir, self.pid, self.host), asdict(self))


def status_path(dump_dir: str | os.PathLike[str], pid: int | None = None, host: str | None = None) -> Path:
    """``<dump_dir>/.writer-<host>-<pid>.json`` (this process's by default)."""
    return Path(dump_dir) / f"{STATUS_PREFIX}{host or socket.gethostname()}-{pid or os.getpid()}.json"


def reserve_path(dump_dir: str | os.PathLike[str]) -> Path:
    """A small file a writer keeps so that, when the disk fills up, it can still say so (see DumpWriter)."""
    return Path(dump_dir) / f"{STATUS_PREFIX}{socket.gethostname()}-{os.getpid()}.reserve"


def read_writer_statuses(dump_dir: str | os.PathLike[str]) -> list[WriterStatus]:
    """Every writer status in ``dump_dir`` (stale ones included: callers check ``fresh``)."""
    statuses = []
    known = {f.name for f in fields(WriterStatus)}
    for path in Path(dump_dir).glob(f"{STATUS_PREFIX}*.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            statuses.append(WriterStatus(**{k: v for k, v in data.items() if k in known}))
        except (OSError, ValueError, TypeError):
            continue  # replaced or removed while we read it
    return statuses


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Publish a small JSON file by rename. No fsync: hand-off files live minutes, not across a crash."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, published_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
