"""What an input row is: the one owner of the formats preparation and regeneration read.

Rows come from a JSONL file, a Parquet file or a ``datasets`` folder (``save_to_disk``), one at a
time. A row is one of:

- pre-tokenized: ``input_ids`` (and optionally ``loss_mask``), used as given;
- OpenAI-style chat: ``messages``, each ``{"role", "content"}`` with, for an assistant turn,
  ``reasoning_content`` (or ``reasoning``: the thinking) and ``tool_calls`` (``content`` may then be
  null), ``tool`` messages with the tools' results, and a row-level ``tools`` list the chat template
  renders;
- ShareGPT: ``conversations``, each ``{"from", "value"}`` (``human``/``user``, ``gpt``/``assistant``,
  ``system``, ``tool``/``observation``/``function_response``, and ``function_call``: a tool call as
  JSON ``{"name", "arguments"}``), as most drafter datasets ship and as speculators and SpecForge read.

:func:`chat_of` maps a chat row, whatever its format, to one :class:`Chat` (OpenAI-style
messages, ``reasoning`` renamed ``reasoning_content``, the form chat templates read), or says why
it cannot, naming the message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleflow.data.dataset_files import FolderRole, check_dataset_files
from eagleflow.errors import UserError, excerpt, excerpt_repr

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers -> OpenAI roles. function_call is an assistant turn that calls a tool.
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool", "function_call": "assistant",
}
INPUT_KINDS = ".jsonl, .json (one object per line), .parquet, or a datasets folder (save_to_disk)"
# JSON nested deeper than this (a row's line, a tools string, a function_call's value, a tool call's arguments) is
# refused: no conversation needs it, and Python's parser recurses once per level (100,000 levels: RecursionError).
MAX_JSON_DEPTH = 100
TOO_DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels"
# How the check of a datasets folder's files names an input folder, and what a torn one needs.
INPUT_FOLDER_REMEDY = "the datasets folder is not whole (a copy or write cut short?); write it again (save_to_disk)"
INPUT_FOLDER = FolderRole("--input", "datasets folder", INPUT_FOLDER_REMEDY)


class JsonTooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH` levels."""


def load_json(text: str) -> Any:
    """``json.loads(text)``, refusing JSON nested deeper than :data:`MAX_JSON_DEPTH` levels.

    :raises json.JSONDecodeError: not JSON.
    :raises JsonTooDeep: nested too deep (what the parser cannot recurse through included).
    """
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise JsonTooDeep(TOO_DEEP) from exc
    # Only text with that many brackets can nest that deep: most rows are never walked.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _deeper_than(value, MAX_JSON_DEPTH):
        raise JsonTooDeep(TOO_DEEP)
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:  # not recursive: the depth it measures is unbounded
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def json_of(text: str) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, why)`` to follow "a string that": ``is not JSON (…)`` or ``holds JSON nested …``."""
    try:
        return load_json(text), None
    except json.JSONDecodeError as exc:
        return None, f"is not JSON ({exc.msg})"
    except JsonTooDeep:
        return None, f"holds JSON {TOO_DEEP}"


@dataclass
class Chat:
    """One conversation as chat templates read it: OpenAI-style ``messages`` and the row's ``tools`` (or None)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # the chat template's switches (chat_template_kwargs)

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``apply_chat_template`` besides the messages: the tools and the switches."""
        return {**self.kwargs, **({"tools": self.tools} if self.tools else {})}


def is_chat_row(record: dict[str, Any]) -> bool:
    """Whether the row is a conversation (in any format :func:`chat_of` reads), not token ids. (A Parquet file or a
    datasets folder that mixes formats holds null in the columns a row does not use: null is absent.)"""
    return record.get("messages") is not None or record.get("conversations") is not None


def chat_of(record: dict[str, Any]) -> Chat | str:
    """The row's conversation, or why it is not a usable one (naming the message and field)."""
    if record.get("messages") is not None:
        messages = record["messages"]
        where = "messages"
    elif record.get("conversations") is not None:
        messages = sharegpt_messages(record["conversations"])
        if isinstance(messages, str):
            return messages
        where = "conversations"
    else:
        return f"row has neither 'input_ids', 'messages' nor 'conversations' (keys: {excerpt_repr(sorted(record)[:10], 120)})"
    if not isinstance(messages, list) or not messages:
        return f"{where} must be a non-empty list"
    checked = []
    for i, message in enumerate(messages):
        problem = message_problem(message)
        if problem:
            return f"{where}[{i}] {problem}"
        checked.append(normal_message(message))
    if not any(m["role"] == "assistant" for m in checked):
        return "no assistant message (nothing to train on)"
    tools = record.get("tools")
    if isinstance(tools, str):  # Parquet and ShareGPT exports often carry the tools as a JSON string
        tools, why = json_of(tools) if tools.strip() else (None, None)
        if why:
            return f"tools is a string that {why}"
    if tools is not None and not isinstance(tools, list):
        return f"tools must be a list of tool definitions, got {type(tools).__name__}"
    return Chat(checked, tools or None)


def check_messages(messages: Any) -> str | None:
    """Why ``messages`` (OpenAI-style) is not a usable chat, or None: the rule preparation and regeneration share."""
    chat = chat_of({"messages": messages})
    return chat if isinstance(chat, str) else None


