"""DSpark's confidence calibration, as SGLang 0.5.23 records, fits and reads it (STS: sequential temperature scaling).

SGLang's DSpark scheduler (``SGLANG_RAGGED_VERIFY_MODE`` cap-accept / compact) turns the confidence head's
raw logits ``l_k`` of a block into ``c_k = sigmoid(l_k / T_k)`` and their running product, the *survival*:
the chance that the first ``k + 1`` drafts all pass. ``T_k`` comes from ``--speculative-dspark-confidence-sts-path``
(``dspark_sts.py``: ``DSparkStsCalibration``). This module owns the three files behind it:

- **the recording** (:class:`StsRecorder`, :func:`read_records`): one JSON line per request and verify step,
  ``{"confidence_raw": [l_0 … l_{γ-1}], "num_correct_drafts": n}``, the arguments of SGLang's
  ``StsDataRecorder.record`` (logits rounded to float32 as it stores them; ``n`` the greedy count of leading
  drafts equal to the target's argmax, before any cap). Each line is written whole and flushed: a killed
  recorder leaves every finished record and at most one torn last line. :func:`write_sglang_shard` converts
  it to SGLang's own shard (``stem.<i>.pt`` = ``{"logits": [N, γ] f32, "prefix_mask": [N, γ] f32}``), which
  ``python -m sglang.benchmark.dspark_sts_fit`` reads;
- **the fit** (:func:`fit_temperatures`): ``sglang/benchmark/dspark_sts_fit.py``'s, step for step. Every row
  counts at every position, labelled ``prefix_mask[k] = (k < n)``: a position after the first rejected draft
  is a 0, not left out. Position by position, greedily, ``T_k`` is the first of 41 temperatures
  (``logspace(0.1, 10)`` in float32, as ``torch.logspace`` makes them) whose survival ``s_{k-1} ·
  sigmoid(l_k / T)`` has the lowest ECE against that label (only a strictly lower one replaces it); that
  fitted survival carries on to ``k + 1``. ECE: 15 equal-width bins of the probability clamped to
  ``[1e-8, 1 - 1e-8]``, ``Σ_b n_b · |mean p_b − mean y_b| / N``; ``ece_before`` is that of the survival with
  every T = 1, ``ece_after`` the fitted one, both on the rows fitted;
- **the calibration file** (:func:`write_calibration`, :func:`read_calibration`): the JSON object
  ``DSparkStsCalibration`` decodes: ``temperatures`` (γ, each > 0), ``dataset``, ``num_samples``,
  ``ece_before``, ``ece_after``.

numpy only: torch is imported by :func:`write_sglang_shard` alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from eagleflow.errors import UserError, excerpt, excerpt_repr
from eagleflow.files import atomic_path, atomic_write_json

log = logging.getLogger(__name__)

STS_FLAG = "--speculative-dspark-confidence-sts-path"
COLLECT_ENV = "SGLANG_DSPARK_STS_COLLECT_PATH"  # SGLang's own collector (identity temperatures only)
FIT_COMMAND = "python -m sglang.benchmark.dspark_sts_fit"
NUM_BINS = 15
# torch.logspace(log10(0.1), log10(10.0), steps=41) is float32; the fit widens it to float64. numpy's
# float64 logspace rounded to float32 gives the same 41 values (the parity test checks it against the wheel).
TEMPERATURE_GRID: tuple[float, ...] = tuple(float(t) for t in np.logspace(-1.0, 1.0, 41).astype(np.float32))
_EPS_PROB = 1e-8  # dspark_sts_fit's clamp: a saturated probability still falls in the first or last bin


@dataclass(frozen=True)
class StsRecord:
    """One request's verify step: the raw confidence logits of its γ drafted positions and how many were accepted.

    :param confidence_raw: the confidence head's logits before the sigmoid, one per drafted position,
        rounded to float32 (what SGLang's recorder stores).
    :param num_correct_drafts: the leading drafts equal to the target's argmax, ``0 .. γ``.
    """

    confidence_raw: tuple[float, ...]
    num_correct_drafts: int

    @property
    def gamma(self) -> int:
        return len(self.confidence_raw)

    def to_line(self) -> str:
        """The record as one JSON line (with its newline)."""
        return json.dumps({"confidence_raw": list(self.confidence_raw), "num_correct_drafts": self.num_correct_drafts},
                          allow_nan=False) + "\n"


def make_record(confidence_raw: Iterable[float], num_correct_drafts: int) -> StsRecord:
    """A checked :class:`StsRecord` (logits of any sequence, array or tensor, rounded to float32); ``ValueError``
    naming the field when a value cannot be one."""
    if hasattr(confidence_raw, "tolist"):  # a tensor or an array (on any device)
        confidence_raw = confidence_raw.tolist()
    try:
        values = np.asarray(list(confidence_raw), dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"confidence_raw must be a list of numbers, got {excerpt_repr(confidence_raw, 80)}") from None
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"confidence_raw must be a non-empty list of numbers, got shape {values.shape}")
    with np.errstate(over="ignore"):  # beyond float32's range becomes inf, refused just below
        rounded = values.astype(np.float32)
    if not np.all(np.isfinite(rounded)):
        raise ValueError(f"confidence_raw holds a value that is not a finite float32: {excerpt(values.tolist())}")
    if isinstance(num_correct_drafts, bool) or not isinstance(num_correct_drafts, (int, np.integer)):
        raise ValueError(f"num_correct_drafts must be an integer, got {excerpt_repr(num_correct_drafts)}")
    if not 0 <= int(num_correct_drafts) <= values.size:
        raise ValueError(f"num_correct_drafts must be within 0..{values.size} (the block's γ), got {num_correct_drafts}")
    return StsRecord(tuple(float(v) for v in rounded), int(num_correct_drafts))


class StsRecorder:
    """Appends :class:`StsRecord` lines to a JSONL file, one whole line per write, flushed.

    Opening an existing file appends to it; a torn last line (a recorder killed mid-write) is cut off
    first, so the next record starts on a line of its own. Use as a context manager, or :meth:`close`.

    :param path: the recording (created with its folder when missing).
    :param gamma: drafted positions per block; every record must have this many logits.
    """

    def __init__(self, path: str | os.PathLike[str], gamma: int) -> None:
        self.path = Path(path)
        self.gamma = int(gamma)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_tail(self.path)
        self._handle: IO[str] | None = open(self.path, "a", encoding="utf-8")

    def record(self, confidence_raw: Iterable[float], num_correct_drafts: int) -> StsRecord:
        """Append one verify step of one request; returns the record as written."""
        if self._handle is None:
            raise ValueError(f"{self.path}: the recorder is closed")
        record = make_record(confidence_raw, num_correct_drafts)
        if record.gamma != self.gamma:
            raise ValueError(f"{self.path}: {record.gamma} confidence logits for a recorder of gamma {self.gamma}")
        self._handle.write(record.to_line())  # one write of a whole line: a kill tears at most this one
        self._handle.flush()
        return record

    def close(self) -> None:
        """Flush and close the file (a second call does nothing)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> StsRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drop_torn_tail(path: Path) -> None:
    """Cut ``path`` back to its last complete line, if its end is a torn line (never a finished record)."""
    if not path.is_file():
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        handle.truncate(keep)
    log.warning("%s: cut off a torn last line (%d bytes, a recorder stopped mid-write)", path, len(data) - keep)


def read_records(path: str | os.PathLike[str], gamma: int | None = None) -> list[StsRecord]:
    """Every record of a recording, in order; ``UserError`` naming the file and line of the first bad one.

    A last line without its newline is torn (the recorder stopped mid-write) and refused, saying how many
    whole records precede it; blank lines are skipped.

    :param path: a file :class:`StsRecorder` wrote.
    :param gamma: the γ every record must have; ``None`` takes the first record's.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such confidence recording") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the confidence recording ({exc})") from None
    lines = text.split("\n")  # a complete file ends with "\n": its last piece is empty
    records: list[StsRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        if number == len(lines):
            raise UserError(f"{where}: torn record (no newline at its end: the recorder stopped mid-write); the "
                            f"{len(records)} records before it are whole — record again, or cut the file back to them")
        try:
            row = json.loads(line, parse_constant=_refuse_constant)
        except (json.JSONDecodeError, ValueError) as exc:
            raise UserError(f"{where}: not a JSON record ({exc}): {excerpt_repr(line, 80)}") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for name in ("confidence_raw", "num_correct_drafts"):
            if name not in row:
                raise UserError(f"{where}: field {name} is missing")
        try:
            record = make_record(_numbers(row, "confidence_raw", where), row["num_correct_drafts"])
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None
        expected = gamma if gamma is not None else (records[0].gamma if records else record.gamma)
        if record.gamma != expected:
            raise UserError(f"{where}: field confidence_raw has {record.gamma} logits, but the recording's gamma is {expected}")
        records.append(record)
    return records


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _numbers(data: dict[str, Any], name: str, where: str) -> tuple[float, ...]:
    """``data[name]`` (absent: empty) as a list of JSON numbers; ``UserError`` naming ``where`` and the field."""
    value = data.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise UserError(f"{where}: field {name} must be a list of numbers, got {excerpt_repr(value, 80)}")
    return tuple(float(v) for v in value)


def record_arrays(records: Sequence[StsRecord]) -> tuple[np.ndarray, np.ndarray]:
    """``(logits, prefix_mask)``, both ``[N, γ]`` float32: the tensors of SGLang's shard for ``records``."""
    if not records:
        raise UserError("no confidence records: nothing to fit or write")
    gammas = {r.gamma for r in records}
    if len(gammas) != 1:
        raise UserError(f"the confidence records mix block sizes (gamma {sorted(gammas)}); fit one gamma at a time")
    logits = np.array([r.confidence_raw for r in records], dtype=np.float32)
    counts = np.array([r.num_correct_drafts for r in records], dtype=np.int64)
    prefix_mask = (np.arange(logits.shape[1])[None, :] < counts[:, None]).astype(np.float32)
    return logits, prefix_mask


def write_sglang_shard(path: str | os.PathLike[str], records: Sequence[StsRecord]) -> Path:
    """``records`` as one shard of SGLang's collector (``torch.save`` of ``logits`` and ``prefix_mask``), atomically.

    Name the shards ``<stem>.<i>.pt`` as SGLang's ``StsDataRecorder`` does, then
    ``python -m sglang.benchmark.dspark_sts_fit --data-glob '<stem>.*.pt' --out sts.json`` fits them.
    """
    import torch

    logits, prefix_mask = record_arrays(records)
    with atomic_path(path) as tmp:
        torch.save({"logits": torch.from_numpy(logits), "prefix_mask": torch.from_numpy(prefix_mask)}, tmp)
    return Path(path)


def expected_calibration_error(probs: np.ndarray, targets: np.ndarray, num_bins: int = NUM_BINS) -> float:
    """``dspark_sts_fit.expected_calibration_error``: equal-width bins on [0, 1], NaN for no rows."""
    probs = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), _EPS_PROB, 1.0 - _EPS_PROB)
    targets = np.asarray(targets, dtype=np.float64).reshape(-1)
    total = probs.size
    if total == 0:
        return float("nan")
    bins = np.clip((probs * num_bins).astype(np.int64), 0, num_bins - 1)  # .long() truncates; p > 0
    count = np.bincount(bins, minlength=num_bins).astype(np.float64)
    pred_sum = np.bincount(bins, weights=probs, minlength=num_bins)
    target_sum = np.bincount(bins, weights=targets, minlength=num_bins)
    denom = np.maximum(count, 1.0)
    bin_error = np.abs(pred_sum / denom - target_sum / denom)
    return float((bin_error * count).sum()) / total


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflows to inf for very negative x: the sigmoid is 0 there
        return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class StsCalibration:
    """The content of a calibration file: ``DSparkStsCalibration``'s fields.

    :param temperatures: ``T_k``, one per drafted position (γ of them), each > 0.
    :param dataset: where the fitted rows came from (free text).
    :param num_samples: rows fitted.
    :param ece_before: per-position ECE of the survival with every T = 1.
    :param ece_after: the same with the fitted temperatures.
    """

    temperatures: tuple[float, ...]
    dataset: str = ""
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def confidence(self, confidence_raw: Any) -> np.ndarray:
        """``sigmoid(raw / T_k)`` per position (``raw`` ``[..., γ]``), in float32 as SGLang's ``apply_sts`` computes it."""
        raw = np.asarray(confidence_raw, dtype=np.float32)
        return _sigmoid(raw / np.asarray(self.temperatures, dtype=np.float32)).astype(np.float32)

    def survival(self, confidence_raw: Any) -> np.ndarray:
        """The running product of :meth:`confidence` along the last axis: the chance the first k + 1 drafts all pass."""
        return np.cumprod(self.confidence(confidence_raw), axis=-1)

    def to_json(self) -> dict[str, Any]:
        return {"temperatures": list(self.temperatures), "dataset": self.dataset, "num_samples": self.num_samples,
                "ece_before": list(self.ece_before), "ece_after": list(self.ece_after)}


