"""A prepared dataset's rows and columns read straight from its Arrow files, without ``datasets``.

``save_to_disk`` writes ``state.json`` (the Arrow files, the format), ``dataset_info.json`` (the
features) and Arrow IPC stream files. Every step that reads a prepared dataset reads it here. ``datasets.load_from_disk`` costs a
second of imports, and another of torch's, because it restores the saved ``torch`` format; the
training step checks a dataset while its speculators child imports both on the other core, and
extraction and the capture check start once per shard. pyarrow (which ``datasets`` stores with)
reads a column, a row range or the row count from the memory-mapped files in milliseconds. A
dataset whose rows are an index over its files (``_indices_data_files``: a ``select`` not
flattened) is read with ``datasets`` itself.

Every read first checks that the folder is whole (:func:`check_dataset_files`): each file
``datasets.load_from_disk`` opens (speculators reads the dataset that way, in the trainer) is
there, not empty, whole JSON or a whole Arrow stream. A torn file is named before any work starts,
instead of surfacing as a traceback of the trainer, or as a silently shorter dataset: an Arrow
stream cut at a record batch's end reads without an error, only its end marker is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError, excerpt

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
# What datasets.load_from_disk reads of state.json: one missing is a KeyError in the trainer.
STATE_KEYS = ("_data_files", "_fingerprint", "_format_columns", "_format_kwargs", "_format_type", "_output_all_columns", "_split")
# The end-of-stream marker a closed Arrow IPC stream writer leaves (continuation, then a 0 length).
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
REMEDY = "the prepared dataset is not whole (a write cut short?); prepare it again (prepare-dataset)"


@dataclass(frozen=True)
class FolderRole:
    """How messages name a checked folder: its setting, what it should be, and what to do about a torn one."""

    flag: str = "--dataset"
    kind: str = "prepared dataset"
    remedy: str = REMEDY


PREPARED = FolderRole()


def _torn(dataset: Path, name: str, what: str, role: FolderRole = PREPARED) -> UserError:
    return UserError(f"{role.flag} {dataset}: {name} {what}; {role.remedy}")


def _json_object(dataset: Path, name: str, role: FolderRole = PREPARED) -> dict[str, Any]:
    path = Path(dataset) / name
    try:
        text = path.read_bytes()
    except FileNotFoundError as exc:
        raise UserError(f"{role.flag} {dataset} is not a {role.kind} (no {name})") from exc
    except OSError as exc:
        raise UserError(f"{role.flag} {dataset}: cannot read {name} ({exc})") from exc
    if not text.strip():
        raise _torn(dataset, name, f"is empty ({len(text)} bytes)", role)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _torn(dataset, name, f"is not whole JSON ({len(text)} bytes: {exc})", role) from exc
    if not isinstance(value, dict):
        raise _torn(dataset, name, "is not a JSON object", role)
    return value


def dataset_state(dataset: Path) -> dict[str, Any]:
    """``state.json`` of a ``save_to_disk`` folder; UserError naming the folder when there is none."""
    return _json_object(dataset, STATE_FILE)


def check_dataset_files(dataset: Path, role: FolderRole = PREPARED) -> tuple[dict[str, Any], dict[str, Any]]:
    """Refuse, naming the file, a folder whose ``state.json``, ``dataset_info.json`` or Arrow files are
    missing, empty or cut short; return ``(state, info)``. Reads the two JSON files and the last bytes
    of each Arrow file: milliseconds, whatever the dataset's size.

    :param role: how messages name the folder (preparation's input is ``--input``, a datasets folder).
    """
    state = _json_object(dataset, STATE_FILE, role)
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise _torn(dataset, STATE_FILE, f"lacks {', '.join(missing)}", role)
    files = [*(state.get("_data_files") or []), *(state.get("_indices_data_files") or [])]
    if not state.get("_data_files") or not all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise _torn(dataset, STATE_FILE, f"names no Arrow files (_data_files: {excerpt(state.get('_data_files'))})", role)
    info = _json_object(dataset, INFO_FILE, role)
    if not isinstance(info.get("features"), (dict, type(None))):
        raise _torn(dataset, INFO_FILE, "has features that are not a JSON object", role)
    for entry in files:
        _check_arrow_stream(dataset, entry["filename"], role)
    return state, info


def _check_arrow_stream(dataset: Path, name: str, role: FolderRole) -> None:
    path = Path(dataset) / name
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(max(0, size - len(ARROW_STREAM_END)))
            tail = handle.read()
    except FileNotFoundError as exc:
        raise _torn(dataset, name, f"is missing ({STATE_FILE} names it)", role) from exc
    except OSError as exc:
        raise UserError(f"{role.flag} {dataset}: cannot read {name} ({exc})") from exc
    if size == 0:
        raise _torn(dataset, name, "is empty (0 bytes)", role)
    if tail != ARROW_STREAM_END:
        raise _torn(dataset, name, f"is cut short ({size} bytes, without the Arrow stream's end marker)", role)


def _check_features(dataset: Path, info: dict[str, Any], columns: list[str]) -> None:
    """``datasets`` refuses features in ``dataset_info.json`` other than the Arrow files' columns."""
    features = info.get("features")
    if features is not None and sorted(features) != sorted(columns):
        raise _torn(dataset, INFO_FILE, f"lists features {sorted(features)}, the Arrow files hold columns {sorted(columns)}")


def _tables(dataset: Path) -> list[Any]:
    import pyarrow as pa

    state, info = check_dataset_files(dataset)
    if state.get("_indices_data_files"):
        import datasets

        return [datasets.load_from_disk(str(dataset)).with_format("arrow")[:]]
    tables = []
    for entry in state["_data_files"]:
        path = Path(dataset) / entry["filename"]
        try:
            # Not closed here: the table's buffers are views of the mapping.
            tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
        except (OSError, pa.ArrowInvalid) as exc:
            raise _torn(dataset, path.name, f"is not a readable Arrow stream ({exc})") from exc
    _check_features(dataset, info, list(tables[0].column_names))
    return tables
def dataset_shape(dataset: Path) -> tuple[int, list[str]]:
    """``(rows, column names)`` of a prepared dataset."""
    table = dataset_table(dataset)
    return table.num_rows, list(table.column_names)


def dataset_table(dataset: Path, columns: Sequence[str] = ()) -> Any:
    """The dataset as one ``pyarrow.Table`` over the memory-mapped files (nothing is copied).

    :param columns: only these columns; one the dataset lacks is a UserError naming it.
    """
    import pyarrow as pa

    tables = _tables(dataset)
    table = pa.concat_tables(tables) if tables else pa.table({})
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise UserError(f"--dataset {dataset} has no {missing[0]!r} column (columns: {table.column_names})")
    return table.select(list(columns)) if columns else table


def dataset_column(dataset: Path, name: str) -> list[Any]:
    """Every row's value of column ``name``, in row order."""
    return dataset_table(dataset, [name]).column(name).to_pylist()


# The columns that make a prepared row (seq_len is their length); what a training, the vocabulary and
# the held-out prompts read of it.
ROW_COLUMNS = ("input_ids", "loss_mask")


def dataset_fingerprint(dataset: Path, hidden_states: bool = True) -> dict[str, Any]:
    """What a prepared dataset's content is, for a step to tell whether it changed: its rows by content
    (:func:`rows_digest`: the same rows written again, or files only touched, are the same dataset) and,
    with ``hidden_states``, the path, size and modification time of every hidden-state file (GBs: hashing
    them would cost a read of each; every writer replaces them, so a rewrite shows). The vocabulary
    files beside the rows (made from them) are not part of it."""
    from eagleflow.layout import hidden_states_dir
    from eagleflow.reuse import file_identities

    try:
        rows: dict[str, Any] = rows_digest(dataset)
    except UserError as exc:
        rows = {"unreadable": str(exc)}  # torn: the step's own check says so
    return {"rows": rows, **({"hidden_states": file_identities([hidden_states_dir(dataset)])} if hidden_states else {})}


def rows_digest(dataset: Path) -> dict[str, Any]:
    """``{"rows": n, "sha256": …}``: a hash of the prepared rows' ``input_ids`` and ``loss_mask``, each row's
    length and values in row order, read from the memory-mapped Arrow files (about a second per GB: no copy
    but the hash), whatever files or batches they are split into."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset_table(dataset, ROW_COLUMNS)
    digest = hashlib.sha256()
    for name in ROW_COLUMNS:
        lengths, values = hashlib.sha256(), hashlib.sha256()
        column = table.column(name)
        for chunk in column.chunks:
            if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
                lengths.update(np.ascontiguousarray(pc.list_value_length(chunk).fill_null(-1).to_numpy(), np.int64))
                chunk = pc.list_flatten(chunk)  # the values the rows see, whatever slice of the buffer they are
            values.update(np.ascontiguousarray(chunk.to_numpy(zero_copy_only=False)))
        digest.update(f"{name} {column.type} {column.null_count} {lengths.hexdigest()} {values.hexdigest()}\n".encode())
    return {"rows": table.num_rows, "sha256": digest.hexdigest()}
