"""The synthetic conversations: deterministic, structured, varied in length; make-dataset writes them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagleflow.__main__ import main as cli
from eagleflow.errors import UserError
from eagleflow.demo.synthetic_data import LONG_FRACTION, corpus_text, generate_conversations


def test_same_seed_same_rows_other_seed_other_rows_and_rows_do_not_depend_on_the_count() -> None:
    first = generate_conversations(60, seed=3)
    assert first == generate_conversations(60, seed=3)
    assert first[:25] == generate_conversations(25, seed=3)
    other = generate_conversations(60, seed=4)
    assert sum(a != b for a, b in zip(first, other)) > 50


def test_conversations_are_well_formed_chats() -> None:
    for row, conversation in enumerate(generate_conversations(300, seed=0)):
        messages = conversation["messages"]
        assert set(conversation) == {"messages"}
        if messages[0]["role"] == "system":
            messages = messages[1:]
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2), f"row {row}: {roles}"
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conversation["messages"])


def test_answers_follow_from_the_questions() -> None:
    """The structure the tiny verifier is meant to learn is really there: check the rules."""
    checked = {"count": 0, "arithmetic": 0, "repeat": 0, "say": 0}
    for conversation in generate_conversations(400, seed=1):
        messages = [m for m in conversation["messages"] if m["role"] != "system"]
        for user, assistant in zip(messages[::2], messages[1::2]):
            question, answer = user["content"], assistant["content"]
            if match := re.fullmatch(r"(?:Please )?[Cc]ount from (\d+) (?:up )?to (\d+)[.?]|Can you count from (\d+) up to (\d+)\?", question):
                a, b = (int(g) for g in match.groups() if g is not None)
                assert answer == " ".join(str(n) for n in range(a, b + 1))
                checked["count"] += 1
            elif match := re.search(r"(\d+) (plus|minus|times) (\d+)", question):
                a, op, b = int(match[1]), match[2], int(match[3])
                result = {"plus": a + b, "minus": a - b, "times": a * b}[op]
                assert answer == f"{a} {op} {b} is {result}."
                checked["arithmetic"] += 1
            elif question.startswith("Repeat after me: "):
                assert answer == question.removeprefix("Repeat after me: ")
                checked["repeat"] += 1
            elif match := re.fullmatch(r"Say (\w+) (\d+) times\.", question):
                assert answer.split() == [match[1]] * int(match[2])
                checked["say"] += 1
    assert all(n >= 5 for n in checked.values()), checked


def test_lengths_vary_and_some_conversations_are_long() -> None:
    conversations = generate_conversations(600, seed=0)
    chars = [sum(len(m["content"]) for m in c["messages"]) for c in conversations]
    turns = [len(c["messages"]) for c in conversations]
    long = sum(t >= 16 for t in turns) / len(turns)
    assert LONG_FRACTION / 2 < long < LONG_FRACTION * 1.6
    assert min(chars) < 40 and max(chars) > 1500
    assert sum(t <= 3 for t in turns) > len(turns) / 3  # most are short


def test_corpus_text_holds_the_conversations() -> None:
    text = corpus_text(5, seed=2)
    for conversation in generate_conversations(5, seed=2):
        for message in conversation["messages"]:
            assert f"{message['role']}\n{message['content']}" in text
    assert corpus_text(5, seed=2) == text
    with pytest.raises(UserError, match="--rows"):
        generate_conversations(-1)


# ---- make-dataset ------------------------------------------------------------------------


def test_make_dataset_writes_jsonl_deterministically_and_reports_lengths(
    tmp_path: Path, random_tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "data" / "train.jsonl"
    argv = ["make-dataset", "--verifier", str(random_tiny_model), "--out", str(out), "--rows", "300"]
    assert cli(argv) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows == generate_conversations(300, seed=0)
    assert not list(out.parent.glob(".*.tmp"))  # written atomically, nothing left beside it
    assert out.stat().st_mode & 0o444 == 0o444  # readable by the other users of the pipeline

    match = re.search(r"min (\d+) mean ([\d.]+) max (\d+), (\d+) longer than 256 tokens", summary)
    assert match, summary
    low, mean, high, over = int(match[1]), float(match[2]), int(match[3]), int(match[4])
    assert low < 60 and high > 512 and low < mean < high
    assert 0.05 * len(rows) < over < 0.25 * len(rows)  # about LONG_FRACTION of them get truncated at 256

    # The summary measured what prepare-dataset will see: the tokenizer's chat template.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(random_tiny_model))
    lengths = [len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]) for r in rows]
    assert (min(lengths), max(lengths), sum(n > 256 for n in lengths)) == (low, high, over)

    same = tmp_path / "same.jsonl"
    other = tmp_path / "other.jsonl"
    assert cli(argv[:3] + ["--out", str(same), "--rows", "300"]) == 0
    assert cli(argv[:3] + ["--out", str(other), "--rows", "300", "--seed", "1"]) == 0
    assert same.read_bytes() == out.read_bytes()
    assert other.read_bytes() != out.read_bytes()


def test_make_dataset_bad_input_is_a_clear_error(tmp_path: Path, random_tiny_model: Path, capsys) -> None:
    out = tmp_path / "x.jsonl"
    assert cli(["make-dataset", "--verifier", str(tmp_path / "nope"), "--out", str(out), "--rows", "5"]) == 2
    assert "--verifier" in capsys.readouterr().err
    assert cli(["make-dataset", "--verifier", str(random_tiny_model), "--out", str(out), "--rows", "0"]) == 2
    assert "--rows" in capsys.readouterr().err
    assert not out.exists()


def test_thinking_conversations_think_before_each_answer_and_every_fourth_calls_a_tool() -> None:
    from eagleflow.data import chat_of
    from eagleflow.demo.synthetic_data import thinking_conversation

    plain = generate_conversations(8, seed=0)
    rows = [thinking_conversation(c, row) for row, c in enumerate(plain)]
    assert rows == [thinking_conversation(c, row) for row, c in enumerate(plain)]  # deterministic
    for row, (conversation, original) in enumerate(zip(rows, plain)):
        chat = chat_of(conversation)
        assert not isinstance(chat, str), chat  # a row the reader takes, tools and all
        answers = [m for m in chat.messages if m["role"] == "assistant" and m.get("content")]
        assert [m["content"] for m in answers] == [m["content"] for m in original["messages"] if m["role"] == "assistant"]
        assert all(m["reasoning_content"] for m in chat.messages if m["role"] == "assistant")
        calls = [m for m in chat.messages if m.get("tool_calls")]
        assert (len(calls), bool(chat.tools)) == ((1, True) if row % 4 == 0 else (0, False)), row
