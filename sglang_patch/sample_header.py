"""A sample file's header without torch: its tensors' dtypes and shapes, its ``__metadata__``.

A safetensors file starts with an 8-byte little-endian length and that many bytes of JSON
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``), then the data. Reading
the header is all a check of dtype, shape or the writer's verdict needs, and it needs neither
torch nor safetensors: the training step checks every file of a dataset this way before its
speculators child has finished importing torch, and the sample store asks it for a file's
storage dtype. Standard library only.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from sglang_patch.sample_format import HiddenStatesDtype

# safetensors' names of the two storage dtypes' tensors (sglang_patch.sample_file writes them).
STORAGE_DTYPE_NAMES: dict[HiddenStatesDtype, str] = {"bf16": "BF16", "fp8": "F8_E4M3"}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorHeader:
    dtype: str  # safetensors' name: "BF16", "F8_E4M3", "I64", …
    shape: tuple[int, ...]
    end: int  # where its data ends, from the start of the data section


@dataclass(frozen=True)
class SampleHeader:
    metadata: dict[str, str]
    tensors: dict[str, TensorHeader]

    def storage_dtype(self, key: str) -> HiddenStatesDtype | None:
        """Which storage dtype tensor ``key`` is in (None: another dtype, or no such tensor)."""
        tensor = self.tensors.get(key)
        names = {name: dtype for dtype, name in STORAGE_DTYPE_NAMES.items()}
        return names.get(tensor.dtype) if tensor is not None else None


def read_header(path: str | os.PathLike[str]) -> SampleHeader:
    """The header of the safetensors file ``path``; ValueError (naming the file) for a torn or foreign one.

    A file shorter than its header says (a truncated write) is refused, as ``safe_open`` refuses it.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: {len(prefix)} bytes, not a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header of {length} bytes, not a safetensors file")
        raw = handle.read(length)
        size = os.fstat(handle.fileno()).st_size
    if len(raw) < length:
        raise ValueError(f"{path}: truncated header ({len(raw)} of {length} bytes)")
    try:
        entries = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    tensors: dict[str, TensorHeader] = {}
    try:
        for name, entry in entries.items():
            tensors[name] = TensorHeader(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), int(entry["data_offsets"][1]))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{path}: malformed header entry ({exc})") from exc
    data_end = max((t.end for t in tensors.values()), default=0)
    if 8 + length + data_end > size:
        raise ValueError(f"{path}: truncated ({size} bytes, its header promises {8 + length + data_end})")
    return SampleHeader(dict(metadata), tensors)
