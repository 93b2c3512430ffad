"""The per-sample hidden-state file (docs/design.md §3.2): the one definition of its format.

Every file holds ``hidden_states [seq_len, n_slots, hidden]`` (slots = aux layer ids in order,
then the last layer's output before the final norm) and ``token_ids [seq_len]`` int64, in one
of two storage dtypes (:mod:`sglang_patch.sample_format`):

- ``bf16``: the states in bf16, what ``speculators`` reads with its ``file`` backend
  (``hs_connectors.FileTransfer``);
- ``fp8``: the states as float8_e4m3fn plus ``hidden_states_scales [seq_len, 1, 1]`` float32,
  one scale per token over all slots, what speculators 0.9 reads with ``--hidden-states-backend
  fp8`` (``hs_connectors.FP8Transfer``: ``fp8.to(bf16) * scale.to(bf16)``). The quantisation is
  hs-connectors' own (``fp8_utils.quantize_tensor_to_fp8``): ``scale = max(amax / 448, 1e-12)``,
  ``fp8 = (x.float() / scale).to(float8_e4m3fn)``, the same bytes.

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
from sglang_patch.sample_format import (  # noqa: F401  (the file's names, re-exported with its format)
    HIDDEN_STATES_DTYPES,
    HIDDEN_STATES_KEY,
    SCALES_KEY,
    TOKEN_IDS_KEY,
    SCALE_BYTES,
    STATE_ELEMENT_BYTES,
    TOKEN_ID_BYTES,
    HiddenStatesDtype,
    bytes_per_token,
    check_hidden_states_dtype,
    sample_file_bytes,
    sample_file_name,
)
TOKEN_IDS_DTYPE = torch.int64
SCALES_DTYPE = torch.float32
STORAGE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MIN_SCALE = 1e-12  # hs-connectors' clamp: an all-zero token still gets a usable scale
assert set(STORAGE_DTYPES) == set(HIDDEN_STATES_DTYPES), "every named storage dtype needs its torch dtype"
assert {name: dtype.itemsize for name, dtype in STORAGE_DTYPES.items()} == STATE_ELEMENT_BYTES
assert (TOKEN_IDS_DTYPE.itemsize, SCALES_DTYPE.itemsize) == (TOKEN_ID_BYTES, SCALE_BYTES)
# __metadata__ key of the writer's verdict on the states' values; VALUES_FINITE = checked, no NaN/Inf.
VALUES_KEY = "eagleflow.values"
VALUES_FINITE = "finite"

SAFETENSORS_DTYPE_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
    torch.float8_e4m3fn: "F8_E4M3",
}
_IOV_MAX = 1024  # Linux's limit of buffers per writev call
_WRITE_CHUNK = 1 << 30  # one write() moves at most ~2 GB on Linux; stay well below


@dataclass(frozen=True)
class SlotMajor:
    """States held as ``[n_slots, seq_len, hidden]`` (one contiguous block per slot), stored as
    ``[seq_len, n_slots, hidden]``: the write interleaves the slots, no transposed copy is made."""

    states: torch.Tensor

    @property
    def stored_shape(self) -> list[int]:
        slots, seq_len, hidden = self.states.shape
        return [seq_len, slots, hidden]


def sample_keys(hidden_states_dtype: HiddenStatesDtype) -> set[str]:
    """The tensors a file of that storage dtype holds, no more, no less."""
    keys = {HIDDEN_STATES_KEY, TOKEN_IDS_KEY}
    return keys | {SCALES_KEY} if hidden_states_dtype == "fp8" else keys


def storage_dtype_of(tensor_dtype: torch.dtype) -> HiddenStatesDtype | None:
    """Which storage dtype a file's ``hidden_states`` tensor dtype belongs to (None: neither)."""
    for name, dtype in STORAGE_DTYPES.items():
        if dtype == tensor_dtype:
            return name  # type: ignore[return-value]
    return None


