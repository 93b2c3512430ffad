"""What a run folder holds, read for people: shards, totals, charts, latest metrics, files.

The one reader of a whole run folder (DESIGN.md §3.6), used by the UI plugin's pages and by
``make demo``'s summary. Light on purpose: no torch, so the Airflow API server can import it
(pandas is imported only when a metrics file is read).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from eagleflow.errors import UserError, excerpt
from eagleflow.extract.manifest import ShardManifest
from eagleflow.layout import RunLayout

# The charts the plot step draws (its file stem, and a title for people).
CHARTS = (("loss", "Loss per TTT step"), ("acc", "Accuracy per TTT step"))
EVAL_REPORT, EVAL_CHART = "report.json", "accept"  # written by eagleflow.evaluate.step / .report


@dataclass
class ShardSummary(ShardManifest):
    """One shard manifest with what a reader derives from it."""

    @property
    def rows(self) -> int:
        return max(self.end - self.start, 0)

    @property
    def rows_per_s(self) -> float | None:
        return self.done / self.seconds if self.seconds > 0 and self.done else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens else None

    def as_json(self) -> dict[str, Any]:
        """The shard for a page: its size is its totals over every attempt; the rates are the latest attempt's."""
        return {
            "name": self.name, "start": self.start, "end": self.end, "state": self.state, "rows": self.rows,
            "done": self.done, "skipped": self.skipped, "complete": self.total_rows, "failed": len(self.failed),
            "failed_rows": self.failed[:50], "tokens": self.total_tokens, "bytes": self.total_bytes,
            "gb": self.total_bytes / 1e9, "attempt_tokens": self.tokens, "attempt_bytes": self.bytes,
            "seconds": self.seconds, "rows_per_s": self.rows_per_s, "tokens_per_s": self.tokens_per_s,
            "updated": self.updated, "error": self.error, "engine": self.engine,
        }


def read_shards(layout: RunLayout) -> list[ShardSummary]:
    """Every ``shards/*.json`` manifest, ordered by first row; an unreadable one is shown as such."""
    shards: list[ShardSummary] = []
    if not layout.shards.is_dir():
        return shards
    for path in layout.shards.glob("*.json"):
        try:
            shards.append(ShardSummary.read(path))
        except (OSError, ValueError, TypeError) as exc:
            shards.append(ShardSummary(name=path.stem, state="unreadable", error=f"{path.name}: {exc}"))
    return sorted(shards, key=lambda s: (s.start, s.name))


class MetricsCache:
    """``latest_metrics`` of a metrics file, re-read only when the file changes (it can be MBs)."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}

    def latest(self, path: Path) -> dict[str, Any] | None:
        from eagleflow.metrics.reader import latest_metrics, read_metrics

        try:
            stat = path.stat()
        except OSError:
            return None
        key = (stat.st_mtime_ns, stat.st_size)
        cached = self._entries.get(path)
        if cached and cached[0] == key:
            return cached[1]
        try:
            latest = latest_metrics(read_metrics(path))
        except UserError as exc:
            latest = {"error": str(exc), "records": 0, "train": None, "val": None, "ttt": []}
        self._entries[path] = (key, latest)
        return latest


def readable_files(layout: RunLayout) -> list[Path]:
    """The logs a reader of the run may open: training log, the engines' logs, metrics, reports."""
    from eagleflow.data.regenerate import SKIPPED_FILE, SUMMARY_FILE

    return [
        layout.regenerated / SUMMARY_FILE, layout.regenerated / SKIPPED_FILE, layout.train.log, *layout.engine_logs,
        layout.train.metrics, *layout.capture_check_reports, layout.evaluation / EVAL_REPORT,
    ]


