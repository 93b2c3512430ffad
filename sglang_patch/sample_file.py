"""The per-sample hidden-state file (DESIGN.md §3.2): the one definition of its format.

``hidden_states``: ``[seq_len, n_slots, hidden]`` in the model dtype (bf16), slots = aux layer ids
in order, then the last layer's output before the final norm; ``token_ids``: ``[seq_len]`` int64.
This is exactly what ``speculators`` reads (``hs_connectors.FileTransfer``).

The file is a plain safetensors file, written here without ``safetensors.save_file``: that
function first copies every tensor into a Python ``bytes`` object, a second copy of hundreds of
MB per request. :func:`write_sample_file` sends the tensors' own memory to the kernel instead
(``os.writev``), including states held slot-major (``[n_slots, seq_len, hidden]``, how the
capture hook receives them one layer at a time), which are gathered into the file's
token-major layout by the write itself. ``__metadata__`` may carry the writer's finiteness
verdict (:data:`VALUES_KEY`), so a reader need not scan the values again.

Self-contained (standard library, torch, safetensors): it is imported inside the SGLang server
by the capture hook as well as by eagleflow's sample store.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_patch.file_mode import published_file_mode

HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
HIDDEN_STATES_DTYPE = torch.bfloat16
TOKEN_IDS_DTYPE = torch.int64
# __metadata__ key of the writer's verdict on the states' values; VALUES_FINITE = checked, no NaN/Inf.
VALUES_KEY = "eagleflow.values"
VALUES_FINITE = "finite"

SAFETENSORS_DTYPE_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
}
_IOV_MAX = 1024  # Linux's limit of buffers per writev call
_WRITE_CHUNK = 1 << 30  # one write() moves at most ~2 GB on Linux; stay well below


def sample_file_name(row: int) -> str:
    """File name of dataset row ``row`` inside ``<dataset>/hidden_states/``."""
    return f"hs_{row}.safetensors"


@dataclass(frozen=True)
class SlotMajor:
    """States held as ``[n_slots, seq_len, hidden]`` (one contiguous block per slot), stored as
    ``[seq_len, n_slots, hidden]``: the write interleaves the slots, no transposed copy is made."""

    states: torch.Tensor

    @property
    def stored_shape(self) -> list[int]:
        slots, seq_len, hidden = self.states.shape
        return [seq_len, slots, hidden]


def sample_file_bytes(seq_len: int, n_slots: int, hidden: int, dtype: torch.dtype = HIDDEN_STATES_DTYPE) -> int:
    """Bytes of the two tensors of one sample (the file adds a header of a few hundred bytes)."""
    item = torch.empty((), dtype=dtype).element_size()
    return seq_len * n_slots * hidden * item + seq_len * torch.empty((), dtype=TOKEN_IDS_DTYPE).element_size()


def write_sample_file(
    path: str | os.PathLike[str],
    hidden_states: torch.Tensor | SlotMajor,
    token_ids: torch.Tensor,
    metadata: Mapping[str, str] | None = None,
    durable: bool = True,
) -> Path:
    """Write one sample atomically: temp file in the same folder, (fsync,) rename.

    A reader therefore sees either no file or a complete one; a write killed midway leaves
    only a dot-named ``.tmp`` file that no reader globs for. ``durable=False`` skips the fsync:
    for hand-off files whose reader makes them durable itself, once per batch of files.
    """
    path = Path(path)
    states = _states_tensor(hidden_states)
    if states.dim() != 3:
        raise ValueError(f"hidden_states must be [seq_len, n_slots, hidden], got shape {tuple(states.shape)}")
    seq_len = states.shape[1] if isinstance(hidden_states, SlotMajor) else states.shape[0]
    if token_ids.dim() != 1 or token_ids.shape[0] != seq_len:
        raise ValueError(f"token_ids must be [seq_len={seq_len}], got shape {tuple(token_ids.shape)}")
    states = states.detach().to("cpu", HIDDEN_STATES_DTYPE).contiguous()
    tensors: dict[str, tuple[torch.Tensor, list[int]]] = {
        TOKEN_IDS_KEY: (token_ids.detach().to("cpu", TOKEN_IDS_DTYPE).contiguous(), [seq_len]),
        HIDDEN_STATES_KEY: (states, SlotMajor(states).stored_shape if isinstance(hidden_states, SlotMajor) else list(states.shape)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, published_file_mode())  # mkstemp makes 0600; the extractor may be another user
        _write_all(fd, _header(tensors, metadata))
        for name, (tensor, _) in tensors.items():
            if name == HIDDEN_STATES_KEY and isinstance(hidden_states, SlotMajor):
                _writev_all(fd, _slot_major_pieces(tensor))
            else:
                _write_all(fd, _bytes_view(tensor))
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp_name, path)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path


def _states_tensor(hidden_states: torch.Tensor | SlotMajor) -> torch.Tensor:
    return hidden_states.states if isinstance(hidden_states, SlotMajor) else hidden_states


def _header(tensors: Mapping[str, tuple[torch.Tensor, list[int]]], metadata: Mapping[str, str] | None) -> memoryview:
    """safetensors' header: u64 length, JSON (tensors in file order), padded with spaces to 8 bytes."""
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, (tensor, shape) in tensors.items():
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPE_NAMES[tensor.dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return memoryview(struct.pack("<Q", len(text)) + text)


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy); bf16/fp8 have no numpy dtype, so view as uint8."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def _slot_major_pieces(states: torch.Tensor) -> Iterator[memoryview]:
    """``[slots, seq, hidden]`` memory in file order: token 0 slot 0, token 0 slot 1, …"""
    slots, seq_len, hidden = states.shape
    whole = _bytes_view(states)
    row = hidden * states.element_size()
    for token in range(seq_len):
        for slot in range(slots):
            start = (slot * seq_len + token) * row
            yield whole[start : start + row]


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done : done + _WRITE_CHUNK])


def _writev_all(fd: int, pieces: Iterator[memoryview]) -> None:
    batch: list[memoryview] = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == _IOV_MAX:
            _writev_batch(fd, batch)
            batch = []
    if batch:
        _writev_batch(fd, batch)


def _writev_batch(fd: int, batch: list[memoryview]) -> None:
    written = os.writev(fd, batch)
    total = sum(len(piece) for piece in batch)
    if written < total:  # a short write (signal, nearly full disk): finish piece by piece
        for piece in batch:
            if written >= len(piece):
                written -= len(piece)
                continue
            _write_all(fd, piece[written:])
            written = 0
