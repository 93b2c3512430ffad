"""Where a dump writer hands its samples, error records and status over: a folder, or a Mooncake Store.

:class:`FolderSink` is docs/design.md §3.4's hand-off folder (:mod:`sglang_patch.handoff`'s
files); :class:`StoreSink` the same hand-off through the run's Mooncake Store
(:mod:`sglang_patch.mooncake_store`), for an engine whose readers run on other nodes. The
:class:`~sglang_patch.dump_writer.DumpWriter` decides what to hand over; a sink only says where.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from sglang_patch.handoff import (
    TOO_LARGE,
    WRITE_FAILED,
    WRITER_BEHIND,
    ErrorRecord,
    WriterStatus,
    dump_path,
    reserve_path,
    status_path,
)
from sglang_patch.mooncake_store import (
    BUFFER_OVERFLOW,
    MIN_BUFFER_BYTES,
    NO_SPACE,
    MooncakeSampleStore,
    StoreAddress,
    StoreError,
    code_meaning,
    store_sample_limit,
)
from sglang_patch.sample_file import SlotMajor, encoded_sample_bytes, write_encoded_sample

RECORD_RESERVE_BYTES = 256 << 10  # kept free for the records that say the disk is full


class FolderSink:
    """The hand-off folder. It keeps a small reserve file and gives it up when the disk is full, so that
    the "disk full" record itself still fits."""

    def __init__(self, dump_dir: Path) -> None:
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self._reserve_space()

    def describe(self) -> str:
        return str(self.dump_dir)

    def free_bytes(self) -> int | None:
        """Room left for samples (None: the sink has no disk to fill)."""
        return shutil.disk_usage(self.dump_dir).free

    def write_sample(self, rid: str, tensors: Mapping[str, torch.Tensor | SlotMajor], metadata: Mapping[str, str]) -> None:
        write_encoded_sample(dump_path(self.dump_dir, rid), tensors, metadata, durable=False)

    def give_up_reserve(self) -> None:
        reserve_path(self.dump_dir).unlink(missing_ok=True)

    def write_record(self, record: ErrorRecord) -> None:
        """Write ``record``; on a full disk give up the reserve (if still there) and try once more."""
        try:
            record.write(self.dump_dir)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not reserve_path(self.dump_dir).exists():
                raise
            self.give_up_reserve()
            record.write(self.dump_dir)

    def write_status(self, status: WriterStatus) -> None:
        status.write(self.dump_dir)

    def close(self) -> None:
        status_path(self.dump_dir).unlink(missing_ok=True)
        self.give_up_reserve()

    def _reserve_space(self) -> None:
        try:
            with open(reserve_path(self.dump_dir), "wb") as handle:
                handle.write(b"\0" * RECORD_RESERVE_BYTES)
        except OSError:
            self.give_up_reserve()  # no room even for that: records may fail


class StorePutFailed(Exception):
    """The store refused a sample; ``kind`` is the error record's (writer behind, too large, write failed)."""

    def __init__(self, message: str, kind: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.kind, self.retryable = kind, retryable


class StoreSink:
    """The run's Mooncake Store. The writer lends it ``budget_bytes`` of memory (its segment), where the
    samples it puts stay until a reader takes them: what the engine holds stays within its byte budget
    twice over (queued, then published and unread), as the folder's disk bounded the second part."""

    def __init__(self, address: StoreAddress, budget_bytes: int) -> None:
        self.address = address
        # Mooncake refuses a segment under 16 MiB (setup returns -600): a tiny budget lends that much.
        segment = max(int(budget_bytes), MIN_BUFFER_BYTES)
        self.store = MooncakeSampleStore(address, segment_bytes=segment, buffer_bytes=store_sample_limit(budget_bytes))
        self._host, self._pid = socket.gethostname(), os.getpid()

    def describe(self) -> str:
        return f"{self.address.describe()} (namespace {self.address.namespace})"

    def free_bytes(self) -> int | None:
        return None

    def write_sample(self, rid: str, tensors: Mapping[str, torch.Tensor | SlotMajor], metadata: Mapping[str, str]) -> None:
        code = self.store.put(self.address.sample_key(rid), encoded_sample_bytes(tensors, metadata))
        if code == 0:
            return
        where = self.describe()
        if code == NO_SPACE:
            raise StorePutFailed(
                f"writer behind: {where} is full of samples not yet taken (the trainer is slower than the engine); "
                "send the request again later", WRITER_BEHIND, retryable=True,
            )
        if code == BUFFER_OVERFLOW:
            raise StorePutFailed(f"{where} refused the sample: {code_meaning(code)}; raise dump_queue_gb", TOO_LARGE)
        raise StorePutFailed(f"write failed: {where} refused the sample: {code_meaning(code)}", WRITE_FAILED)

    def give_up_reserve(self) -> None:
        pass

    def write_record(self, record: ErrorRecord) -> None:
        code = self.store.upsert(self.address.error_key(record.rid), json.dumps(asdict(record)).encode())
        if code != 0:
            raise StoreError(f"{self.describe()} refused the error record: {code_meaning(code)}", code)

    def write_status(self, status: WriterStatus) -> None:
        self.store.upsert(self.address.status_key(status.host, status.pid), json.dumps(asdict(status)).encode())

    def close(self) -> None:
        try:
            self.store.remove(self.address.status_key(self._host, self._pid))
        finally:
            self.store.close()


def sink_for(dump_dir: str | os.PathLike[str], sample_store: StoreAddress | None, budget_bytes: int) -> FolderSink | StoreSink:
    """The writer's sink: the run's store when it has one, else the hand-off folder."""
    return StoreSink(sample_store, budget_bytes) if sample_store is not None else FolderSink(Path(dump_dir))