def _json_or_empty(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# The shapes of the reports the page reads (written by evaluate and verify-capture). Every field is
# optional and a nested object defaults to an empty one, so a report of another shape (valid JSON,
# wrong types) is named on the page instead of failing it; keys the page does not read pass through.
Number = Annotated[float, Field(allow_inf_nan=False)]


def _empty_if_none(value: Any) -> Any:
    return {} if value is None else value


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _Speeds(_Shape):
    drafter: Number | None = None
    baseline: Number | None = None
    speedup: Number | None = None


class _TokensPerS(_Shape):
    single_stream: Annotated[_Speeds, BeforeValidator(_empty_if_none)] = _Speeds()
    concurrent: Annotated[_Speeds, BeforeValidator(_empty_if_none)] = _Speeds()


class _AcceptLength(_Shape):
    mean: Number | None = None
    p50: Number | None = None
    p90: Number | None = None
    per_prompt: list[Number] = []


class _OfflineEstimate(_Shape):
    accept_length: Number | None = None
    source: str | None = Field(None, alias="from")
    full_acc: list[Number] = []


class EvaluationShape(_Shape):
    """What the run page reads from ``eval/report.json``."""

    engine: str | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    concurrency: int | None = None
    num_steps: int | None = None
    accept_length: Annotated[_AcceptLength, BeforeValidator(_empty_if_none)] = _AcceptLength()
    accept_rate: Number | None = None
    tokens_per_s: Annotated[_TokensPerS, BeforeValidator(_empty_if_none)] = _TokensPerS()
    same_tokens_as_baseline: Number | None = None
    offline_estimate: _OfflineEstimate | None = None
    versions: dict[str, str | None] = {}


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


def _shaped(model: type[BaseModel], data: dict[str, Any], path: Path, root: Path) -> dict[str, Any]:
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


def evaluation_summary(layout: RunLayout) -> dict[str, Any] | None:
    """The drafter's evaluation (accept length, speedup, estimate) and its chart, or None before one ran."""
    path = layout.evaluation / EVAL_REPORT
    report = _json_or_empty(path)
    if not report:
        return None
    report = _shaped(EvaluationShape, report, path, layout.root)
    if "error" in report:
        return {"error": report["error"]}
    png, svg = layout.evaluation / f"{EVAL_CHART}.png", layout.evaluation / f"{EVAL_CHART}.svg"
    keys = ("engine", "prompts", "max_new_tokens", "concurrency", "num_steps", "accept_length", "accept_rate",
            "tokens_per_s", "same_tokens_as_baseline", "offline_estimate", "versions")
    summary = {key: report.get(key) for key in keys}
    summary["chart"] = {
        "png": str(png.relative_to(layout.root)) if png.is_file() else None,
        "svg": str(svg.relative_to(layout.root)) if svg.is_file() else None,
        "mtime": int(png.stat().st_mtime) if png.is_file() else 0,
    }
    return summary


def regeneration_summary(layout: RunLayout) -> dict[str, Any] | None:
    """What regeneration did (``regenerated/regenerate.json``): rows, rows left out, conversations shortened to
    fit the context and the turns they lost; None when the run did not regenerate (or has not finished it)."""
    from eagleflow.data.regenerate import SUMMARY_FILE

    summary = _json_or_empty(layout.regenerated / SUMMARY_FILE)
    if not summary:
        return None
    keys = ("rows", "skipped_rows", "shortened_conversations", "dropped_turns", "capped_answers", "context_length",
            "max_new_tokens", "temperature", "seconds")
    return {key: summary.get(key) for key in keys}


def capture_check_summaries(layout: RunLayout) -> list[dict[str, Any]]:
    """Each engine's capture-check verdict and figures (``verify/<engine>/report.json``), in engine order."""
    summaries = []
    for path in layout.capture_check_reports:
        report = _json_or_empty(path)
        if report:
            report = _shaped(CaptureCheckShape, report, path, layout.root)
        summary = {"error": report["error"]} if "error" in report else capture_check_summary(report)
        if summary:
            summaries.append({"name": path.parent.name, **summary})
    return summaries


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


def online_summary(layout: RunLayout, result: dict[str, Any]) -> dict[str, Any] | None:
    """Online training's figures (samples fetched, peak bytes on disk, the trainer's data wait): from the
    finished step's result, else the feed's live status; None for a run trained from disk."""
    from eagleflow.layout import FeedLayout
    from eagleflow.train.online.settings import read_status

    figures = result.get("online")
    if not isinstance(figures, dict):
        figures = read_status(FeedLayout(layout.train.online)) or None
    if not figures:
        return None
    keys = ("fetched", "fetched_bytes", "cached", "peak_bytes", "window_bytes", "cache_bytes", "data_wait_s", "seconds")
    return {key: figures.get(key) for key in keys}


def run_summary(layout: RunLayout, metrics: MetricsCache | None = None) -> dict[str, Any]:
    """Everything a page or a summary shows about a run, as plain JSON (paths relative to the run)."""
    shards = read_shards(layout)
    charts = {}
    for name, _ in CHARTS:
        png, svg = layout.charts / f"{name}.png", layout.charts / f"{name}.svg"
        if png.is_file():
            charts[name] = {
                "png": str(png.relative_to(layout.root)),
                "svg": str(svg.relative_to(layout.root)) if svg.is_file() else None,
                "mtime": int(png.stat().st_mtime),
            }
    totals = {
        "shards": len(shards),
        "shards_done": sum(1 for s in shards if s.state == "success"),
        "rows": sum(s.rows for s in shards),
        "rows_complete": sum(s.total_rows for s in shards),
        "rows_failed": sum(len(s.failed) for s in shards),
        "tokens": sum(s.total_tokens for s in shards),
        "gb": sum(s.total_bytes for s in shards) / 1e9,
    }
    result = _json_or_empty(layout.train.result)
    checkpoint = result.get("best_checkpoint") or result.get("checkpoint_dir")
    return {
        "run": layout.root.name,
        "shards": [s.as_json() for s in shards],
        "totals": totals,
        "metrics": (metrics or MetricsCache()).latest(layout.train.metrics),
        "charts": charts,
        "checkpoint": checkpoint if isinstance(checkpoint, str) else None,
        "online": online_summary(layout, result),
        "regeneration": regeneration_summary(layout),
        "capture_checks": capture_check_summaries(layout),
        "evaluation": evaluation_summary(layout),
        "files": [str(p.relative_to(layout.root)) for p in readable_files(layout) if p.is_file()],
    }


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Folders under the output root that look like runs (they have shards/ or train/)."""
    runs = []
    if not root.is_dir():
        return runs
    for child in root.iterdir():
        try:
            layout = RunLayout.of(root, child.name)
        except UserError:
            continue
        if child.is_dir() and (layout.shards.is_dir() or layout.train.root.is_dir()):
            runs.append({"name": child.name, "modified": child.stat().st_mtime})
    return sorted(runs, key=lambda r: -r["modified"])