def message_problem(message: Any) -> str | None:
    """Why one OpenAI-style message cannot be rendered, or None."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        return f"must be an object with 'role' one of {', '.join(ROLES)}"
    content, calls = message.get("content"), message.get("tool_calls")
    if content is not None and not isinstance(content, str):
        return "'content' must be a string (or null in an assistant turn that calls tools)"
    if content is None and not (message["role"] == "assistant" and calls):
        return "has no 'content' (only an assistant turn that calls tools may leave it null)"
    thinking = message.get("reasoning_content", message.get("reasoning"))
    if thinking is not None and (message["role"] != "assistant" or not isinstance(thinking, str)):
        return "'reasoning_content' must be a string, in an assistant turn"
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list) or not calls:
            return "'tool_calls' must be a non-empty list, in an assistant turn"
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return f"tool_calls[{j}] must be {{'function': {{'name': …, 'arguments': …}}}}"
            # OpenAI's form: the arguments as a JSON string. One that is not JSON would be trained on as given.
            if isinstance(function.get("arguments"), str) and (why := json_of(function["arguments"])[1]):
                return f"tool_calls[{j}].function.arguments is a string that {why}"
    return None


def normal_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message as templates read it: ``reasoning`` named ``reasoning_content``, and no null field but
    ``content`` (a Parquet file or datasets folder gives every message every column, null where unused)."""
    out = {k: v for k, v in message.items() if k != "reasoning" and (v is not None or k == "content")}
    if message.get("reasoning") is not None and message.get("reasoning_content") is None:
        out["reasoning_content"] = message["reasoning"]
    return out


def sharegpt_messages(turns: Any) -> list[dict[str, Any]] | str:
    """ShareGPT ``conversations`` as OpenAI-style messages, or why they cannot be."""
    if not isinstance(turns, list) or not turns:
        return "conversations must be a non-empty list"
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            return f"conversations[{i}] must be {{'from': one of {', '.join(SHAREGPT_ROLES)}, 'value': a string}}"
        role = SHAREGPT_ROLES[turn["from"]]
        if turn["from"] == "function_call":
            call, why = json_of(turn["value"])
            if why:
                return f"conversations[{i}] is a function_call whose value {why}"
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return f"conversations[{i}] is a function_call whose value is not {{'name': …, 'arguments': …}}"
            function = {"name": call["name"], "arguments": call.get("arguments", {})}
            messages.append({"role": role, "content": None, "tool_calls": [{"type": "function", "function": function}]})
        else:
            messages.append({"role": role, "content": turn["value"]})
    return messages


def read_input_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Yield ``(row, record)`` one row at a time; a row that is not usable JSON yields ``(row, why)``.

    A JSONL line is decoded on its own, so a byte that is not UTF-8 names its row (and
    ``--skip-bad-rows`` can leave it out) instead of ending the file; no reason quotes more than a
    bounded excerpt of the row.
    """
    if not path.exists():
        raise UserError(f"--input {path} does not exist")
    if path.is_dir():
        yield from _dataset_folder_rows(path)
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):  # never the whole file at once
            for record in batch.to_pylist():
                yield row, record
                row += 1
        return
    if path.suffix not in (".jsonl", ".json"):
        raise UserError(f"--input {path}: expected {INPUT_KINDS}")
    with open(path, "rb") as handle:
        for row, raw in enumerate(handle):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield row, f"not UTF-8: byte 0x{raw[exc.start]:02x} at byte {exc.start} of the line"
                continue
            if not line.strip():
                yield row, "empty line"
                continue
            try:
                record = load_json(line)
            except json.JSONDecodeError as exc:
                yield row, f"unparsable JSON: {exc.msg} at column {exc.colno}"
                continue
            except JsonTooDeep:
                yield row, f"JSON {TOO_DEEP}"
                continue
            yield row, record if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"


def _dataset_folder(path: Path) -> Any:
    """The ``datasets`` folder at ``path`` (memory-mapped, not loaded), or a UserError saying what it is not.

    Its files are checked first (:func:`~eagleflow.data.dataset_files.check_dataset_files`): a torn Arrow file is
    named, where ``datasets`` raises an OSError naming none, or reads a file cut at a batch's end as fewer rows.
    """
    if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise UserError(f"--input {path} is a folder but not a datasets folder (save_to_disk writes state.json); expected {INPUT_KINDS}")
    import datasets

    split = path if (path / "state.json").is_file() else path / "train"
    if split != path and not (split / "state.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise UserError(f"--input {path} holds splits {splits} and none is 'train'")
    check_dataset_files(split, INPUT_FOLDER)
    with _unreadable_folder(path):
        loaded = datasets.load_from_disk(str(path))
    return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded


@contextmanager
def _unreadable_folder(path: Path) -> Iterator[None]:
    """What the file check cannot see (a file torn inside), as a UserError naming the folder."""
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"--input {path}: cannot read the datasets folder ({excerpt(exc)}); {INPUT_FOLDER_REMEDY}") from exc


def _dataset_folder_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    table = _dataset_folder(path)
    table.reset_format()  # plain Python values, whatever format it was saved with
    for row in range(len(table)):
        with _unreadable_folder(path):
            record = table[row]
        yield row, record


def count_input_rows(path: Path) -> int:
    """How many rows :func:`read_input_rows` will yield (for progress), without parsing them."""
    if path.is_dir():
        return len(_dataset_folder(path))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")