def quantize_fp8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 states, float32 scales [seq_len, 1, 1])`` on the states' own device.

    Byte-identical to hs-connectors' ``quantize_tensor_to_fp8`` on the same device (see
    :func:`quantize_fp8_into`, which does the work).
    """
    seq_len = hidden_states.shape[0]
    values = torch.empty(hidden_states.shape, dtype=STORAGE_DTYPES["fp8"], device=hidden_states.device)
    scales = torch.empty((seq_len, *[1] * (hidden_states.dim() - 1)), dtype=SCALES_DTYPE, device=hidden_states.device)
    quantize_fp8_into(hidden_states, values, scales)
    return values, scales


def quantize_fp8_into(states: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Quantise ``states [seq_len, n_slots, hidden]`` to fp8 where they are; write the fp8 values
    and the float32 scales ``[seq_len, 1, 1]`` into ``values`` / ``scales`` (on any device: host
    memory, pinned for a CUDA source, takes only the fp8 bytes and the scales).

    The arithmetic is hs-connectors' ``fp8_utils.quantize_tensor_to_fp8``, op for op, so the
    bytes are its bytes on the same device: per token ``amax`` over every slot and hidden value,
    ``scale = (amax / 448).clamp(min=1e-12)``, ``fp8 = (float32(x) / scale).to(float8_e4m3fn)``.
    What differs is only how the work is laid out, never a value: a chunk of tokens at a time
    (small enough for the CPU's cache, large on a GPU), so the only large temporaries are one
    chunk's; and ``amax(|x|)`` read off the bit patterns (sign bit cleared: for IEEE floats the
    integer order of the magnitudes is their numeric order, and upcasting to float32 is exact).
    One code path for CPU and CUDA tensors: on a GPU each chunk's fp8 bytes cross with an
    asynchronous copy on the current stream, on the CPU the same copy is a memcpy.

    :returns: a bool tensor ``[n_slots]`` on the states' device, False for a slot holding a NaN or
        an Inf (read off the same maxima, no extra pass; nothing waits for it).
    """
    if states.dim() != 3:
        raise ValueError(f"states must be [seq_len, n_slots, hidden], got shape {tuple(states.shape)}")
    seq_len, n_slots, hidden = states.shape
    if tuple(values.shape) != tuple(states.shape) or values.dtype != STORAGE_DTYPES["fp8"]:
        raise ValueError(f"values must be {STORAGE_DTYPES['fp8']} {tuple(states.shape)}, got {values.dtype} {tuple(values.shape)}")
    if tuple(scales.shape) != (seq_len, 1, 1) or scales.dtype != SCALES_DTYPE:
        raise ValueError(f"scales must be {SCALES_DTYPE} {(seq_len, 1, 1)}, got {scales.dtype} {tuple(scales.shape)}")
    bits_dtype = _MAGNITUDE_BITS.get(states.dtype)
    if bits_dtype is None:
        raise ValueError(f"cannot quantise {states.dtype} states (one of {sorted(map(str, _MAGNITUDE_BITS))})")
    states = states.detach()  # any strides: the hook stages slot-major, a chunk is read in place
    device = states.device
    fp8 = STORAGE_DTYPES["fp8"]
    fp8_max = torch.finfo(fp8).max
    no_sign = torch.iinfo(bits_dtype).max  # every bit but the sign bit
    inf_bits = int(torch.tensor(float("inf"), dtype=states.dtype).view(bits_dtype))
    per_token = n_slots * hidden
    chunk = max(1, (_CHUNK_ELEMENTS_CPU if device.type == "cpu" else _CHUNK_ELEMENTS_DEVICE) // max(per_token, 1))
    shape = (min(chunk, seq_len), n_slots, hidden)
    magnitudes = torch.empty(shape, dtype=bits_dtype, device=device)
    slot_max = torch.empty((seq_len, n_slots), dtype=bits_dtype, device=device)  # |x| maxima as bit patterns
    for begin in range(0, seq_len, chunk):
        end = min(begin + chunk, seq_len)
        torch.bitwise_and(states[begin:end].view(bits_dtype), no_sign, out=magnitudes[: end - begin])
        torch.amax(magnitudes[: end - begin], dim=2, out=slot_max[begin:end])
    slots_finite = (slot_max < inf_bits).all(dim=0)  # NaN and Inf patterns sort above every finite one
    amax = slot_max.amax(dim=1).view(states.dtype).float().view(seq_len, 1, 1)
    on_device_scales = torch.div(amax, fp8_max)  # hs-connectors' ``amax / fp8_max``, a Python-scalar divisor
    on_device_scales.clamp_(min=FP8_MIN_SCALE)
    quotients = torch.empty(shape, dtype=torch.float32, device=device)
    out = torch.empty(shape, dtype=fp8, device=device)
    copy_async = values.device != device  # a pinned host buffer: the copy overlaps the next chunk's work
    for begin in range(0, seq_len, chunk):
        end = min(begin + chunk, seq_len)
        n = end - begin
        # float32(x) / scale, then rounded to fp8: two steps, as hs-connectors does (a division
        # straight into an fp8 output gives the same bytes but takes a slow unvectorised loop on the CPU).
        torch.div(states[begin:end], on_device_scales[begin:end], out=quotients[:n])
        out[:n].copy_(quotients[:n])
        values[begin:end].copy_(out[:n], non_blocking=copy_async)
    scales.copy_(on_device_scales, non_blocking=scales.device != device)
    return slots_finite


# Sign-less magnitudes of each float dtype's bit patterns, as integers of the same width.
_MAGNITUDE_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
# Elements per quantised chunk. On the CPU, torch's grain (32768): each op stays on the calling thread,
# its temporaries in cache; a parallel region per chunk costs more than the chunk's work once other
# processes share the cores. On a GPU a 2K-token Kimi request takes four chunks (tens of MB of
# temporaries, a handful of kernels each).
_CHUNK_ELEMENTS_CPU = 1 << 15
_CHUNK_ELEMENTS_DEVICE = 1 << 24


def encode_hidden_states(hidden_states: torch.Tensor, hidden_states_dtype: HiddenStatesDtype) -> dict[str, torch.Tensor]:
    """The file's state tensors for ``hidden_states`` (any float dtype), on its own device.

    Run it where the states are (the GPU in a server): an fp8 file then crosses to the host
    at half the bytes of bf16.
    """
    dtype = check_hidden_states_dtype(hidden_states_dtype)
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be [seq_len, n_slots, hidden], got shape {tuple(hidden_states.shape)}")
    if dtype == "fp8":
        values, scales = quantize_fp8(hidden_states)
        return {HIDDEN_STATES_KEY: values, SCALES_KEY: scales}
    return {HIDDEN_STATES_KEY: hidden_states.detach().to(STORAGE_DTYPES[dtype])}


def decode_hidden_states(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The states of a loaded file in ``dtype``, dequantised the way speculators does for fp8."""
    states = tensors[HIDDEN_STATES_KEY]
    if SCALES_KEY in tensors:
        return states.to(dtype) * tensors[SCALES_KEY].to(dtype)
    return states.to(dtype)


def write_sample_file(
    path: str | os.PathLike[str],
    hidden_states: torch.Tensor | SlotMajor,
    token_ids: torch.Tensor,
    hidden_states_dtype: HiddenStatesDtype = "bf16",
    metadata: Mapping[str, str] | None = None,
    durable: bool = True,
) -> Path:
    """Encode ``hidden_states`` in ``hidden_states_dtype`` and write one sample atomically.

    bf16 states held :class:`SlotMajor` are written as they are (the write interleaves the
    slots); fp8 is quantised first, which needs every slot of a token (one scale per token).
    """
    return write_encoded_sample(path, encode_sample(hidden_states, token_ids, hidden_states_dtype), metadata=metadata, durable=durable)


def encode_sample(
    hidden_states: torch.Tensor | SlotMajor, token_ids: torch.Tensor, hidden_states_dtype: HiddenStatesDtype = "bf16"
) -> dict[str, torch.Tensor | SlotMajor]:
    """The tensors of one sample as stored (:func:`write_encoded_sample` and :func:`encoded_sample_bytes` take them)."""
    dtype = check_hidden_states_dtype(hidden_states_dtype)
    if isinstance(hidden_states, SlotMajor) and (dtype != "bf16" or hidden_states.states.dtype != STORAGE_DTYPES["bf16"]):
        hidden_states = hidden_states.states.permute(1, 0, 2)  # a view: the encoding below makes the token-major copy
    if isinstance(hidden_states, SlotMajor):
        encoded: dict[str, torch.Tensor | SlotMajor] = {HIDDEN_STATES_KEY: hidden_states}
    else:
        encoded = {k: v.to("cpu") for k, v in encode_hidden_states(hidden_states, dtype).items()}
    return {**encoded, TOKEN_IDS_KEY: token_ids}


def write_encoded_sample(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor | SlotMajor],
    metadata: Mapping[str, str] | None = None,
    durable: bool = True,
) -> Path:
    """Write host tensors made by :func:`encode_hidden_states` plus ``token_ids``: temp file, (fsync,) rename.

    A reader therefore sees either no file or a complete one; a write killed midway leaves
    only a dot-named ``.tmp`` file that no reader globs for. The tensors' own memory goes to the
    kernel (no ``bytes`` copy). ``durable=False`` skips the fsync: for hand-off files whose
    reader makes them durable itself, once per batch of files.
    """
    path = Path(path)
    out, held = _checked_tensors(tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, published_file_mode())  # mkstemp makes 0600; the extractor may be another user
        _write_all(fd, _header(out, metadata))
        for name, (tensor, _) in out.items():
            if name == HIDDEN_STATES_KEY and isinstance(held, SlotMajor):
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


def encoded_sample_bytes(tensors: Mapping[str, torch.Tensor | SlotMajor], metadata: Mapping[str, str] | None = None) -> bytearray:
    """The bytes :func:`write_encoded_sample` writes to a file, in memory: the value the sample store holds."""
    out, held = _checked_tensors(tensors)
    data = bytearray(_header(out, metadata))
    for name, (tensor, _) in out.items():
        if name == HIDDEN_STATES_KEY and isinstance(held, SlotMajor):
            tensor = tensor.permute(1, 0, 2).contiguous()  # token-major, as the file interleaves it
        data += _bytes_view(tensor)
    return data


def _checked_tensors(
    tensors: Mapping[str, torch.Tensor | SlotMajor],
) -> tuple[dict[str, tuple[torch.Tensor, list[int]]], torch.Tensor | SlotMajor]:
    """The encoded sample's tensors in file order with their stored shapes, checked; and the states as given."""
    held = tensors[HIDDEN_STATES_KEY]
    states = _states_tensor(held)
    token_ids = tensors[TOKEN_IDS_KEY]
    stored = storage_dtype_of(states.dtype)
    if stored is None or set(tensors) != sample_keys(stored):
        raise ValueError(f"not an encoded sample: hidden_states {states.dtype}, tensors {sorted(tensors)}")
    if states.dim() != 3:
        raise ValueError(f"hidden_states must be [seq_len, n_slots, hidden], got shape {tuple(states.shape)}")
    shape = held.stored_shape if isinstance(held, SlotMajor) else list(states.shape)
    seq_len = shape[0]
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.shape[0] != seq_len:
        raise ValueError(f"token_ids must be [seq_len={seq_len}], got shape {tuple(token_ids.shape)}")
    scales = tensors.get(SCALES_KEY)
    if scales is not None and (
        not isinstance(scales, torch.Tensor) or scales.dtype != SCALES_DTYPE or tuple(scales.shape) != (seq_len, 1, 1)
    ):
        raise ValueError(f"{SCALES_KEY} must be [seq_len={seq_len}, 1, 1] float32, got {scales}")
    out: dict[str, tuple[torch.Tensor, list[int]]] = {
        TOKEN_IDS_KEY: (token_ids.detach().to("cpu", TOKEN_IDS_DTYPE).contiguous(), [seq_len]),
        HIDDEN_STATES_KEY: (states.detach().to("cpu").contiguous(), shape),
    }
    if scales is not None:
        out[SCALES_KEY] = (scales.detach().to("cpu").contiguous(), [seq_len, 1, 1])
    return out, held


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
