"""One request's reserved buffers between the capture and the dump writer's threads.

:class:`PendingDump` is what :meth:`sglang_patch.dump_writer.DumpWriter.begin` hands the capture
hook: filled slot by slot as the layers run, then committed (or cancelled with a reason). It
comes in two forms, by the run's storage dtype:

- bf16: a slot-major host buffer (pinned for CUDA states); each layer's state is copied into it as
  soon as it is read, so the GPU holds one layer's state at a time;
- fp8: one fp8 scale spans every slot of a token, so the slots are kept where the states are (a
  slot-major *staging* tensor on the states' device) until the last captured layer; :meth:`PendingDump.commit`
  then quantises there (:func:`~sglang_patch.sample_file.quantize_fp8_into`) and only the fp8
  bytes and the scales cross to host memory.

The budget bookkeeping stays with the writer; this module only holds the buffers and their verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang_patch.finite import finite_on_device
from sglang_patch.layer_output import StateSum
from sglang_patch.sample_file import HIDDEN_STATES_KEY, SCALES_KEY, quantize_fp8_into

if TYPE_CHECKING:
    from sglang_patch.dump_writer import DumpWriter


def host_bytes(numel: int, dtype: torch.dtype, seq_len: int) -> int:
    """Host bytes of states held in ``dtype`` plus their token ids."""
    return numel * dtype.itemsize + seq_len * torch.int64.itemsize


class PendingDump:
    """One request's reserved buffers, filled slot by slot, then handed to a writer thread.

    :param num_bytes: the host bytes reserved for it in the writer's budget.
    :param stored_bytes: the bytes its file's tensors take on disk.
    :param host: the states in the model dtype: ``[n_slots, seq_len, hidden]`` when ``slot_major``
        (filled per slot by :meth:`put`), else the caller's ``[seq_len, n_slots, hidden]`` tensor
        itself; None when ``encoded`` holds them.
    :param encoded: the file's state tensors in the storage dtype, on the host (for an fp8
        ``staging`` dump: the buffers :meth:`commit` quantises into).
    :param staging: fp8 only: ``[n_slots, seq_len, hidden]`` on the states' device in the model
        dtype, filled per slot by :meth:`put` and quantised by :meth:`commit`.
    :param slot_verdict: fp8 states already quantised: the quantiser's per-slot finiteness.
    """

    def __init__(
        self,
        writer: DumpWriter,
        rid: str,
        num_bytes: int,
        stored_bytes: int,
        host: torch.Tensor | None,
        slot_major: bool,
        on_cuda: bool,
        encoded: dict[str, torch.Tensor] | None = None,
        staging: torch.Tensor | None = None,
        slot_verdict: torch.Tensor | None = None,
    ) -> None:
        self.writer, self.rid, self.num_bytes, self.stored_bytes = writer, rid, num_bytes, stored_bytes
        self.host, self.slot_major, self.on_cuda, self.encoded = host, slot_major, on_cuda, encoded
        self.staging = staging
        self._finite_flags: list[torch.Tensor] = []  # device verdicts of bf16 slots, read after the copy's event
        self._slot_verdict = slot_verdict  # the fp8 quantiser's [n_slots] verdict
        self._done = False

    def put(self, slot: int, states: torch.Tensor | StateSum, start: int = 0) -> None:
        """Copy ``[tokens, hidden]`` states of ``slot`` (tokens ``start``…) into the buffer
        (a :class:`~sglang_patch.layer_output.StateSum` is added straight into it)."""
        buffer = self.staging if self.staging is not None else self.host
        destination = buffer[slot, start : start + states.shape[0]]
        if isinstance(states, StateSum):
            states.add_into(destination)
            return
        destination.copy_(states.detach(), non_blocking=self.on_cuda)
        if states.is_cuda and self.staging is None:  # staged fp8 gets its verdict from the quantiser
            self._finite_flags.append(finite_on_device(states))

    def commit(self, token_ids: torch.Tensor) -> None:
        """Queue the dump for writing; CUDA copies finish on the writer's side, after an event.

        A staged fp8 dump is quantised here, on its device, and the staging is given back.
        """
        if self._done:
            return
        self._done = True
        if self.staging is not None:
            assert self.encoded is not None
            token_major = self.staging.permute(1, 0, 2)  # a view: the quantiser reads chunks of it in place
            self._slot_verdict = quantize_fp8_into(token_major, self.encoded[HIDDEN_STATES_KEY], self.encoded[SCALES_KEY])
            self.staging = None  # on a GPU the allocator reuses it only after the queued work (same stream)
        event = None
        verdict = self._slot_verdict
        if self.on_cuda:
            ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            ids.copy_(token_ids.detach(), non_blocking=True)
            flags = verdict if verdict is not None else torch.stack(self._finite_flags) if self._finite_flags else None
            verdict = None
            if flags is not None:
                verdict = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
                verdict.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            ids = token_ids.detach().cpu()
        self.writer._enqueue(Job(self, ids, event, verdict))

    def cancel(self, reason: str, kind: str, retryable: bool = False, **details: Any) -> None:
        """Give the reservation back and record why this request has no dump."""
        if self._done:
            return
        self._done = True
        self.staging = None
        self.writer._release(self)
        self.writer.submit_error(self.rid, reason, kind=kind, retryable=retryable, **details)


@dataclass
class Job:
    """One request's buffer on its way to a writer thread (CUDA copies finish after ``event``).

    ``verdict``: the finiteness flags made where the states were (None: the writer checks the
    host buffer itself); for an fp8 dump one flag per slot.
    """

    pending: PendingDump
    token_ids: torch.Tensor
    event: Any
    verdict: torch.Tensor | None
