"""prepare-dataset: chat and token-id input into the §3.3 dataset; every bad-row case named."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from eagleflow.__main__ import main as cli
from eagleflow.data.prepare import BadRows, PrepareConfig, prepare_dataset


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def load(path: Path) -> datasets.Dataset:
    return datasets.load_from_disk(str(path)).with_format(None)


def test_chat_rows_get_assistant_loss_masks(tmp_path: Path, random_tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    rows = [chat(("user", "count from 1 to 5"), ("assistant", "1 2 3 4 5")), chat(("user", "hi"), ("assistant", "hello there"))]
    cfg = PrepareConfig(input=write_jsonl(tmp_path / "in.jsonl", rows), tokenizer=random_tiny_model, out=tmp_path / "ds")
    summary = prepare_dataset(cfg)
    assert summary["rows"] == 2 and summary["truncated"] == 0
    table = load(tmp_path / "ds")
    assert table.features["input_ids"].feature.dtype == "int64" and table.features["seq_len"].dtype == "int64"
    tokenizer = AutoTokenizer.from_pretrained(str(random_tiny_model))
    for row, record in zip(table, rows):
        assert row["input_ids"] == list(tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"])
        assert row["seq_len"] == len(row["input_ids"])
        masked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert record["messages"][-1]["content"] in masked
        assert record["messages"][0]["content"] not in masked


def test_pretokenized_rows_truncation_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": list(range(1, 11))}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "in.parquet")
    cfg = PrepareConfig(input=tmp_path / "in.parquet", tokenizer=tmp_path, out=tmp_path / "ds", max_len=4, vocab_size=100)
    summary = prepare_dataset(cfg)
    assert summary["truncated"] == 1 and summary["tokens"] == 7
    table = load(tmp_path / "ds")
    assert table["input_ids"] == [[1, 2, 3], [1, 2, 3, 4]]
    assert table["loss_mask"] == [[0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ("{not json", "unparsable JSON"),
        ("", "empty line"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1, "x", 3]}, "input_ids[1] = 'x' is not an integer"),
        ({"input_ids": [1, 2.5]}, "input_ids[1] = 2.5 is not an integer"),
        ({"input_ids": [1, 500]}, "input_ids[1] = 500 is outside the verifier's vocabulary"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "no assistant tokens"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask has 1 entries"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": []}, "non-empty list"),
        ({"text": "hello"}, "neither 'input_ids' nor 'messages'"),
    ],
)
def test_each_bad_row_case_fails_naming_the_row(tmp_path: Path, record: object, reason: str) -> None:
    good = {"input_ids": [1, 2, 3]}
    path = write_jsonl(tmp_path / "in.jsonl", [good, good, record])
    cfg = PrepareConfig(input=path, tokenizer=tmp_path, out=tmp_path / "ds", vocab_size=100)
    with pytest.raises(BadRows) as caught:
        prepare_dataset(cfg)
    assert caught.value.errors[0][0] == 2
    assert reason in caught.value.errors[0][1]
    assert "row 2:" in str(caught.value)
    assert not (tmp_path / "ds").exists()  # nothing written


def test_skip_bad_rows_keeps_order_and_writes_a_report(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1]}, "{bad", {"input_ids": [2, 3]}])
    cfg = PrepareConfig(input=path, tokenizer=tmp_path, out=tmp_path / "ds", vocab_size=100, skip_bad_rows=True)
    assert prepare_dataset(cfg)["skipped_bad_rows"] == 1
    assert load(tmp_path / "ds")["input_ids"] == [[1], [2, 3]]
    report = [json.loads(line) for line in (tmp_path / "ds" / "bad_rows.jsonl").read_text().splitlines()]
    assert report[0]["row"] == 1 and "unparsable" in report[0]["reason"]


def test_the_error_lists_only_the_first_20_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", ["{bad"] * 25)
    with pytest.raises(BadRows) as caught:
        prepare_dataset(PrepareConfig(input=path, tokenizer=tmp_path, out=tmp_path / "ds", vocab_size=100))
    text = str(caught.value)
    assert "25 bad row(s)" in text and "row 19:" in text and "row 20:" not in text and "and 5 more" in text


def test_rerun_with_same_input_is_a_no_op_and_keeps_hidden_states(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}])
    cfg = PrepareConfig(input=path, tokenizer=tmp_path, out=tmp_path / "ds", vocab_size=100)
    prepare_dataset(cfg)
    keep = tmp_path / "ds" / "hidden_states" / "hs_0.safetensors"
    keep.parent.mkdir()
    keep.write_bytes(b"x")
    arrow = next((tmp_path / "ds").glob("data-*.arrow"))
    mtime = arrow.stat().st_mtime_ns
    prepare_dataset(cfg)
    assert arrow.stat().st_mtime_ns == mtime and keep.exists()
    write_jsonl(path, [{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert prepare_dataset(cfg)["rows"] == 2 and keep.exists()
    assert load(tmp_path / "ds")["input_ids"] == [[1, 2], [3]]


def test_cli_exit_code_2_for_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", ["{bad"])
    code = cli(["prepare-dataset", "--input", str(path), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "ds"), "--vocab-size", "10"])
    assert code == 2
    assert "row 0: unparsable JSON" in capsys.readouterr().err
    assert cli(["prepare-dataset", "--input", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "ds")]) == 2
