"""The one reader of evaluation prompt files (``eval_prompts``): every line checked before any engine starts.

A line is a conversation in the dataset's format, ``{"messages": [{"role": …, "content": …}, …]}``
(or ``"conversations"``): the turns before the first assistant turn are the prompt, later user
turns its follow-ups; or MT-bench's ``{"turns": ["…", "…"]}``. Blank lines are skipped. Every
role, content and turn must be a string: anything else reached the chat template, which died
with a bare ``TypeError`` under a traceback. A bad line is named by its number and its field
(``line 3: messages[1].content is an int, not a string``), every bad line of the file in one
message (the first :data:`MAX_NAMED`, the rest counted), so one fix-up pass finds them all.

Reading needs no tokenizer: cheap wherever the Params are checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError
from eagleflow.evaluate.config import param_label

MAX_NAMED = 5  # bad lines named in one message; the others are counted


@dataclass(frozen=True)
class PromptRow:
    """One prompt of the file: its line number, the messages of its first turn and its later user turns."""

    line: int
    messages: list[dict[str, str]]
    followups: list[str]


def kind(value: Any) -> str:
    """What a JSON value is, as a message names it: ``an int``, ``a list``, ``null``."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an int", float: "a float", str: "a string", list: "a list", dict: "an object"}
    return "an empty list" if value == [] else names.get(type(value), f"a {type(value).__name__}")


def conversation_turns(row: Any) -> tuple[list[dict[str, str]], list[str]]:
    """A row's first prompt (the messages before its first assistant turn) and its later user turns;
    a bad row is a ValueError naming the field."""
    if not isinstance(row, dict):
        raise ValueError(f"the line is {kind(row)}, not an object with 'messages' or 'turns'")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"turns is {kind(turns)}, not a non-empty list of strings (MT-bench's format)")
        for i, turn in enumerate(turns):
            if not isinstance(turn, str):
                raise ValueError(f"turns[{i}] is {kind(turn)}, not a string")
        return [{"role": "user", "content": turns[0]}], turns[1:]
    key = "conversations" if "messages" not in row and "conversations" in row else "messages"
    if key not in row:
        raise ValueError("no 'messages' (a conversation: a list of {'role', 'content'} objects) nor MT-bench's 'turns'")
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{key} is {kind(messages)}, not a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{key}[{i}] is {kind(message)}, not an object with 'role' and 'content'")
        for name in ("role", "content"):
            if name not in message:
                raise ValueError(f"{key}[{i}] has no '{name}'")
            if not isinstance(message[name], str):
                raise ValueError(f"{key}[{i}].{name} is {kind(message[name])}, not a string")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    if not any(m["role"] == "user" for m in messages[:first]):
        raise ValueError(f"{key} has no user turn before the first assistant turn (nothing to prompt with)")
    return messages[:first], [m["content"] for m in messages[first:] if m["role"] == "user"]


def line_problem(raw: bytes) -> PromptRow | str | None:
    """A line's prompt (its number left 0), why it is not one, or None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start})"
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at column {exc.colno})"
    try:
        messages, followups = conversation_turns(record)
    except ValueError as exc:
        return str(exc)
    return PromptRow(0, messages, followups)


def read_prompt_file(path: Path) -> list[PromptRow]:
    """Every prompt of ``path``; any bad line fails the whole file, naming each bad line and field."""
    where = f"{param_label('eval_prompts')} {path}"
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise UserError(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    rows: list[PromptRow] = []
    bad: list[str] = []
    for number, raw in enumerate(lines, start=1):
        found = line_problem(raw)
        if isinstance(found, str):
            bad.append(f"line {number}: {found}")
        elif found is not None:
            rows.append(PromptRow(number, found.messages, found.followups))
    if bad:
        left = len(bad) - MAX_NAMED
        more = f"; and {left} more bad line{'s' if left > 1 else ''}" if left > 0 else ""
        raise UserError(f"{where} " + "; ".join(bad[:MAX_NAMED]) + more)
    if not rows:
        raise UserError(f"{where}: no prompt in it (it is empty or every line is blank)")
    return rows


def check_rows_held(eval_rows: int, held: int, what: str) -> None:
    """``eval_rows`` prompts from a set of ``held``: more is refused, never a silently smaller evaluation."""
    if eval_rows > held:
        raise UserError(
            f"{param_label('eval_rows')} {eval_rows}: {what} holds only {held} prompts; lower eval_rows to at most {held} "
            "(it is the number of prompts of every prompt set)"
        )


def file_set_name(path: Path) -> str:
    """The prompt set a file is reported as: its stem (one of the built-in sets' names stays "file")."""
    return "file" if path.stem in ("heldout", "humaneval") else path.stem


def check_prompt_file(path: Path | None, eval_rows: int) -> None:
    """The prompt file's checks that need no tokenizer (every line; eval_rows against its prompts): cheap enough
    for a run's first task, where the file is readable (:meth:`PipelineConfig.from_params` reads no file)."""
    if path is not None:
        rows = read_prompt_file(path)
        check_rows_held(eval_rows, len(rows), f"the prompt set {file_set_name(path)} ({param_label('eval_prompts')} {path})")