def fit_temperatures(records: Sequence[StsRecord], *, dataset: str = "", num_bins: int = NUM_BINS,
                     grid: Sequence[float] = TEMPERATURE_GRID) -> StsCalibration:
    """Per-position temperatures for recorded verify steps, as ``python -m sglang.benchmark.dspark_sts_fit`` fits them
    (its ``fit_sts_temperatures``, step for step: see the module's docstring).

    :param records: the recording (:func:`read_records`); one γ throughout.
    :param dataset: what the file names as its data (SGLang's fit writes its ``--data-glob``).
    :param num_bins: ECE bins (SGLang's ``--num-bins``); ``grid``: the temperatures tried, in order.
    :returns: the temperatures, ``ece_before`` / ``ece_after`` per position and ``num_samples``.
    """
    logits32, prefix_mask = record_arrays(records)
    logits = logits32.astype(np.float64)  # SGLang stores float32 and fits in float64
    grid = [float(t) for t in grid]
    temperatures: list[float] = []
    ece_before: list[float] = []
    ece_after: list[float] = []
    survival_at_one = np.ones(len(records))
    survival_fitted = np.ones(len(records))
    for position in range(logits.shape[1]):
        position_logits, target = logits[:, position], prefix_mask[:, position]
        survival_at_one = survival_at_one * _sigmoid(position_logits)
        ece_before.append(expected_calibration_error(survival_at_one, target, num_bins))
        best_temperature = grid[0]
        best_survival = survival_fitted * _sigmoid(position_logits / best_temperature)
        best_ece = expected_calibration_error(best_survival, target, num_bins)
        for temperature in grid[1:]:
            candidate = survival_fitted * _sigmoid(position_logits / temperature)
            candidate_ece = expected_calibration_error(candidate, target, num_bins)
            if candidate_ece < best_ece:  # strictly lower: a tie keeps the earlier (smaller) T
                best_temperature, best_survival, best_ece = temperature, candidate, candidate_ece
        temperatures.append(best_temperature)
        ece_after.append(best_ece)
        survival_fitted = best_survival
    return StsCalibration(tuple(temperatures), dataset, len(records), tuple(ece_before), tuple(ece_after))


