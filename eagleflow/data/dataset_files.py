"""A prepared dataset's rows and columns read straight from its Arrow files, without ``datasets``.

``save_to_disk`` writes ``state.json`` (the Arrow files, the format) and Arrow IPC stream files.
Every step that reads a prepared dataset reads it here. ``datasets.load_from_disk`` costs a
second of imports, and another of torch's, because it restores the saved ``torch`` format; the
training step checks a dataset while its speculators child imports both on the other core, and
extraction and the capture check start once per shard. pyarrow (which ``datasets`` stores with)
reads a column, a row range or the row count from the memory-mapped files in milliseconds. A
dataset whose rows are an index over its files (``_indices_data_files``: a ``select`` not
flattened) is read with ``datasets`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError

STATE_FILE = "state.json"


def dataset_state(dataset: Path) -> dict[str, Any]:
    """``state.json`` of a ``save_to_disk`` folder; UserError naming the folder when there is none."""
    try:
        state = json.loads((Path(dataset) / STATE_FILE).read_text())
    except FileNotFoundError as exc:
        raise UserError(f"--dataset {dataset} is not a prepared dataset (no {STATE_FILE})") from exc
    except ValueError as exc:
        raise UserError(f"--dataset {dataset}: {STATE_FILE} is not JSON ({exc})") from exc
    if not isinstance(state, dict):
        raise UserError(f"--dataset {dataset}: {STATE_FILE} is not a JSON object")
    return state


def _tables(dataset: Path) -> list[Any]:
    import pyarrow as pa

    state = dataset_state(dataset)
    if state.get("_indices_data_files"):
        import datasets

        return [datasets.load_from_disk(str(dataset)).with_format("arrow")[:]]
    tables = []
    for entry in state.get("_data_files") or []:
        path = Path(dataset) / entry["filename"]
        try:
            # Not closed here: the table's buffers are views of the mapping.
            tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"--dataset {dataset}: cannot read {path.name} ({exc})") from exc
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
