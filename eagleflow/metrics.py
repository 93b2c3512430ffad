"""Training metrics in, one pandas DataFrame out: the one module that parses metrics.

Three forms of the same records are read, and all end up with the same column names:

``jsonl``
    ``<run>/train/metrics.jsonl`` written by ``eagleflow train``: one JSON object per line,
    ``{"kind": "train"|"val", "step", "epoch", "lr", "loss", "loss_0", "full_acc_0",
    "cond_acc_0", …, "tokens_per_s", "time"}``.
``rich``
    What speculators' own CLI prints: its ``FormatDictFilter`` flattens the metric dict to
    ``train/loss_0=1.234, …, epoch=0, lr=3.00e-05, global_step=12`` (floats as ``.3f`` or
    ``.2e``) and Rich wraps that over continuation lines under ``[time] INFO``.
``repr``
    The raw dict repr seen when the host configured logging before speculators did:
    ``INFO:speculators.metrics:{'train': {'loss_0': 1.2, …}, 'epoch': 0, …}``.

Normalised columns: ``kind``, ``step``, ``epoch``, ``time``, ``lr``, ``loss``, then per TTT
step k ``loss_k``, ``full_acc_k``, ``cond_acc_k`` (and any other metric speculators logs,
such as ``kl_div_k``), then the rest (``tokens_per_s``, profile timings, ``lr_<optimizer>``).
Validation records of the text forms carry no step; they get the step after the last
training record, which is where speculators logs them.

The last line of a file may be half-written while training runs: it is skipped. Any other
line that looks like a record but does not parse is an error naming the line.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eagleflow.errors import UserError

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "FORMS",
    "detect_form",
    "latest_metrics",
    "parse_jsonl",
    "parse_metrics",
    "parse_repr_log",
    "parse_rich_log",
    "read_metrics",
    "records_to_frame",
    "ttt_steps",
]

Form = Literal["jsonl", "rich", "repr"]
FORMS: tuple[str, ...] = ("jsonl", "rich", "repr")

KINDS = ("train", "val")
# Columns every frame has, in this order, even when empty.
BASE_COLUMNS = ["kind", "step", "epoch", "time", "lr", "loss"]
# Per-TTT-step metric names, in the order they are shown.
STEP_METRICS = ("loss", "full_acc", "cond_acc")

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TTT_COLUMN = re.compile(r"^([a-z_]+?)_(\d+)$")
# A Rich record's first line: optional "[time]" column, the level, then the message.
_RICH_START = re.compile(r"^(?:\[[^\]\n]*\])?[ \t]*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[ \t]+(?=\S)", re.MULTILINE)
# Rich's right-hand "file.py:123" column on a record's first line.
_RICH_PATH = re.compile(r"\s+[\w.<>-]+:\d+\s*\r?$")
_RICH_PAIR = re.compile(r"([\w./-]+)=([^,]*)(?:,\s*|$)")
_RICH_IS_METRIC = re.compile(r"(?:train|val)/\w")
# Where a speculators metric dict starts in a raw-repr log line.
_REPR_START = re.compile(r"""\{\s*['"](?:train|val)['"]\s*:""")


# ---------------------------------------------------------------------------------------
# reading


def read_metrics(path: str | os.PathLike[str], form: str = "auto") -> pd.DataFrame:
    """Load a metrics file (any of the three forms, detected unless ``form`` is given).

    :param path: ``metrics.jsonl``, or a log holding speculators' Rich or raw-repr output.
    :param form: ``"auto"``, ``"jsonl"``, ``"rich"`` or ``"repr"``.
    :raises UserError: the file is missing or a complete line does not parse.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError as exc:
        raise UserError(f"metrics file {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise UserError(f"metrics file {path} is a folder, expected a file") from exc
    return parse_metrics(text, form=form, source=str(path))


def parse_metrics(text: str, form: str = "auto", source: str = "<text>") -> pd.DataFrame:
    """Parse metrics ``text`` in ``form`` (``"auto"`` detects it) into the normalised frame."""
    if form == "auto":
        form = detect_form(text)
    parsers = {"jsonl": parse_jsonl, "rich": parse_rich_log, "repr": parse_repr_log}
    if form not in parsers:
        raise UserError(f"unknown metrics form {form!r}; expected auto, {', '.join(FORMS)}")
    return parsers[form](text, source=source)


def detect_form(text: str) -> Form:
    """Which of the three forms ``text`` is: JSON lines, raw dict reprs, or Rich-rendered text.

    Text with no metric record at all counts as ``jsonl`` (an empty or just-created file).
    """
    for line in text.splitlines():
        stripped = line.strip()
        if stripped:
            if stripped.startswith("{") and stripped[1:].lstrip().startswith('"'):
                return "jsonl"
            break
    if _REPR_START.search(text):
        return "repr"
    if re.search(r"(?:train|val)/\w+=", text):
        return "rich"
    return "jsonl"


def _complete_lines(text: str) -> tuple[list[str], bool]:
    """The lines of ``text`` and whether the last one is complete (ends with a newline)."""
    lines = text.splitlines()
    return lines, text.endswith(("\n", "\r"))


def parse_jsonl(text: str, source: str = "<text>") -> pd.DataFrame:
    """``metrics.jsonl`` text -> frame; a half-written last line is skipped."""
    lines, last_complete = _complete_lines(text)
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        is_last = number == len(lines)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if is_last and not last_complete:
                break  # still being written
            raise UserError(f"{source} line {number}: not a JSON object ({exc.msg}): {line[:80]!r}") from exc
        if not isinstance(record, dict):
            raise UserError(f"{source} line {number}: expected a JSON object, got {type(record).__name__}")
        if record.get("kind") not in KINDS:
            continue  # other record kinds (summaries, config) are not curves
        records.append(record)
    return records_to_frame(records)


def parse_repr_log(text: str, source: str = "<text>") -> pd.DataFrame:
    """A log with raw ``speculators.metrics`` dict reprs -> frame; other lines are ignored."""
    lines, last_complete = _complete_lines(text)
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
    return records_to_frame(_fill_val_steps(records))


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


def parse_rich_log(text: str, source: str = "<text>") -> pd.DataFrame:
    """speculators' Rich console output -> frame; non-metric log records are ignored."""
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
    return records_to_frame(_fill_val_steps(records))


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
    optimizer_lrs: list[tuple[str, Any]] = []
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
            optimizer_lrs.append((name, value))
        elif value is None or isinstance(value, str) or isinstance(value, bool):
            continue  # profile=None, or a text field: not a curve
        record[name] = value
    if kind is None:
        return None  # e.g. the hyperparameter dict speculators logs at start-up
    if "lr" not in record and optimizer_lrs:
        record["lr"] = dict(optimizer_lrs).get("lr_AdamW", optimizer_lrs[0][1])
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


def _column_order(columns: Iterable[str]) -> list[str]:
    """BASE_COLUMNS, then per TTT step (loss, full_acc, cond_acc, others), then the rest sorted."""
    per_step: dict[int, list[str]] = {}
    rest: list[str] = []
    for column in columns:
        if column in BASE_COLUMNS:
            continue
        match = _TTT_COLUMN.match(column)
        if match and not column.startswith("lr_"):
            per_step.setdefault(int(match.group(2)), []).append(column)
        else:
            rest.append(column)

    def metric_rank(column: str) -> tuple[int, str]:
        name = _TTT_COLUMN.match(column).group(1)  # type: ignore[union-attr]
        return (STEP_METRICS.index(name) if name in STEP_METRICS else len(STEP_METRICS), name)

    ordered = list(BASE_COLUMNS)
    for k in sorted(per_step):
        ordered += sorted(per_step[k], key=metric_rank)
    return ordered + sorted(rest)


def records_to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Normalised records -> DataFrame: ``kind`` as text, every other column float."""
    import pandas as pd

    frame = pd.DataFrame.from_records(records) if records else pd.DataFrame()
    for column in BASE_COLUMNS:
        if column not in frame.columns:
            frame[column] = pd.Series(dtype="float64")
    # Non-numeric values (a stray string) become NaN rather than turning a column to objects.
    numeric = {c: pd.to_numeric(frame[c], errors="coerce").astype("float64") for c in frame.columns if c != "kind"}
    frame = frame.assign(**numeric)
    frame["kind"] = frame["kind"].astype("str") if len(frame) else pd.Series(dtype="str")
    return frame[_column_order(frame.columns)].reset_index(drop=True)


# ---------------------------------------------------------------------------------------
# what the charts and the UI need


def ttt_steps(frame: pd.DataFrame) -> list[int]:
    """The TTT steps present in ``frame`` (from its ``loss_k`` columns), ascending."""
    steps = set()
    for column in frame.columns:
        match = re.fullmatch(r"loss_(\d+)", str(column))
        if match and frame[column].notna().any():
            steps.add(int(match.group(1)))
    return sorted(steps)


def _clean(value: Any) -> Any:
    """NaN/inf -> None and numpy scalars -> Python numbers, so the result is plain JSON."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if value.is_integer() and abs(value) < 2**53:
            return value
    return value


def latest_metrics(frame: pd.DataFrame) -> dict[str, Any]:
    """The newest training and validation numbers, as plain JSON for the UI.

    Returns ``{"records": n, "train": {step, epoch, lr, loss, tokens_per_s, time} | None,
    "val": {step, epoch, loss} | None, "ttt": [{"ttt_step": k, "train_loss",
    "train_full_acc", "train_cond_acc", "val_loss", "val_full_acc", "val_cond_acc"}, …]}``.
    """
    result: dict[str, Any] = {"records": int(len(frame)), "train": None, "val": None, "ttt": []}
    rows: dict[str, Any] = {}
    for kind in KINDS:
        subset = frame[frame["kind"] == kind] if len(frame) else frame
        if len(subset):
            row = subset.iloc[-1]
            rows[kind] = row
            keys = ("step", "epoch", "lr", "loss", "tokens_per_s", "time") if kind == "train" else ("step", "epoch", "loss")
            values = {key: _clean(row.get(key)) for key in keys}
            for key in ("step", "epoch"):  # counters: ints in the JSON
                if isinstance(values[key], float):
                    values[key] = int(values[key])
            result[kind] = values
    for k in ttt_steps(frame):
        entry: dict[str, Any] = {"ttt_step": k}
        for kind in KINDS:
            for metric in STEP_METRICS:
                row = rows.get(kind)
                entry[f"{kind}_{metric}"] = _clean(row.get(f"{metric}_{k}")) if row is not None else None
        result["ttt"].append(entry)
    return result
