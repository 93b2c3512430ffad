"""The hidden-state sample store: open, validate and publish ``hs_{row}.safetensors`` files.

The file format itself is defined once in :mod:`sglang_patch.sample_file` (the capture hook
inside SGLang writes it too), in either storage dtype (``bf16``, or ``fp8`` with per-token
scales); this module adds what the pipeline needs around it: where a row's file lives, whether
it is complete in the run's storage dtype, and moving a server dump into place.
"""

from __future__ import annotations

import enum
import errno
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagleflow.data import dataset_column
from eagleflow.files import atomic_path
from eagleflow.layout import hidden_states_dir
from sglang_patch.sample_file import (
    HIDDEN_STATES_KEY,
    SAFETENSORS_DTYPE_NAMES,
    SCALES_DTYPE,
    SCALES_KEY,
    STORAGE_DTYPES,
    TOKEN_IDS_DTYPE,
    TOKEN_IDS_KEY,
    VALUES_FINITE,
    VALUES_KEY,
    sample_file_name,
    sample_keys,
    storage_dtype_of,
    write_sample_file,
)
from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HiddenStatesDtype

__all__ = [
    "SampleState",
    "Validation",
    "load_sample",
    "publish_dump",
    "sample_path",
    "validate",
    "validate_dataset",
    "write_sample",
]


class SampleState(str, enum.Enum):
    COMPLETE = "complete"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class Validation:
    """Outcome of :func:`validate`: the state, and for a corrupt file the reason."""

    state: SampleState
    reason: str = ""
    num_tokens: int = 0
    num_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.state is SampleState.COMPLETE


def sample_path(hidden_states_dir: str | os.PathLike[str], row: int) -> Path:
    """Path of dataset row ``row``'s file: ``<dataset>/hidden_states/hs_{row}.safetensors``."""
    return Path(hidden_states_dir) / sample_file_name(row)


def write_sample(
    hidden_states_dir: str | os.PathLike[str],
    row: int,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
) -> Path:
    """Write row ``row``'s sample atomically in ``hidden_states_dtype`` and return its path."""
    return write_sample_file(sample_path(hidden_states_dir, row), hidden_states, token_ids, hidden_states_dtype)


