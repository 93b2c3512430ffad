"""prepare-dataset: chat and token-id input into the §3.3 dataset; every bad-row case named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest

from eagleflow.__main__ import main as cli
from eagleflow.data.conversation import chat_of
from eagleflow.data.prepare import BadRows, PrepareConfig, prepare_dataset


DEEP = "[" * 100_000 + "]" * 100_000


def tool_call_row(arguments: str) -> dict:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]}


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
    cfg = PrepareConfig(input=write_jsonl(tmp_path / "in.jsonl", rows), verifier=random_tiny_model, out=tmp_path / "ds")
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
    cfg = PrepareConfig(input=tmp_path / "in.parquet", verifier=tmp_path, out=tmp_path / "ds", max_len=4, vocab_size=100)
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
        ({"text": "hello"}, "neither 'input_ids', 'messages' nor 'conversations'"),
        ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}, "messages[0] has no 'content'"),
        ({"messages": [{"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]},
                       {"role": "assistant", "content": "x"}]}, "messages[0] 'tool_calls' must be a non-empty list, in an assistant turn"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]},
         "messages[1] tool_calls[0] must be {'function'"),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "x"}]}, "conversations[1] must be {'from'"),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": "not json"}]},
         "conversations[1] is a function_call whose value is not JSON"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}], "tools": "{"}, "tools is a string that is not JSON"),
        ({"token_rows": [{"input_ids": [1, 2], "loss_mask": [1]}]}, "token_rows[0].loss_mask has 1 entries"),
        # A tool call's arguments as OpenAI sends them (a JSON string), but not JSON: trained on as given, it was silent.
        (tool_call_row("{city: Paris"), "messages[1] tool_calls[0].function.arguments is a string that is not JSON (Expecting "
                                        "property name enclosed in double quotes)"),
        (tool_call_row(""), "messages[1] tool_calls[0].function.arguments is a string that is not JSON"),
        # JSON nested 100,000 levels: a RecursionError traceback, wherever a row carries JSON as a string.
        (tool_call_row(DEEP), "messages[1] tool_calls[0].function.arguments is a string that holds JSON nested deeper than 100 "
                              "levels"),
        ({**chat(("user", "a"), ("assistant", "x")), "tools": DEEP}, "tools is a string that holds JSON nested deeper than 100 levels"),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": f'{{"name": "f", "arguments": {DEEP}}}'}]},
         "conversations[1] is a function_call whose value holds JSON nested deeper than 100 levels"),
        ('{"input_ids": [1], "meta": ' + "[" * 101 + "]" * 101 + "}", "JSON nested deeper than 100 levels"),  # parses, but deeper
        ('{"input_ids": [1], "meta": ' + DEEP + "}", "JSON nested deeper than 100 levels"),  # deeper than the parser goes
    ],
)
def test_each_bad_row_case_fails_naming_the_row(tmp_path: Path, record: object, reason: str) -> None:
    good = {"input_ids": [1, 2, 3]}
    path = write_jsonl(tmp_path / "in.jsonl", [good, good, record])
    cfg = PrepareConfig(input=path, verifier=tmp_path, out=tmp_path / "ds", vocab_size=100)
    with pytest.raises(BadRows) as caught:
        prepare_dataset(cfg)
    assert caught.value.errors[0][0] == 2
    assert reason in caught.value.errors[0][1]
    assert "row 2:" in str(caught.value)
    assert not (tmp_path / "ds").exists()  # nothing written


def test_skip_bad_rows_keeps_order_and_writes_a_report(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1]}, "{bad", {"input_ids": [2, 3]}])
    cfg = PrepareConfig(input=path, verifier=tmp_path, out=tmp_path / "ds", vocab_size=100, skip_bad_rows=True)
    assert prepare_dataset(cfg)["skipped_bad_rows"] == 1
    assert load(tmp_path / "ds")["input_ids"] == [[1], [2, 3]]
    report = [json.loads(line) for line in (tmp_path / "ds" / "bad_rows.jsonl").read_text().splitlines()]
    assert report[0]["row"] == 1 and "unparsable" in report[0]["reason"]


def test_the_error_lists_only_the_first_20_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", ["{bad"] * 25)
    with pytest.raises(BadRows) as caught:
        prepare_dataset(PrepareConfig(input=path, verifier=tmp_path, out=tmp_path / "ds", vocab_size=100))
    text = str(caught.value)
    assert "25 bad row(s)" in text and "row 19:" in text and "row 20:" not in text and "and 5 more" in text


def test_rerun_with_same_input_is_a_no_op_and_keeps_hidden_states(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}])
    cfg = PrepareConfig(input=path, verifier=tmp_path, out=tmp_path / "ds", vocab_size=100)
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
    code = cli(["prepare-dataset", "--input", str(path), "--verifier", str(tmp_path), "--out", str(tmp_path / "ds"), "--vocab-size", "10"])
    assert code == 2
    assert "row 0: unparsable JSON" in capsys.readouterr().err
    assert cli(["prepare-dataset", "--input", str(tmp_path / "missing.jsonl"), "--verifier", str(tmp_path), "--out", str(tmp_path / "ds")]) == 2


# ---- faults in the input file ---------------------------------------------------------------------


def test_a_byte_that_is_not_utf8_names_its_row_and_skip_bad_rows_leaves_it_out(tmp_path: Path, capsys) -> None:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"input_ids": [1, 2]}).encode(), b'{"input_ids": [3], "note": "caf\xe9"}',  # latin-1, not UTF-8
             json.dumps({"input_ids": [4, 5]}).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    args = ["prepare-dataset", "--input", str(path), "--verifier", str(tmp_path), "--out", str(tmp_path / "ds"), "--vocab-size", "10"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "row 1: not UTF-8: byte 0xe9 at byte 31 of the line" in err and "Traceback" not in err
    assert not (tmp_path / "ds").exists()
    assert cli([*args, "--skip-bad-rows"]) == 0  # the rows after it are read too
    assert load(tmp_path / "ds")["input_ids"] == [[1, 2], [4, 5]]
    report = [json.loads(line) for line in (tmp_path / "ds" / "bad_rows.jsonl").read_text().splitlines()]
    assert report == [{"row": 1, "reason": "not UTF-8: byte 0xe9 at byte 31 of the line"}]


def test_reasons_quote_a_bounded_excerpt_of_a_huge_row(tmp_path: Path) -> None:
    rows = [{"input_ids": [1, "x" * 3_000_000]}, {f"key{i}" * 50: i for i in range(2000)}, '{"input_ids": [' + "[" * 100_000]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(BadRows) as caught:
        prepare_dataset(PrepareConfig(input=path, verifier=tmp_path, out=tmp_path / "ds", vocab_size=100))
    assert [row for row, _ in caught.value.errors] == [0, 1, 2]
    assert len(str(caught.value)) < 1500, str(caught.value)[:3000]
    assert "input_ids[1] = 'xxxx" in str(caught.value) and "more characters" in str(caught.value)


def test_a_huge_message_gives_the_tokens_of_the_whole_row_without_tokenizing_it_whole(random_tiny_model: Path) -> None:
    from eagleflow.data.chat_tokens import ChatTokenizer

    words = "alpha beta gamma delta epsilon zeta theta iota ".split()
    text = " ".join(words[i % len(words)] for i in range(200_000))  # about 1.2 MB
    full, cut = ChatTokenizer(random_tiny_model), ChatTokenizer(random_tiny_model, max_len=256)
    cases = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
        # The huge message first: cut alone, the next message's tokens would move into the first 256.
        [{"role": "user", "content": text}, {"role": "assistant", "content": "short"}],
        [{"role": "user", "content": text[:3000]}, {"role": "assistant", "content": text[:9000]}, {"role": "user", "content": "x"}],
    ]
    for messages in cases:
        ids, mask = full(messages)
        assert cut(messages) == (ids[:257], mask[:257])


def test_preparing_a_huge_row_takes_a_small_multiple_of_its_size(tmp_path: Path, random_tiny_model: Path) -> None:
    """Measured in a process of its own: the peak resident memory (VmHWM, reset after a warm-up run) while
    an 8 MB message is prepared. Tokenized whole it took about 200 times its size."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from eagleflow.data.prepare import PrepareConfig, prepare_dataset
        folder, model = Path({str(tmp_path)!r}), Path({str(random_tiny_model)!r})
        def write(path, content):
            rows = [{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": content}}]}}] * 2
            path.write_text("".join(json.dumps(row) + "\\n" for row in rows))
        def peak():
            return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        write(folder / "small.jsonl", "short")
        prepare_dataset(PrepareConfig(input=folder / "small.jsonl", verifier=model, out=folder / "warm", max_len=256))
        words = "alpha beta gamma delta epsilon zeta theta ".split()
        write(folder / "big.jsonl", " ".join(words[i % 7] for i in range(8_000_000 // 6))[:4_000_000])
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from what is resident now
        before = peak()
        summary = prepare_dataset(PrepareConfig(input=folder / "big.jsonl", verifier=model, out=folder / "big", max_len=256))
        print(json.dumps({{"growth": peak() - before, "row": (folder / "big.jsonl").stat().st_size // 2, "summary": summary}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["summary"]["rows"] == 2 and measured["summary"]["truncated"] == 2
    assert measured["growth"] < 8 * measured["row"], measured  # was ~200x



@pytest.mark.parametrize("tear", ["half", "end marker"])
def test_a_torn_arrow_file_in_an_input_datasets_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], tear: str) -> None:
    """Cut in half, datasets raised an OSError naming no file; cut at a record batch's end (only the end marker
    missing), it read fewer rows without a word. A dataset already prepared at --out is kept as it was."""
    rows = [{"input_ids": [1 + row % 7, 2]} for row in range(2500)]  # datasets writes 1000 rows a record batch
    folder = tmp_path / "input"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    args = ["prepare-dataset", "--input", str(folder), "--verifier", str(tmp_path), "--out", str(tmp_path / "ds"),
            "--vocab-size", "10"]
    assert cli(args) == 0
    before = load(tmp_path / "ds")["input_ids"]
    (arrow,) = folder.glob("data-*.arrow")
    os.truncate(arrow, arrow.stat().st_size // 2 if tear == "half" else arrow.stat().st_size - 8)
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert f"error: --input {folder}: {arrow.name} is cut short (" in err and "write it again (save_to_disk)" in err, err
    assert "Traceback" not in err
    assert load(tmp_path / "ds")["input_ids"] == before == [row["input_ids"] for row in rows]


def test_an_empty_input_file_says_it_has_no_usable_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in.jsonl").write_bytes(b"")
    args = ["prepare-dataset", "--input", str(tmp_path / "in.jsonl"), "--verifier", str(tmp_path), "--out", str(tmp_path / "ds"),
            "--vocab-size", "10"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert f"error: --input {tmp_path / 'in.jsonl'} has no usable rows (it holds no rows: an empty file?)" in err
    assert "Traceback" not in err and not (tmp_path / "ds").exists()
    write_jsonl(tmp_path / "in.jsonl", ["{bad"])  # every row bad and left out: none usable either
    assert cli([*args, "--skip-bad-rows"]) == 2
    assert "has no usable rows (all 1 are bad, left out)" in capsys.readouterr().err


def test_a_row_whose_assistant_turn_lies_past_max_len_says_where_and_by_how_much(tmp_path: Path, random_tiny_model: Path) -> None:
    from eagleflow.data.chat_tokens import ChatTokenizer

    long = chat(("user", "count the words of this " * 40), ("assistant", "forty"))
    [(_, mask)] = ChatTokenizer(random_tiny_model).rows(chat_of(long))  # tokenized whole: where the answer starts
    first = mask.index(1)
    rows = [chat(("user", "hi"), ("assistant", "hello")), long, {"input_ids": list(range(1, 31)), "loss_mask": [0] * 20 + [1] * 10}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(BadRows) as caught:
        prepare_dataset(PrepareConfig(input=path, verifier=random_tiny_model, out=tmp_path / "ds", max_len=16))
    assert caught.value.errors == [
        (1, f"its first assistant token is at position {first:,}, beyond --max-len 16 by {first - 15:,} tokens: nothing of it is "
            f"trained on (--max-len {first + 1:,} keeps it)"),
        (2, "its first assistant token is at position 20, beyond --max-len 16 by 5 tokens: nothing of it is trained on "
            "(--max-len 21 keeps it)"),
    ]
    assert not (tmp_path / "ds").exists()
    summary = prepare_dataset(PrepareConfig(input=path, verifier=random_tiny_model, out=tmp_path / "ds", max_len=first + 1))
    assert summary["rows"] == 3 and summary["skipped_bad_rows"] == 0  # the --max-len it named keeps them
