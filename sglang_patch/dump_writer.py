"""Writes captured hidden states to the hand-off folder off the forward path, within a byte budget.

Used by both capture paths: the SGLang forward hook (inside the server's model-runner
process) and eagleflow's reference engine. What it guarantees the engine:

- **Bounded host memory.** Every request reserves the bytes its host buffer holds before any
  host buffer is taken; reservations never exceed ``max_pending_bytes``. Pinned memory for
  CUDA tensors is allocated only after the reservation. fp8 is quantised where the states are
  (:func:`~sglang_patch.sample_file.quantize_fp8_into`, the same code for CPU and CUDA tensors):
  states handed over whole (:meth:`DumpWriter.submit`) at once, the hook's layer-by-layer
  dumps (:meth:`DumpWriter.begin`) after their last slot, from a staging tensor on the states'
  device (one fp8 scale covers every slot of a token). Only the fp8 bytes and the scales cross to
  the host and count; no writer thread quantises anything.
- **A forward pass never stalls on the disk.** When the budget stays full for ``wait_seconds``
  the request gets a :data:`~sglang_patch.handoff.WRITER_BEHIND` error record instead (the
  extractor sends it again later), so rank 0 never blocks long inside a pass while the other
  tensor-parallel ranks wait in NCCL.
- **Nothing non-finite is written.** The finiteness check runs where the tensor already is (on
  the GPU before the copy, in the fp8 quantiser on either device, or in a writer thread for CPU
  bf16 tensors) and its verdict goes into the file's metadata, so the extractor reads back only
  the header and the token ids.
- **Atomic files, no per-file fsync.** Dumps are published by rename; the extractor makes the
  final files durable once per shard.

A request that cannot give a complete dump gets ``<rid>.error.json`` (:class:`ErrorRecord`);
a status file says what is still queued (:mod:`sglang_patch.handoff`). With a sample store
(:mod:`sglang_patch.mooncake_store`) samples, records and status go there instead of the folder
(:mod:`sglang_patch.handoff_sink` says where).
"""

from __future__ import annotations

import errno
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from sglang_patch.finite import all_finite_cpu, finite_on_device, nonfinite_report, nonfinite_slots_report
from sglang_patch.handoff import (
    DISK_FULL,
    NONFINITE,
    STATUS_INTERVAL_S,
    TOO_LARGE,
    WRITE_FAILED,
    WRITER_BEHIND,
    ErrorRecord,
    WriterStatus,
)
from sglang_patch.handoff_sink import RECORD_RESERVE_BYTES, StorePutFailed, sink_for
from sglang_patch.mooncake_store import StoreAddress, store_sample_limit
from sglang_patch.sample_file import (
    HIDDEN_STATES_KEY,
    SCALES_DTYPE,
    SCALES_KEY,
    STORAGE_DTYPES,
    TOKEN_IDS_KEY,
    VALUES_FINITE,
    VALUES_KEY,
    SlotMajor,
    decode_hidden_states,
    encode_hidden_states,
    encode_sample,
    quantize_fp8_into,
    sample_file_bytes,
)
from sglang_patch.pending_dump import Job, PendingDump, host_bytes
from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HiddenStatesDtype, check_hidden_states_dtype

DEFAULT_WAIT_SECONDS = 2.0
DEFAULT_WRITER_THREADS = 2
_MEMORY_SHARE = 8  # default budget: this share of the host's memory ...
_BUDGET_CAP = 32 << 30  # ... at most 32 GiB (pinned memory is locked memory)
_BUDGET_FLOOR = 256 << 20


def _fp8_host_buffers(seq_len: int, n_slots: int, hidden: int, pinned: bool) -> dict[str, torch.Tensor]:
    """Host memory for one request's fp8 values and scales (pinned when they come from a GPU)."""
    return {
        HIDDEN_STATES_KEY: torch.empty((seq_len, n_slots, hidden), dtype=STORAGE_DTYPES["fp8"], pin_memory=pinned),
        SCALES_KEY: torch.empty((seq_len, 1, 1), dtype=SCALES_DTYPE, pin_memory=pinned),
    }