def calibration_errors(records: Sequence[StsRecord], temperatures: Sequence[float], num_bins: int = NUM_BINS) -> list[float]:
    """Per-position ECE of the survival under ``temperatures`` on ``records`` (e.g. rows held out of the fit)."""
    logits, prefix_mask = record_arrays(records)
    if logits.shape[1] != len(temperatures):
        raise UserError(f"{len(temperatures)} temperatures for records of gamma {logits.shape[1]}")
    probs = np.cumprod(_sigmoid(logits.astype(np.float64) / np.asarray(temperatures, dtype=np.float64)), axis=1)
    return [expected_calibration_error(probs[:, k], prefix_mask[:, k], num_bins) for k in range(logits.shape[1])]


def write_calibration(path: str | os.PathLike[str], calibration: StsCalibration) -> Path:
    """Write the calibration file SGLang reads from ``--speculative-dspark-confidence-sts-path``, atomically.

    Checked first as ``DSparkStsCalibration`` checks it (at least one temperature, each > 0), so a file
    SGLang would refuse at start-up is never published.
    """
    _check_calibration(calibration.to_json(), str(path))
    return atomic_write_json(path, calibration.to_json())


def read_calibration(path: str | os.PathLike[str], gamma: int | None = None) -> StsCalibration:
    """The calibration file at ``path``; ``UserError`` naming the file and the field SGLang would refuse.

    Refused: what ``DSparkStsCalibration`` refuses (not a JSON object, ``temperatures`` missing, empty, not
    numbers, or one ≤ 0; a field of the wrong type), a length other than ``gamma`` (SGLang's planner
    refuses that at start-up: "refit the table for gamma=…"), and ``ece_before``/``ece_after`` lists
    whose length is neither 0 nor γ (a damaged file).

    :param gamma: the γ the drafter runs with; ``None`` accepts any.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except FileNotFoundError:
        raise UserError(f"{path}: no such STS calibration file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not a JSON STS calibration ({excerpt(exc)})") from None
    calibration = _check_calibration(data, str(path))
    if gamma is not None and calibration.gamma != gamma:
        raise UserError(f"{path}: field temperatures has {calibration.gamma} values, but the drafter's gamma is {gamma} "
                        f"(SGLang refuses it at start-up); refit the calibration for gamma={gamma}")
    return calibration


def _check_calibration(data: Any, source: str) -> StsCalibration:
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if "temperatures" not in data:
        raise UserError(f"{source}: field temperatures is missing")
    temperatures = _numbers(data, "temperatures", source)
    if not temperatures:
        raise UserError(f"{source}: field temperatures is empty; it needs one per drafted position")
    bad = [k for k, t in enumerate(temperatures) if not (t > 0 and math.isfinite(t))]
    if bad:
        raise UserError(f"{source}: field temperatures[{bad[0]}] is {temperatures[bad[0]]}; every temperature must be > 0")
    dataset = data.get("dataset", "")
    if not isinstance(dataset, str):
        raise UserError(f"{source}: field dataset must be a string, got {excerpt_repr(dataset, 80)}")
    num_samples = data.get("num_samples", 0)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int):
        raise UserError(f"{source}: field num_samples must be an integer, got {excerpt_repr(num_samples, 80)}")
    eces = {name: _numbers(data, name, source) for name in ("ece_before", "ece_after")}
    for name, values in eces.items():
        if len(values) not in (0, len(temperatures)):
            raise UserError(f"{source}: field {name} has {len(values)} values for {len(temperatures)} temperatures")
    return StsCalibration(temperatures, dataset, num_samples, eces["ece_before"], eces["ece_after"])
