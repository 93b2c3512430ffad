"""The shapes of the reports the run page reads (``eval/report.json``, ``eval/compare.json``, ``verify/<engine>/report.json``,
a drafter's ``train/result.json``).

Every field is optional and a nested object defaults to an empty one, so a report of another shape
(valid JSON, wrong types) is named on the page instead of failing it; keys the page does not read
pass through. Light on purpose (pydantic only), as :mod:`eagleflow.report.run_page` is.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from eagleflow.errors import excerpt

Number = Annotated[float, Field(allow_inf_nan=False)]


def _empty_if_none(value: Any) -> Any:
    return {} if value is None else value


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _Speeds(_Shape):
    drafter: Number | None = None
    baseline: Number | None = None
    speedup: Number | None = None
    disturbed: bool = False


class _TokensPerS(_Shape):
    single_stream: Annotated[_Speeds, BeforeValidator(_empty_if_none)] = _Speeds()
    concurrent: Annotated[_Speeds, BeforeValidator(_empty_if_none)] = _Speeds()


class _AcceptLength(_Shape):
    mean: Number | None = None
    p50: Number | None = None
    p90: Number | None = None
    per_prompt: list[Number] = []


class _OfflineEstimate(_Shape):
    """An EAGLE-3 drafter's: 1 + Σ ``full_acc``; a block drafter's (``method: "eal"``): its ``eal``,
    with the accuracy per block slot in ``position_acc``."""

    accept_length: Number | None = None
    source: str | None = Field(None, alias="from")
    method: str | None = None
    full_acc: list[Number] = []
    position_acc: list[Number] = []


class _Spread(_Shape):
    median: Number | None = None
    min: Number | None = None
    max: Number | None = None
    disturbed: bool = False


class _SetFigures(_Shape):
    accept_length: Annotated[_AcceptLength, BeforeValidator(_empty_if_none)] = _AcceptLength()
    accept_rate: Number | None = None
    tokens_per_s: Annotated[_Spread, BeforeValidator(_empty_if_none)] = _Spread()
    speedup: Annotated[_Spread, BeforeValidator(_empty_if_none)] = _Spread()


class _SweepRow(_Shape):
    config: str
    batch_size: int
    steps: int
    sets: dict[str, _SetFigures] = {}


class _Fastest(_Shape):
    config: str
    mean_speedup: Number | None = None
    sglang_flags: list[str] = []


class EvaluationShape(_Shape):
    """What the run page reads from ``eval/report.json``."""

    engine: str | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] = {}
    concurrency: int | None = None
    num_steps: int | None = None
    accept_length: Annotated[_AcceptLength, BeforeValidator(_empty_if_none)] = _AcceptLength()
    accept_rate: Number | None = None
    tokens_per_s: Annotated[_TokensPerS, BeforeValidator(_empty_if_none)] = _TokensPerS()
    same_tokens_as_baseline: Number | None = None
    offline_estimate: _OfflineEstimate | None = None
    versions: dict[str, str | None] = {}
    prompt_sets: list[str] = []
    rounds: int | None = None
    sweep: list[_SweepRow] = []
    fastest: dict[str, _Fastest] = {}


class _ComparedConfig(_Shape):
    config: str
    batch_size: int
    sglang_flags: list[str] = []
    sets: dict[str, _SetFigures] = {}


class _Best(_Fastest):
    """A drafter's fastest config at one batch size; across drafters, also which drafter (and, for the winner, the batch size)."""

    drafter: str | None = None
    batch_size: int | None = None
    spread: list[Number | None] = []
    accept_length: Number | None = None


class _ComparedDrafter(_Shape):
    label: str
    algorithm: str | None = None
    parameters: int | None = None
    bytes: int | None = None
    train_seconds: Number | None = None
    notes: list[str] = []
    configs: list[_ComparedConfig] = []


class _Missing(_Shape):
    drafter: str
    reason: str = ""


class ComparisonShape(_Shape):
    """What the run page reads from ``eval/compare.json`` (``python -m eagleflow compare``)."""

    drafters: list[_ComparedDrafter] = []
    missing: list[_Missing] = []
    mismatch: dict[str, dict[str, Any]] = {}
    fastest: dict[str, _Best] = {}
    winner: _Best | None = None


class TrainResultShape(_Shape):
    """What the run page reads from a drafter's ``train/result.json`` (the training step's result)."""

    train_seconds: Number | None = None
    best_checkpoint: str | None = None
    checkpoint_dir: str | None = None


class _Worst(_Shape):
    row: int | None = None
    position: int | None = None
    error: Number | None = None
    tolerance: Number | None = None


class _FinalSlot(_Shape):
    positions: int | None = None
    top1_agreement: Number | None = None
    worst: Annotated[_Worst, BeforeValidator(_empty_if_none)] = _Worst()


class _Slot(_Shape):
    slot: int | None = None
    layer_id: int | None = None
    mean_token_norm: Number | None = None
    std: Number | None = None
    nearest_slot: int | None = None
    nearest_distance: Number | None = None
    normed_rms_range: list[Number] | None = None


class _Engine(_Shape):
    version: str | None = None
    tp_size: int | None = None


class _Embedding(_Shape):
    equal: bool | None = None


class _ExtractionRequest(_Shape):
    cached_tokens: int | None = None


class _Tolerance(_Shape):
    atol: Number | None = None
    rtol: Number | None = None


class _Finding(_Shape):
    text: str = ""


class CaptureCheckShape(_Shape):
    """What the run page reads from ``verify/<engine>/report.json``."""

    passed: bool = False
    rows_checked: int | None = None
    rows: int | None = None
    tokens: int | None = None
    engine: Annotated[_Engine, BeforeValidator(_empty_if_none)] = _Engine()
    final_slot: Annotated[_FinalSlot, BeforeValidator(_empty_if_none)] = _FinalSlot()
    embedding: _Embedding | None = None
    extraction_request: Annotated[_ExtractionRequest, BeforeValidator(_empty_if_none)] = _ExtractionRequest()
    slots: list[_Slot] = []
    findings: list[_Finding] = []
    tolerance: Annotated[_Tolerance, BeforeValidator(_empty_if_none)] = _Tolerance()


def capture_check_summary(report: dict[str, Any]) -> dict[str, Any] | None:
    """One capture check's verdict and figures from its report (of :class:`CaptureCheckShape`), or None for an empty one."""
    if not report:
        return None
    final = report.get("final_slot") or {}
    return {
        "passed": bool(report.get("passed")),
        "rows": report.get("rows_checked") if report.get("rows_checked") is not None else report.get("rows"),
        "tokens": report.get("tokens"),
        "engine": report.get("engine") or {},
        "positions": final.get("positions"),
        "worst": final.get("worst") or {},
        "top1_agreement": final.get("top1_agreement"),
        "normed_rms_range": ((report.get("slots") or [{}])[-1]).get("normed_rms_range"),
        "embedding": report.get("embedding"),
        "extraction_request": report.get("extraction_request") or {},
        "slots": report.get("slots") or [],
        "findings": [f.get("text", "") for f in report.get("findings") or []],
        "tolerance": report.get("tolerance") or {},
    }


def shaped(model: type[BaseModel], data: dict[str, Any], path: Path, root: Path) -> dict[str, Any]:
    """``data`` checked against ``model`` as plain JSON, or ``{"error": …}`` naming the file and the first bad field."""
    try:
        return finite(model.model_validate(data).model_dump(by_alias=True))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the report"
        name = path.relative_to(root) if path.is_relative_to(root) else path
        return {"error": f"{name}: not a report of the expected shape ({where}: {excerpt(first['msg'], 120)})"}


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value