def default_queue_budget() -> int:
    """Bytes of captured-but-unwritten dumps an engine may hold: 1/8 of the host's memory, 256 MiB–32 GiB."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 8 << 30
    return int(min(max(memory // _MEMORY_SHARE, _BUDGET_FLOOR), _BUDGET_CAP))


class DumpWriter:
    """Background writer of per-request dumps and error records; see the module docstring.

    :param dump_dir: folder the files appear in (created if missing).
    :param max_pending_bytes: budget of reserved, not yet written bytes (None: :func:`default_queue_budget`).
    :param wait_seconds: how long a request may wait for budget before it gets "writer behind".
    :param threads: writer threads (files are independent; more than one keeps a disk busy).
    :param write_delay: TEST ONLY: seconds each dump write sleeps first (a slow disk, for real queues).
    :param hidden_states_dtype: storage dtype of the dumps (``bf16`` or ``fp8``).
    :param sample_store: hand the samples over through this Mooncake Store instead of ``dump_dir``.
    """

    def __init__(
        self,
        dump_dir: str | os.PathLike[str],
        max_pending_bytes: int | None = None,
        wait_seconds: float = DEFAULT_WAIT_SECONDS,
        threads: int = DEFAULT_WRITER_THREADS,
        write_delay: float = 0.0,
        hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
        sample_store: StoreAddress | None = None,
    ) -> None:
        self.hidden_states_dtype = check_hidden_states_dtype(hidden_states_dtype)
        self.dump_dir = Path(dump_dir)
        self.budget = int(max_pending_bytes or default_queue_budget())
        self.sink = sink_for(self.dump_dir, sample_store, self.budget)
        # What one request may hold: the budget, and with a store its transfer buffer too.
        self.largest_sample = self.budget if sample_store is None else store_sample_limit(self.budget)
        self.wait_seconds = wait_seconds
        self.write_delay = write_delay
        self._cond = threading.Condition()
        self._reserved: dict[str, int] = {}
        self._status = WriterStatus(pid=os.getpid(), host=socket.gethostname(), started=time.time(), budget_bytes=self.budget)
        self._unwritten_records: dict[str, int] = {}  # rid -> records queued, not yet on disk
        self._errors: list[str] = []
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._records: queue.Queue[ErrorRecord | None] = queue.Queue()
        self._closed = False
        self.sink.write_status(self.status())  # at once: an extractor must not take a silent start for "no writer"
        self._threads = [threading.Thread(target=self._write_loop, name=f"hs-dump-writer-{i}", daemon=True) for i in range(threads)]
        self._threads.append(threading.Thread(target=self._record_loop, name="hs-dump-records", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- the capture's side --------------------------------------------------------------

    def begin(
        self,
        rid: str,
        seq_len: int,
        n_slots: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device | str,
        deadline: float | None = None,
    ) -> PendingDump | None:
        """Reserve budget and the buffers of one request filled slot by slot; None when it got an error record.

        bf16: a slot-major host buffer (pinned for CUDA states). fp8: a staging tensor on
        ``device`` in the model's ``dtype``, quantised there at commit, and host buffers for the
        fp8 bytes and scales alone: what the budget counts, since the staging lives only until
        the pass's last captured layer (or the request's cancel).

        :param dtype: the dtype the model computes the states in.
        :param device: where the states are.
        :param deadline: ``time.monotonic()`` after which not to wait for budget (a pass of many
            requests waits ``wait_seconds`` in all, not per request).
        """
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        stored = sample_file_bytes(seq_len, n_slots, hidden, self.hidden_states_dtype)
        fp8 = self.hidden_states_dtype == "fp8"
        num_bytes = stored if fp8 else host_bytes(seq_len * n_slots * hidden, STORAGE_DTYPES["bf16"], seq_len)
        if not self._reserve(rid, num_bytes, deadline):
            return None
        if fp8:
            staging = torch.empty((n_slots, seq_len, hidden), dtype=dtype, device=device)  # slot-major: contiguous puts
            encoded = _fp8_host_buffers(seq_len, n_slots, hidden, pinned=on_cuda)
            return PendingDump(self, rid, num_bytes, stored, None, slot_major=False, on_cuda=on_cuda, encoded=encoded, staging=staging)
        host = torch.empty((n_slots, seq_len, hidden), dtype=STORAGE_DTYPES["bf16"], pin_memory=on_cuda)
        return PendingDump(self, rid, num_bytes, stored, host, slot_major=True, on_cuda=on_cuda)

    def submit(self, rid: str, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> bool:
        """Queue ``[seq_len, n_slots, hidden]`` states and ``[seq_len]`` ids of request ``rid``.

        fp8 states are quantised here, where they are, and only the fp8 bytes and scales are
        held on the host; bf16 states on a GPU are copied to pinned memory; a CPU tensor in bf16
        is taken as it is, not copied: the caller must not change it afterwards.
        Returns False when the request got an error record instead (e.g. writer behind).
        """
        seq_len, n_slots, hidden = hidden_states.shape
        stored = sample_file_bytes(seq_len, n_slots, hidden, self.hidden_states_dtype)
        fp8 = self.hidden_states_dtype == "fp8"
        on_cuda = bool(hidden_states.is_cuda)
        # The host holds the encoded tensors, except a CPU tensor stored as bf16, held as it is.
        num_bytes = stored if fp8 or on_cuda else host_bytes(hidden_states.numel(), hidden_states.dtype, seq_len)
        if not self._reserve(rid, num_bytes):
            return False
        if fp8:
            encoded = _fp8_host_buffers(seq_len, n_slots, hidden, pinned=on_cuda)
            verdict = quantize_fp8_into(hidden_states, encoded[HIDDEN_STATES_KEY], encoded[SCALES_KEY])
            pending = PendingDump(self, rid, num_bytes, stored, None, slot_major=False, on_cuda=on_cuda, encoded=encoded,
                                  slot_verdict=verdict)
        elif on_cuda:
            encoded = {}
            for key, value in encode_hidden_states(hidden_states, self.hidden_states_dtype).items():
                encoded[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                encoded[key].copy_(value, non_blocking=True)
            pending = PendingDump(self, rid, num_bytes, stored, None, slot_major=False, on_cuda=True, encoded=encoded)
            pending._finite_flags.append(finite_on_device(hidden_states))
        else:
            pending = PendingDump(self, rid, num_bytes, stored, hidden_states.detach(), slot_major=False, on_cuda=False)
        pending.commit(token_ids)
        return True

    def submit_error(self, rid: str, reason: str, kind: str = WRITE_FAILED, retryable: bool = False, **details: Any) -> None:
        """Queue an error record for ``rid`` (written by its own thread, never behind the dumps)."""
        with self._cond:
            self._unwritten_records[rid] = self._unwritten_records.get(rid, 0) + 1
        self._records.put(ErrorRecord(rid, reason, kind=kind, retryable=retryable, details=details))

    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued dump and record is on disk (``timeout`` in seconds, None = forever)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._reserved and not self._unwritten_records, timeout):
                raise TimeoutError(f"dump writer did not drain within {timeout}s")

    def close(self) -> None:
        """Write what is queued, then stop the threads and remove the status file."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        for _ in range(len(self._threads) - 1):
            self._jobs.put(None)
        self._records.put(None)
        for thread in self._threads:
            thread.join()
        self.sink.close()

    @property
    def write_errors(self) -> list[str]:
        """Messages of writes that failed (disk full, permissions); empty when all went well."""
        return list(self._errors)

    def status(self) -> WriterStatus:
        """A snapshot of what the writer holds (what its status file says)."""
        with self._cond:
            pending = sorted(set(self._reserved) | set(self._unwritten_records))
            return WriterStatus(**{**self._status.__dict__, "pending": pending, "updated": time.time()})

    # -- budget ----------------------------------------------------------------------------

    def _reserve(self, rid: str, num_bytes: int, deadline: float | None = None) -> bool:
        if num_bytes > self.largest_sample:
            self.submit_error(
                rid,
                f"one request needs {num_bytes / 1e9:.2f} GB of dump buffer, more than the whole budget of "
                f"{self.largest_sample / 1e9:.2f} GB: raise the dump queue budget (eagleflow Param dump_queue_gb)",
                kind=TOO_LARGE, needed_bytes=num_bytes, budget_bytes=self.largest_sample,
            )
            return False
        wait = self.wait_seconds if deadline is None else max(0.0, min(self.wait_seconds, deadline - time.monotonic()))
        with self._cond:
            fits = self._cond.wait_for(lambda: self._status.pending_bytes + num_bytes <= self.budget, wait)
            if not fits:
                self._status.behind += 1
                held = self._status.pending_bytes
            else:
                self._reserved[rid] = num_bytes
                self._status.pending_bytes += num_bytes
                self._status.peak_pending_bytes = max(self._status.peak_pending_bytes, self._status.pending_bytes)
        if not fits:
            self.submit_error(
                rid,
                f"writer behind: {held / 1e9:.2f} of {self.budget / 1e9:.2f} GB of dumps still queued after "
                f"{self.wait_seconds:g}s (the disk is slower than the engine); send the request again later",
                kind=WRITER_BEHIND, retryable=True, queued_bytes=held, budget_bytes=self.budget,
            )
        return fits

    def _release(self, pending: PendingDump) -> None:
        with self._cond:
            if self._reserved.pop(pending.rid, None) is not None:
                self._status.pending_bytes -= pending.num_bytes
            self._cond.notify_all()

    def _enqueue(self, job: Job) -> None:
        self._jobs.put(job)

    # -- threads ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            pending = job.pending
            try:
                self._write(job)
            except Exception as exc:  # a failed write must not kill the server's writer thread
                self._record_failure(pending, exc)
            finally:
                pending.host = pending.encoded = None  # the buffer goes back before the budget does
                self._release(pending)

    def _write(self, job: Job) -> None:
        pending = job.pending
        if job.event is not None:
            job.event.synchronize()
        if job.verdict is not None:
            finite = bool(job.verdict.all())
        else:
            finite = all_finite_cpu(pending.host)
        if not finite:
            if pending.encoded is not None and SCALES_KEY in pending.encoded:  # quantised at the source
                report = nonfinite_slots_report(job.verdict, pending.encoded[SCALES_KEY])
            else:
                states = pending.host if pending.encoded is None else decode_hidden_states(pending.encoded)
                report = nonfinite_report(states, slot_axis=0 if pending.slot_major else 1)
            self.submit_error(pending.rid, report, kind=NONFINITE)
            return
        free = self.sink.free_bytes()
        if free is not None and free < pending.stored_bytes + RECORD_RESERVE_BYTES:  # never eat into the room the records need
            self._disk_full(pending, free)
            return
        if self.write_delay:
            time.sleep(self.write_delay)
        if pending.encoded is not None:
            tensors = {**pending.encoded, TOKEN_IDS_KEY: job.token_ids}
        else:
            states = SlotMajor(pending.host) if pending.slot_major else pending.host
            tensors = encode_sample(states, job.token_ids, self.hidden_states_dtype)
        self.sink.write_sample(pending.rid, tensors, {VALUES_KEY: VALUES_FINITE})
        with self._cond:
            self._status.written += 1
            self._status.last_write = time.time()

    def _disk_full(self, pending: PendingDump, free: int) -> None:
        """Record that ``pending`` does not fit; the reserve goes first, so the record does."""
        self.sink.give_up_reserve()
        self.submit_error(
            pending.rid,
            f"disk full: {self.dump_dir} has {free} bytes free, this dump needs {pending.stored_bytes} bytes",
            kind=DISK_FULL, folder=str(self.dump_dir), needed_bytes=pending.stored_bytes, free_bytes=free,
        )

    def _record_failure(self, pending: PendingDump, exc: Exception) -> None:
        message = f"{pending.rid}: {type(exc).__name__}: {exc}"
        self._errors.append(message)
        with self._cond:
            self._status.failed += 1
        print(f"eagleflow dump writer: write failed: {message}", file=sys.stderr, flush=True)
        if isinstance(exc, StorePutFailed):
            self.submit_error(pending.rid, str(exc), kind=exc.kind, retryable=exc.retryable, store=self.sink.describe())
        elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._disk_full(pending, self.sink.free_bytes() or 0)  # another writer took the room first
        else:
            self.submit_error(pending.rid, f"write failed: {message}", kind=WRITE_FAILED)

    def _record_loop(self) -> None:
        last_status = 0.0
        while True:
            try:
                record = self._records.get(timeout=STATUS_INTERVAL_S / 2)
            except queue.Empty:
                record = False  # type: ignore[assignment]
            if record is None:
                return
            if record:
                try:
                    self.sink.write_record(record)
                except Exception as exc:  # disk full even for a small record: say so in the log
                    print(f"eagleflow dump writer: cannot write error record for {record.rid}: {exc}", file=sys.stderr, flush=True)
                finally:
                    with self._cond:
                        left = self._unwritten_records.pop(record.rid, 1) - 1
                        if left:
                            self._unwritten_records[record.rid] = left
                        self._cond.notify_all()
            if time.monotonic() - last_status >= STATUS_INTERVAL_S / 2:
                last_status = time.monotonic()
                try:
                    self.sink.write_status(self.status())
                except Exception:
                    pass  # a full disk: the records above say what matters
