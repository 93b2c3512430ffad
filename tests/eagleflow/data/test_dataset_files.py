"""A prepared dataset folder is whole before anything reads it: each torn file is named, by a real torn write.

speculators reads the folder with ``datasets.load_from_disk`` inside the trainer, where an empty
``dataset_info.json`` was a traceback and "speculators exited with status 1"; an Arrow stream cut at a
record batch's end reads without any error, only shorter. Every reader here (training's checks,
extraction, the capture check, the vocabulary) goes through :func:`dataset_table`, which checks first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from eagleflow.data import dataset_shape, dataset_table
from eagleflow.data.dataset_files import check_dataset_files, dataset_fingerprint
from eagleflow.data.prepare import write_training_dataset
from eagleflow.errors import UserError

ROWS = 2500  # more than datasets' 1000 rows a record batch: a stream of three batches


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ids = [[5 + row % 7, 6, 7 + row % 3] for row in range(ROWS)]
    return write_training_dataset(ids, [[1, 1, 1]] * ROWS, tmp_path_factory.mktemp("prepared") / "dataset")


@pytest.fixture
def dataset(prepared: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "dataset"
    copy.mkdir()
    for item in prepared.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    return copy


def arrow_file(dataset: Path) -> Path:
    (path,) = dataset.glob("data-*.arrow")
    return path


def message_ends(path: Path) -> list[int]:
    """Byte offsets where each message of the Arrow stream ends (schema, batches, then the end marker)."""
    stream = pa.BufferReader(path.read_bytes())
    ends = []
    while True:
        try:
            pa.ipc.read_message(stream)
        except EOFError:  # the end-of-stream marker
            return ends
        ends.append(stream.tell())


def cut(path: Path, size: int) -> None:
    os.truncate(path, size)


def test_a_whole_folder_passes_and_reads_every_row(dataset: Path) -> None:
    state, info = check_dataset_files(dataset)
    assert state["_format_type"] == "torch" and sorted(info["features"]) == ["input_ids", "loss_mask", "seq_len"]
    assert dataset_shape(dataset) == (ROWS, ["input_ids", "loss_mask", "seq_len"])


def test_an_arrow_stream_cut_at_a_batch_end_reads_short_without_an_error_and_is_refused(dataset: Path) -> None:
    path = arrow_file(dataset)
    ends = message_ends(path)
    assert len(ends) >= 3, ends  # the schema and at least two record batches
    cut(path, ends[1])  # the schema and the first batch: a whole stream but for its end marker
    assert len(pa.ipc.open_stream(pa.memory_map(str(path))).read_all()) == 1000, "pyarrow alone reads it, short"
    with pytest.raises(UserError) as caught:
        dataset_table(dataset, ["input_ids"])
    assert f"{path.name} is cut short ({ends[1]} bytes, without the Arrow stream's end marker)" in str(caught.value)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_key(key: str) -> Callable[[Path], None]:
    def drop(path: Path) -> None:
        state = json.loads(path.read_text())
        del state[key]
        path.write_text(json.dumps(state))

    return drop


def _other_features(path: Path) -> None:
    info = json.loads(path.read_text())
    info["features"]["labels"] = info["features"].pop("loss_mask")
    path.write_text(json.dumps(info))


@pytest.mark.parametrize(
    ("name", "damage", "said"),
    [
        ("dataset_info.json", _empty, "dataset_info.json is empty (0 bytes)"),
        ("dataset_info.json", _half, "dataset_info.json is not whole JSON"),
        ("dataset_info.json", _other_features, "dataset_info.json lists features ['input_ids', 'labels', 'seq_len']"),
        ("dataset_info.json", Path.unlink, "is not a prepared dataset (no dataset_info.json)"),
        ("state.json", _empty, "state.json is empty (0 bytes)"),
        ("state.json", _half, "state.json is not whole JSON"),
        ("state.json", _drop_key("_fingerprint"), "state.json lacks _fingerprint"),
        ("arrow", _empty, "is empty (0 bytes)"),
        ("arrow", _half, "is cut short"),
        ("arrow", Path.unlink, "is missing (state.json names it)"),
    ],
    ids=["info-empty", "info-half", "info-other-features", "info-missing", "state-empty", "state-half",
         "state-without-key", "arrow-empty", "arrow-half", "arrow-missing"],
)
def test_each_torn_file_is_named_with_what_to_do(dataset: Path, name: str, damage: Callable[[Path], None], said: str) -> None:
    path = arrow_file(dataset) if name == "arrow" else dataset / name
    damage(path)
    with pytest.raises(UserError) as caught:
        dataset_table(dataset, ["input_ids"])  # what extraction, the capture check and training read through
    message = str(caught.value)
    assert message.startswith(f"--dataset {dataset}") and path.name in message and said in message, message
    if "is not a prepared dataset" not in said:
        assert message.endswith("prepare it again (prepare-dataset)"), message


def test_the_fingerprint_is_the_rows_content_not_their_files(dataset: Path) -> None:
    """prepare_dataset run again over the same input rewrites the same rows (new Arrow file, new state.json): the
    training, the vocabulary and the evaluation made from them are still current. Another token or mask bit is not."""
    (dataset / "hidden_states").mkdir()
    (dataset / "hidden_states" / "hs_0.safetensors").write_bytes(b"states")
    before = dataset_fingerprint(dataset)
    table = dataset_table(dataset, ["input_ids", "loss_mask"])
    ids, mask = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    inode = arrow_file(dataset).stat().st_ino
    write_training_dataset(ids, mask, dataset)  # the same rows written again, as prepare-dataset does
    assert arrow_file(dataset).stat().st_ino != inode  # another file
    for item in dataset.iterdir():
        os.utime(item)  # and only touched
    assert dataset_fingerprint(dataset) == before
    assert before["rows"]["rows"] == ROWS and set(before) == {"rows", "hidden_states"}
    write_training_dataset([[*ids[0][:-1], 9], *ids[1:]], mask, dataset)
    assert dataset_fingerprint(dataset)["rows"] != before["rows"]
    write_training_dataset(ids, [[1, 1, 0], *mask[1:]], dataset)
    assert dataset_fingerprint(dataset)["rows"] != before["rows"]
    write_training_dataset(ids, mask, dataset)
    os.utime(dataset / "hidden_states" / "hs_0.safetensors", ns=(1, 1))  # hidden states: by size and time, as before
    assert dataset_fingerprint(dataset)["rows"] == before["rows"] and dataset_fingerprint(dataset) != before
    arrow_file(dataset).write_bytes(b"")
    assert "is empty" in dataset_fingerprint(dataset, hidden_states=False)["rows"]["unreadable"]
