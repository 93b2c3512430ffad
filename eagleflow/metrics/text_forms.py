"""The two text forms of speculators' metrics, turned into records (:mod:`eagleflow.metrics.records` shape).

``rich``
    What speculators' own CLI prints: its ``FormatDictFilter`` flattens the metric dict to
    ``train/loss_0=1.234, …, epoch=0, lr=3.00e-05, global_step=12`` (floats as ``.3f`` or
    ``.2e``) and Rich wraps that over continuation lines under ``[time] INFO``.
``repr``
    The raw dict repr seen when the host configured logging before speculators did:
    ``INFO:speculators.metrics:{'train': {'loss_0': 1.2, …}, 'epoch': 0, …}``.

Validation records of the text forms carry no step; they get the step after the last
training record, which is where speculators logs them. A record cut off at the end of the
text (still being written) is skipped; any other that does not parse is an error naming its line.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from eagleflow.errors import UserError
from eagleflow.metrics.records import KINDS, preferred_lr

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A Rich record's first line: optional "[time]" column, the level, then the message.
_RICH_START = re.compile(r"^(?:\[[^\]\n]*\])?[ \t]*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[ \t]+(?=\S)", re.MULTILINE)
# Rich's right-hand "file.py:123" column on a record's first line; in a narrow console Rich
# cuts it to "long_file_na…".
_RICH_PATH = re.compile(r"\s+[\w.<>-]+(?::\d+|…)\s*\r?$")
_RICH_PAIR = re.compile(r"([\w./-]+)=([^,]*)(?:,\s*|$)")
_RICH_IS_METRIC = re.compile(r"(?:train|val)/\w")
_RICH_HINT = re.compile(r"(?:train|val)/\w+=")
# Where a speculators metric dict starts in a raw-repr log line.
_REPR_START = re.compile(r"""\{\s*['"](?:train|val)['"]\s*:""")


def looks_like_repr(text: str) -> bool:
    """Whether ``text`` holds a raw metric dict repr."""
    return bool(_REPR_START.search(text))


def looks_like_rich(text: str) -> bool:
    """Whether ``text`` holds a Rich-rendered (flattened ``train/x=…``) metric record."""
    return bool(_RICH_HINT.search(text))


def repr_records(text: str, source: str = "<text>") -> list[dict[str, Any]]:
    """Records of a log with raw ``speculators.metrics`` dict reprs; other lines are ignored."""
    lines, last_complete = text.splitlines(), text.endswith(("\n", "\r"))
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        match = _REPR_START.search(line)
        if not match:
            continue
        try:
            value = _repr_value(line[match.start() :].strip())
        except (ValueError, SyntaxError) as exc:
            if number == len(lines) and not last_complete:
                break
            raise UserError(f"{source} line {number}: metric dict does not parse ({exc}): {line[:80]!r}") from exc
        record = normalize_record(_flatten(value))
        if record is not None:
            records.append(record)
    return _fill_val_steps(records)


# Value tokens of a Python dict repr that JSON spells differently (values follow ": ").
_REPR_JSON_VALUES = (
    (": None", ": null"), (": nan", ": NaN"), (": -inf", ": -Infinity"), (": inf", ": Infinity"),
    (": True", ": true"), (": False", ": false"),
)


def _repr_value(text: str) -> Any:
    """A dict repr -> the dict.

    Metric dicts hold only names and numbers, so swapping quotes and a few value tokens makes
    them JSON, which parses far faster than ``ast``; anything else goes through ``ast``.
    """
    if '"' not in text and "\\" not in text:
        candidate = text.replace("'", '"')
        for python, json_token in _REPR_JSON_VALUES:
            if python in candidate:
                candidate = candidate.replace(python, json_token)
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            pass
    return _literal(text)


def rich_records(text: str, source: str = "<text>") -> list[dict[str, Any]]:
    """Records of speculators' Rich console output; non-metric log records are ignored."""
    if not text.endswith(("\n", "\r")):
        text = text[: max(text.rfind("\n"), 0)]  # drop the line being written
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:  # a progress bar's carriage returns can put a record mid-line
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    messages = list(_rich_messages(text))
    records: list[dict[str, Any]] = []
    for index, (offset, message) in enumerate(messages):
        if not _RICH_IS_METRIC.match(message):
            continue
        flat = {key: _scalar(value) for key, value in _RICH_PAIR.findall(message)}
        record = normalize_record(flat)
        if record is None:
            continue
        if (record["kind"] == "train" and "step" not in record) or "epoch" not in record:
            if index == len(messages) - 1:
                break  # the record is still being printed
            number = text.count("\n", 0, offset) + 1
            raise UserError(f"{source} line {number}: metric record lacks global_step/epoch: {message[:80]!r}")
        records.append(record)
    return _fill_val_steps(records)


def _rich_messages(text: str) -> Iterator[tuple[int, str]]:
    """Reassemble Rich records: (offset of the record in ``text``, full message text).

    A record starts with the time/level columns; its continuation lines are blank up to the
    message column. Rich wraps at the spaces after ``k=v,`` and folds a too-long token
    mid-word, so a piece ending in ``,`` is joined with a space and any other piece with none.
    Any other line (a progress bar, a plain print) ends the record.
    """
    starts = list(_RICH_START.finditer(text))
    for index, start in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(text)
        lines = text[start.end() : end].split("\n")
        pad = " " * (start.end() - start.start())
        message = _RICH_PATH.sub("", lines[0]).strip()
        for line in lines[1:]:
            # Rich pads every row to the console width; a shorter line is other output.
            if not line.startswith(pad):
                break
            piece = line.strip()
            if piece:  # an all-blank row is a wrapped space: the "," rule below restores it
                message += (" " if message.endswith(",") else "") + piece
        yield start.start(), message


def _scalar(text: str) -> Any:
    """A value as FormatDictFilter printed it: ``12``, ``0.123``, ``1.20e-04``, ``nan``, ``None``."""
    try:
        return float(text)  # every metric ends up in a float column; also parses nan and inf
    except ValueError:
        text = text.strip()
        return None if text == "None" else text.strip("'\"")


_NAMED_FLOATS = {"nan": math.nan, "inf": math.inf}


def _literal(text: str) -> Any:
    """``ast.literal_eval`` that also accepts ``nan`` and ``inf`` (repr of float NaN/inf)."""
    node = ast.parse(text, mode="eval").body

    def convert(item: ast.AST) -> Any:
        if isinstance(item, ast.Constant):
            return item.value
        if isinstance(item, ast.Dict):
            return {convert(k): convert(v) for k, v in zip(item.keys, item.values, strict=True) if k is not None}
        if isinstance(item, (ast.List, ast.Tuple)):
            return [convert(e) for e in item.elts]
        if isinstance(item, ast.Name) and item.id in _NAMED_FLOATS:
            return _NAMED_FLOATS[item.id]
        if isinstance(item, ast.UnaryOp) and isinstance(item.op, (ast.USub, ast.UAdd)):
            value = convert(item.operand)
            if isinstance(value, (int, float)):
                return -value if isinstance(item.op, ast.USub) else value
        if isinstance(item, ast.Call) and getattr(item.func, "id", "") == "float" and len(item.args) == 1:
            return float(convert(item.args[0]))  # float('nan') in some reprs
        raise ValueError(f"unsupported expression {ast.dump(item)[:60]}")

    return convert(node)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"train/loss_0": …}``, the same keys the Rich form prints."""
    if not isinstance(value, dict):
        return {prefix.rstrip("/"): value} if prefix else {}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update(_flatten(item, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = item
    return flat


# flattened key -> (kind or "", normalised name); "" as name drops the key. Cached: a log
# repeats the same few dozen keys tens of thousands of times.
_KEY_CACHE: dict[str, tuple[str, str]] = {}


def _normalize_key(key: str) -> tuple[str, str]:
    head, _, name = key.partition("/")
    if head in KINDS and name:
        return head, name.removesuffix("_epoch") if head == "val" else name
    if head == "profile":
        return "", name
    if head == "global_step":
        return "", "step"
    if head == "lr" and name:
        return "lr", f"lr_{name}"
    return "", "" if name else head


def normalize_record(flat: dict[str, Any]) -> dict[str, Any] | None:
    """speculators' flattened metric dict -> the JSONL record shape; ``None`` if not a metric record.

    ``train/x`` -> ``x``; ``val/x_epoch`` -> ``x``; ``profile/x`` -> ``x``; ``global_step`` ->
    ``step``; ``lr/<optimizer>`` -> ``lr_<optimizer>`` and ``lr`` (AdamW's, else the first).
    """
    kind = None
    record: dict[str, Any] = {}
    optimizer_lrs: dict[str, Any] = {}
    for key, value in flat.items():
        normalized = _KEY_CACHE.get(key)
        if normalized is None:
            normalized = _KEY_CACHE.setdefault(key, _normalize_key(key))
        group, name = normalized
        if not name:
            continue
        if group in KINDS:
            kind = group
        elif group == "lr":
            optimizer_lrs[name.removeprefix("lr_")] = value
        elif value is None or isinstance(value, str) or isinstance(value, bool):
            continue  # profile=None, or a text field: not a curve
        record[name] = value
    if kind is None:
        return None  # e.g. the hyperparameter dict speculators logs at start-up
    if "lr" not in record and optimizer_lrs:
        record["lr"] = preferred_lr(optimizer_lrs)
    record["kind"] = kind
    return record


def _fill_val_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text forms log validation without a step: use the step after the last training record."""
    last_train_step: float | None = None
    for record in records:
        if record["kind"] == "train" and isinstance(record.get("step"), (int, float)):
            last_train_step = record["step"]
        elif record["kind"] == "val" and "step" not in record and last_train_step is not None:
            record["step"] = last_train_step + 1
    return records
