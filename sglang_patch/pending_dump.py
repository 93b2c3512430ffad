"""One request's reserved host buffer between the capture and the dump writer's threads.

:class:`PendingDump` is what :meth:`sglang_patch.dump_writer.DumpWriter.begin` hands the capture
hook: filled slot by slot as the layers run, then committed (or cancelled with a reason). The
budget bookkeeping stays with the writer; this module only holds the buffer and its verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang_patch.finite import finite_on_device
from sglang_patch.layer_output import StateSum

if TYPE_CHECKING:
    from sglang_patch.dump_writer import DumpWriter


def host_bytes(numel: int, dtype: torch.dtype, seq_len: int) -> int:
    """Host bytes of states held in ``dtype`` plus their token ids."""
    return numel * dtype.itemsize + seq_len * torch.int64.itemsize


class PendingDump:
    """One request's reserved host buffer, filled slot by slot, then handed to a writer thread.

    :param num_bytes: the host bytes reserved for it in the writer's budget.
    :param stored_bytes: the bytes its file's tensors take on disk.
    :param host: the states in the model dtype: ``[n_slots, seq_len, hidden]`` when ``slot_major``
        (filled per slot by :meth:`put`), else the caller's ``[seq_len, n_slots, hidden]`` tensor
        itself; None when ``encoded`` holds them.
    :param encoded: the file's state tensors already in the storage dtype (on the host).
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
    ) -> None:
        self.writer, self.rid, self.num_bytes, self.stored_bytes = writer, rid, num_bytes, stored_bytes
        self.host, self.slot_major, self.on_cuda, self.encoded = host, slot_major, on_cuda, encoded
        self._finite_flags: list[torch.Tensor] = []  # device verdicts, read after the copy's event
        self._done = False

    def put(self, slot: int, states: torch.Tensor | StateSum, start: int = 0) -> None:
        """Copy ``[tokens, hidden]`` states of ``slot`` (tokens ``start``…) into the host buffer
        (a :class:`~sglang_patch.layer_output.StateSum` is added straight into it)."""
        destination = self.host[slot, start : start + states.shape[0]]
        if isinstance(states, StateSum):
            states.add_into(destination)
            return
        destination.copy_(states.detach(), non_blocking=self.on_cuda)
        if states.is_cuda:
            self._finite_flags.append(finite_on_device(states))

    def commit(self, token_ids: torch.Tensor) -> None:
        """Queue the buffer for writing (CUDA copies finish on the writer's side, after an event)."""
        if self._done:
            return
        self._done = True
        event = verdict = None
        if self.on_cuda:
            ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            ids.copy_(token_ids.detach(), non_blocking=True)
            if self._finite_flags:
                verdict = torch.empty(len(self._finite_flags), dtype=torch.bool, pin_memory=True)
                verdict.copy_(torch.stack(self._finite_flags), non_blocking=True)
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
        self.writer._release(self)
        self.writer.submit_error(self.rid, reason, kind=kind, retryable=retryable, **details)


@dataclass
class Job:
    """One request's buffer on its way to a writer thread (CUDA copies finish after ``event``)."""

    pending: PendingDump
    token_ids: torch.Tensor
    event: Any
    verdict: torch.Tensor | None
