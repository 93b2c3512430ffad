"""The reader's side of the hand-off: the engine's dump folder, or the run's Mooncake Store.

Every consumer of the capture (extraction, the capture check, the online feed and the journals
that clean up after them) reads through one of these, so the per-row protocol
(:mod:`eagleflow.extract.dump_wait`, :mod:`eagleflow.extract.row_fetch`) is written once for both
transports:

- :class:`FolderHandOff`: docs/design.md §3.4's folder, ``<rid>.safetensors`` and ``<rid>.error.json``;
- :class:`StoreHandOff`: the same hand-off through Mooncake (:mod:`sglang_patch.mooncake_store`).
  A sample is read whole into a dot-named part file beside where it will be published, checked
  there like a dump, then renamed into place; a sample that cannot be read whole (its engine
  died, the master went away) is never published: the row fails as retryable, and the master's
  absence stops the caller naming it (:class:`StoreUnreachable`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol

from eagleflow.engine import RowFailed
from sglang_patch.handoff import ErrorRecord, WriterStatus, dump_path, error_path, read_writer_statuses
from sglang_patch.mooncake_store import (
    MIN_BUFFER_BYTES,
    RPC_FAILED,
    STATUS_MARK,
    MooncakeSampleStore,
    StoreAddress,
    StoreError,
)


class StoreUnreachable(Exception):
    """The run's sample store does not answer: every row would fail the same way (names the master)."""


class HandOff(Protocol):
    """What the per-row protocol reads; see the module docstring."""

    def describe(self) -> str: ...
    def sample_name(self, rid: str) -> str: ...
    def has_sample(self, rid: str) -> bool: ...
    def error_record(self, rid: str) -> ErrorRecord | None: ...
    def statuses(self) -> list[WriterStatus]: ...
    def free_bytes(self) -> int | None: ...
    def local_copy(self, rid: str, beside: Path) -> Path: ...
    def discard(self, rid: str, beside: Path | None = None) -> None: ...


class FolderHandOff:
    """The engine's dump folder (shared with the reader's node)."""

    def __init__(self, dump_dir: Path) -> None:
        self.dump_dir = Path(dump_dir)

    def describe(self) -> str:
        return str(self.dump_dir)

    def sample_name(self, rid: str) -> str:
        return dump_path(self.dump_dir, rid).name

    def has_sample(self, rid: str) -> bool:
        return dump_path(self.dump_dir, rid).exists()

    def error_record(self, rid: str) -> ErrorRecord | None:
        path = error_path(self.dump_dir, rid)
        return ErrorRecord.read(path) if path.exists() else None

    def statuses(self) -> list[WriterStatus]:
        return read_writer_statuses(self.dump_dir)

    def free_bytes(self) -> int | None:
        return shutil.disk_usage(self.dump_dir).free

    def local_copy(self, rid: str, beside: Path) -> Path:
        """The dump itself: it is already a file here."""
        return dump_path(self.dump_dir, rid)

    def discard(self, rid: str, beside: Path | None = None) -> None:
        """Remove exactly this request's files (never a row's others)."""
        dump_path(self.dump_dir, rid).unlink(missing_ok=True)
        error_path(self.dump_dir, rid).unlink(missing_ok=True)


_clients: dict[str, MooncakeSampleStore] = {}
_clients_lock = threading.Lock()


def store_client(address: StoreAddress, buffer_bytes: int) -> MooncakeSampleStore:
    """This process's reader of ``address`` (it lends the store no memory), with a transfer buffer of at least ``buffer_bytes``."""
    key = address.to_json()
    with _clients_lock:
        client = _clients.get(key)
        if client is None or client.buffer_bytes < buffer_bytes:
            try:
                client = _clients[key] = MooncakeSampleStore(address, segment_bytes=0, buffer_bytes=buffer_bytes)
            except StoreError as exc:
                raise StoreUnreachable(str(exc)) from exc
        return client


class StoreHandOff:
    """The run's Mooncake Store.

    :param buffer_bytes: the largest sample this reader will take (its transfer buffer).
    """

    def __init__(self, address: StoreAddress, buffer_bytes: int = MIN_BUFFER_BYTES) -> None:
        self.address = address
        self.store = store_client(address, buffer_bytes)

    def describe(self) -> str:
        return f"{self.address.describe()} (namespace {self.address.namespace})"

    def sample_name(self, rid: str) -> str:
        return self.address.sample_key(rid)

    def has_sample(self, rid: str) -> bool:
        return self._asked(self.store.exists, self.address.sample_key(rid))

    def error_record(self, rid: str) -> ErrorRecord | None:
        data = self._asked(self.store.get, self.address.error_key(rid))
        if data is None:
            return None
        return ErrorRecord.from_dict(json.loads(data))

    def statuses(self) -> list[WriterStatus]:
        known = {f.name for f in fields(WriterStatus)}
        statuses = []
        for key in self._asked(self.store.keys, f"{self.address.namespace}/{STATUS_MARK}"):
            try:
                data: dict[str, Any] = json.loads(self.store.get(key) or b"")
                statuses.append(WriterStatus(**{k: v for k, v in data.items() if k in known}))
            except (StoreError, ValueError, TypeError):
                continue  # its writer closed while we listed
        return statuses

    def free_bytes(self) -> int | None:
        return None

    def local_copy(self, rid: str, beside: Path) -> Path:
        """The sample read whole into ``.<beside name>.<rid>.part`` beside ``beside`` (removed by :meth:`discard`)."""
        try:
            data = self._asked(self.store.get, self.address.sample_key(rid))
        except StoreError as exc:  # its engine died while we read: nothing of it is kept
            raise RowFailed(f"sample {rid} could not be read whole from {self.describe()}: {exc}", retryable=True) from exc
        if data is None:
            raise RowFailed(f"sample {rid} left {self.describe()} before it was read (its engine went away?)", retryable=True)
        part = self._part(rid, beside)
        part.write_bytes(data)  # dot-named: no reader globs for it; published by rename once checked
        return part

    def discard(self, rid: str, beside: Path | None = None) -> None:
        for key in (self.address.sample_key(rid), self.address.error_key(rid)):
            try:
                self.store.remove(key)
            except StoreError:
                pass  # a gone master took its keys with it
        if beside is not None:
            self._part(rid, beside).unlink(missing_ok=True)

    def _part(self, rid: str, beside: Path) -> Path:
        return Path(beside).parent / f".{Path(beside).name}.{rid}.part"

    def _asked(self, call: Any, key: str) -> Any:
        try:
            return call(key)
        except StoreError as exc:
            if exc.code == RPC_FAILED:
                raise StoreUnreachable(f"{self.describe()} does not answer: {exc}") from exc
            raise


def handoff_for(dump_dir: str | os.PathLike[str] | None, sample_store: str | dict[str, Any] | None, buffer_bytes: int = 0) -> HandOff:
    """The hand-off an engine writes to: its store when it has one (an address as JSON or a mapping), else its folder."""
    if sample_store:
        return StoreHandOff(StoreAddress.parse(sample_store), buffer_bytes)  # the client raises it to its minimum
    if dump_dir is None:
        raise ValueError("a hand-off needs a dump folder or a sample store")
    return FolderHandOff(Path(dump_dir))


__all__ = ["FolderHandOff", "HandOff", "StoreHandOff", "StoreUnreachable", "handoff_for", "store_client"]
