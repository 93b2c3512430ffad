"""Training metrics in, one pandas DataFrame out: the one module that reads metrics files.

Three forms of the same records are read, and all end up with the same column names:
``jsonl`` (``<run>/train/metrics.jsonl``, :mod:`eagleflow.metrics.records`), and speculators'
own ``rich`` and ``repr`` log output (:mod:`eagleflow.metrics.text_forms`).

Normalised columns: ``kind``, ``step``, ``epoch``, ``time``, ``lr``, ``loss``, then per TTT
step k ``loss_k``, ``full_acc_k``, ``cond_acc_k`` (and any other metric speculators logs,
such as ``kl_div_k``); a block drafter's ``eal``, ``full_acc``, ``position_k_acc`` (k ascending)
and its loss terms ``<term>_loss``; then the rest (``tokens_per_s``, profile timings,
``lr_<optimizer>``).

The last line of a file may be half-written while training runs: it is skipped. Any other
line that looks like a record but does not parse is an error naming the line.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eagleflow.errors import UserError
from eagleflow.metrics.records import (
    BLOCK_METRICS,
    KINDS,
    STEP_METRICS,
    block_positions_of,
    iter_jsonl,
    loss_terms_of,
    ttt_steps_of,
)
from eagleflow.metrics.text_forms import looks_like_repr, looks_like_rich, repr_records, rich_records

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "FORMS",
    "block_positions",
    "detect_form",
    "drafter_of",
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

# Columns every frame has, in this order, even when empty.
BASE_COLUMNS = ["kind", "step", "epoch", "time", "lr", "loss"]

_TTT_COLUMN = re.compile(r"^([a-z_]+?)_(\d+)$")


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
    if looks_like_repr(text):
        return "repr"
    if looks_like_rich(text):
        return "rich"
    return "jsonl"


def parse_jsonl(text: str, source: str = "<text>") -> pd.DataFrame:
    """``metrics.jsonl`` text -> frame; a half-written last line is skipped."""
    # Other record kinds (summaries, config) are not curves.
    return records_to_frame([r for r in iter_jsonl(text, source) if r.get("kind") in KINDS])


def parse_rich_log(text: str, source: str = "<text>") -> pd.DataFrame:
    """speculators' Rich console output -> frame; non-metric log records are ignored."""
    return records_to_frame(rich_records(text, source))


def parse_repr_log(text: str, source: str = "<text>") -> pd.DataFrame:
    """A log with raw ``speculators.metrics`` dict reprs -> frame; other lines are ignored."""
    return records_to_frame(repr_records(text, source))


def _column_order(columns: Iterable[str]) -> list[str]:
    """BASE_COLUMNS, then per TTT step (loss, full_acc, cond_acc, others), then a block drafter's
    (eal, full_acc, position_k_acc by k, loss terms), then the rest sorted."""
    columns = list(columns)
    per_step: dict[int, list[str]] = {}
    block = [name for name in BLOCK_METRICS if name in columns]
    block += [f"position_{k}_acc" for k in block_positions_of(columns)] + sorted(loss_terms_of(columns))
    rest: list[str] = []
    for column in columns:
        if column in BASE_COLUMNS or column in block:
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
    return ordered + block + sorted(rest)


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
    """The TTT steps present in ``frame`` (from its ``loss_k`` columns with data), ascending."""
    return [k for k in ttt_steps_of(frame.columns) if frame[f"loss_{k}"].notna().any()]


def block_positions(frame: pd.DataFrame) -> list[int]:
    """A block drafter's slots present in ``frame`` (its ``position_k_acc`` columns with data), ascending."""
    return [k for k in block_positions_of(frame.columns) if frame[f"position_{k}_acc"].notna().any()]


def drafter_of(frame: pd.DataFrame) -> str | None:
    """``"block"`` for a block drafter's metrics (``eal`` or ``position_k_acc`` with data), ``"eagle3"``
    for per-TTT-step ones (``loss_k``), None when neither is there yet."""
    if block_positions(frame) or ("eal" in frame.columns and frame["eal"].notna().any()):
        return "block"
    return "eagle3" if ttt_steps(frame) else None


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

    Returns ``{"records": n, "drafter": "eagle3" | "block" | None, "train": {step, epoch, lr,
    loss, tokens_per_s, time} | None, "val": {step, epoch, loss} | None, "ttt": [{"ttt_step": k,
    "train_loss", "train_full_acc", "train_cond_acc", "val_loss", "val_full_acc", "val_cond_acc"},
    …], "positions": []}`` (:func:`drafter_of` says which drafter). A block drafter's has no
    ``ttt`` rows; its ``train`` and ``val`` also hold ``eal`` and ``full_acc`` (and each loss
    term), and ``positions`` is ``[{"position": k, "train_acc", "val_acc"}, …]`` per block slot.
    """
    drafter = drafter_of(frame)
    result: dict[str, Any] = {"records": int(len(frame)), "drafter": drafter, "train": None, "val": None, "ttt": [],
                              "positions": []}
    block_keys = (*BLOCK_METRICS, *sorted(loss_terms_of(frame.columns))) if drafter == "block" else ()
    rows: dict[str, Any] = {}
    for kind in KINDS:
        subset = frame[frame["kind"] == kind] if len(frame) else frame
        if len(subset):
            row = subset.iloc[-1]
            rows[kind] = row
            keys = ("step", "epoch", "lr", "loss", "tokens_per_s", "time") if kind == "train" else ("step", "epoch", "loss")
            keys += block_keys
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
    for k in block_positions(frame) if drafter == "block" else ():
        slot: dict[str, Any] = {"position": k}
        for kind in KINDS:
            row = rows.get(kind)
            slot[f"{kind}_acc"] = _clean(row.get(f"position_{k}_acc")) if row is not None else None
        result["positions"].append(slot)
    return result