def load_sample(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a sample file into its tensors (``hidden_states``, ``token_ids``, for fp8 the scales)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def validate(
    path: str | os.PathLike[str],
    expected_token_ids: Sequence[int] | torch.Tensor,
    n_slots: int,
    hidden: int,
    hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
    check_values: bool = True,
    trust_writer_verdict: bool = False,
) -> Validation:
    """Tell whether ``path`` holds a complete sample for ``expected_token_ids``.

    Complete means: the file opens, holds exactly the tensors of ``hidden_states_dtype``
    (:func:`~sglang_patch.sample_file.sample_keys`) with their dtypes, shapes ``[seq_len,
    n_slots, hidden]`` / ``[seq_len]`` (fp8: scales ``[seq_len, 1, 1]``) with ``seq_len ==
    len(expected_token_ids)``, the same token ids, and (with ``check_values``) no NaN or Inf
    and, for fp8, every scale finite and positive. Anything else is ``CORRUPT`` with a reason.

    ``check_values=False`` reads only the header and the token ids: enough for a file that
    was published by rename after a full check (a file that exists is complete, §3.2), and
    it keeps a resumed shard from re-reading hundreds of GB. ``trust_writer_verdict`` does the
    same for a file whose writer checked the values before writing and said so in its
    metadata (:data:`~sglang_patch.sample_file.VALUES_KEY`); a file without that verdict is scanned.
    """
    path = Path(path)
    if not path.exists():
        return Validation(SampleState.MISSING, "no file")
    size = path.stat().st_size
    try:
        metadata, tensors = _load_header_and_tokens(path)
        if check_values and not (trust_writer_verdict and metadata.get(VALUES_KEY) == VALUES_FINITE):
            tensors = load_sample(path)
        else:
            check_values = False
    except Exception as exc:  # safetensors raises several types for a truncated/garbled file
        return Validation(SampleState.CORRUPT, f"unreadable: {exc}", num_bytes=size)

    def corrupt(reason: str) -> Validation:
        return Validation(SampleState.CORRUPT, reason, num_bytes=size)

    states = tensors.get(HIDDEN_STATES_KEY)
    stored = storage_dtype_of(states.dtype) if states is not None else None
    if stored is not None and stored != hidden_states_dtype:
        return corrupt(f"hidden states stored as {stored}, this run stores {hidden_states_dtype} (hidden_states_dtype)")
    if set(tensors) != sample_keys(hidden_states_dtype):
        return corrupt(f"tensors {sorted(tensors)} != {sorted(sample_keys(hidden_states_dtype))}")
    tokens = tensors[TOKEN_IDS_KEY]
    expected = torch.as_tensor(expected_token_ids, dtype=TOKEN_IDS_DTYPE)
    seq_len = expected.shape[0]
    if states.dtype != STORAGE_DTYPES[hidden_states_dtype]:
        return corrupt(f"hidden_states dtype {states.dtype}, expected {STORAGE_DTYPES[hidden_states_dtype]}")
    if tokens.dtype != TOKEN_IDS_DTYPE:
        return corrupt(f"token_ids dtype {tokens.dtype}, expected {TOKEN_IDS_DTYPE}")
    if tuple(states.shape) != (seq_len, n_slots, hidden):
        return corrupt(f"hidden_states shape {tuple(states.shape)}, expected {(seq_len, n_slots, hidden)}")
    if tuple(tokens.shape) != (seq_len,):
        return corrupt(f"token_ids shape {tuple(tokens.shape)}, expected {(seq_len,)}")
    scales = tensors.get(SCALES_KEY)
    if scales is not None and (scales.dtype != SCALES_DTYPE or tuple(scales.shape) != (seq_len, 1, 1)):
        return corrupt(f"{SCALES_KEY} {scales.dtype} {tuple(scales.shape)}, expected {SCALES_DTYPE} {(seq_len, 1, 1)}")
    if not torch.equal(tokens, expected):
        first = int((tokens != expected).nonzero()[0, 0])
        return corrupt(f"token mismatch at position {first}: {int(tokens[first])} != {int(expected[first])}")
    if not check_values:
        return Validation(SampleState.COMPLETE, num_tokens=seq_len, num_bytes=size)
    bad_values = _non_finite(states)
    if bad_values:
        return corrupt(bad_values)
    if scales is not None:
        bad = ~(torch.isfinite(scales) & (scales > 0))
        if bool(bad.any()):
            tokens_bad = bad.flatten().nonzero()[:, 0].tolist()
            return corrupt(f"{len(tokens_bad)} {SCALES_KEY} not finite and positive, first at token {tokens_bad[0]}")
    return Validation(SampleState.COMPLETE, num_tokens=seq_len, num_bytes=size)


def _non_finite(states: torch.Tensor) -> str:
    """Why ``states`` holds a NaN or Inf, naming the slots; empty when every value is finite."""
    if states.dtype == STORAGE_DTYPES["fp8"]:
        # float8_e4m3fn has no Inf, and its only NaNs are the bit patterns S.1111.111.
        finite = (states.view(torch.uint8) & 0x7F) != 0x7F
        counts = f"{int((~finite).sum())} NaN"
    else:
        finite = torch.isfinite(states)
        if bool(finite.all()):
            return ""
        counts = f"{int(torch.isnan(states).sum())} NaN, {int(torch.isinf(states).sum())} Inf"
    if bool(finite.all()):
        return ""
    slots = sorted({int(s) for s in (~finite).nonzero()[:, 1].tolist()})
    return f"non-finite values: {counts} in slots {slots}"


def validate_dataset(
    dataset_dir: str | os.PathLike[str],
    n_slots: int,
    hidden: int,
    hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
) -> list[tuple[int, str]]:
    """Check every row of a prepared dataset against its hidden-state file (full check).

    Returns ``(row, reason)`` for each row whose file is missing or corrupt; empty when the
    dataset is complete and ready for training.
    """
    dataset_dir = Path(dataset_dir)
    rows = dataset_column(dataset_dir, "input_ids")
    problems = []
    for row, ids in enumerate(rows):
        check = validate(sample_path(hidden_states_dir(dataset_dir), row), ids, n_slots, hidden, hidden_states_dtype)
        if not check.ok:
            problems.append((row, f"{check.state.value}: {check.reason}"))
    return problems


class _HeaderOnly:
    """Shape and dtype of a tensor without its data (what ``validate`` checks first)."""

    def __init__(self, shape: list[int], dtype: torch.dtype) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype


_SAFETENSORS_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPE_NAMES.items()}


def _load_header_and_tokens(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The file's ``__metadata__`` and its tensors: token ids read, the states' header only."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        for key in handle.keys():
            if key == TOKEN_IDS_KEY:
                out[key] = handle.get_tensor(key)
            else:
                piece = handle.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                out[key] = _HeaderOnly(piece.get_shape(), dtype)
    # safe_open already refuses a file shorter than its header says (a truncated write).
    return metadata, out


def publish_dump(dump: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Move a validated server dump to its final name.

    A rename when both are on one filesystem (no second copy of hundreds of GB); otherwise a
    copy to a temp name beside the target, fsync, rename, then the dump is removed.
    """
    dump, target = Path(dump), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(dump, target)
        return target
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    with atomic_path(target) as tmp:
        shutil.copyfile(dump, tmp)
    dump.unlink()
    return target
