"""What a run folder holds, read for people: shards, totals, charts, latest metrics, files.

The one reader of a whole run folder (DESIGN.md §3.6), used by the UI plugin's pages and by
``make demo``'s summary. Light on purpose: no torch, so the Airflow API server can import it
(pandas is imported only when a metrics file is read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError
from eagleflow.extract.manifest import ShardManifest
from eagleflow.layout import RunLayout
from eagleflow.report_shapes import CaptureCheckShape, EvaluationShape, finite, shaped

# The charts the plot step draws (its file stem, and a title for people): an EAGLE-3 drafter's, a block drafter's.
CHARTS = (("loss", "Loss per TTT step"), ("acc", "Accuracy per TTT step"))
BLOCK_CHARTS = (("loss", "Loss"), ("eal", "Expected accept length"), ("acc", "Accuracy per block slot"))
EVAL_REPORT, EVAL_CHART, SWEEP_CHART = "report.json", "accept", "sweep"  # written by eagleflow.evaluate.step / .charts


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
            latest = {"error": str(exc), "records": 0, "drafter": None, "train": None, "val": None, "ttt": [],
                      "positions": []}
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


def evaluation_summary(layout: RunLayout) -> dict[str, Any] | None:
    """The drafter's evaluation (accept length, speedup, estimate) and its chart, or None before one ran."""
    path = layout.evaluation / EVAL_REPORT
    report = _json_or_empty(path)
    if not report:
        return None
    report = shaped(EvaluationShape, report, path, layout.root)
    if "error" in report:
        return {"error": report["error"]}
    keys = ("engine", "algorithm", "block_size", "prompts", "max_new_tokens", "concurrency", "num_steps", "accept_length", "accept_rate",
            "tokens_per_s", "same_tokens_as_baseline", "offline_estimate", "versions", "prompt_sets", "rounds", "fastest")
    summary = {key: report.get(key) for key in keys}
    summary["sweep"] = [{"config": row["config"], "set": name, **figures}
                        for row in report["sweep"] for name, figures in row["sets"].items()]
    summary["chart"], summary["sweep_chart"] = (_chart_files(layout, name) for name in (EVAL_CHART, SWEEP_CHART))
    return summary


def _chart_files(layout: RunLayout, name: str) -> dict[str, Any]:
    png, svg = layout.evaluation / f"{name}.png", layout.evaluation / f"{name}.svg"
    return {
        "png": str(png.relative_to(layout.root)) if png.is_file() else None,
        "svg": str(svg.relative_to(layout.root)) if svg.is_file() else None,
        "mtime": int(png.stat().st_mtime) if png.is_file() else 0,
    }


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
            report = shaped(CaptureCheckShape, report, path, layout.root)
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


def shard_totals(shards: list[ShardSummary]) -> dict[str, Any]:
    """The run's extraction over its shards: shards done, rows complete and failed, tokens, GB."""
    return {
        "shards": len(shards),
        "shards_done": sum(1 for s in shards if s.state == "success"),
        "rows": sum(s.rows for s in shards),
        "rows_complete": sum(s.total_rows for s in shards),
        "rows_failed": sum(len(s.failed) for s in shards),
        "tokens": sum(s.total_tokens for s in shards),
        "gb": sum(s.total_bytes for s in shards) / 1e9,
    }


def run_headline(layout: RunLayout, metrics: MetricsCache | None = None) -> dict[str, Any]:
    """A run's figures at a glance, for the list of runs: extraction totals, the latest training and
    validation loss, the drafter's accept length and single-stream speedup (None where a stage has not run)."""
    latest = (metrics or MetricsCache()).latest(layout.train.metrics) or {}
    evaluation = evaluation_summary(layout) or {}
    single = ((evaluation.get("tokens_per_s") or {}).get("single_stream")) or {}
    return {
        **shard_totals(read_shards(layout)),
        "train_loss": (latest.get("train") or {}).get("loss"),
        "val_loss": (latest.get("val") or {}).get("loss"),
        "accept_length": (evaluation.get("accept_length") or {}).get("mean"),
        "speedup": None if single.get("disturbed") else single.get("speedup"),
    }


def training_charts(layout: RunLayout, drafter: str | None) -> dict[str, dict[str, Any]]:
    """The plot step's charts there are, in page order, each ``{png, svg, mtime, title}``: a block
    drafter's (its metrics say so, or an ``eal`` chart is there) or an EAGLE-3 drafter's."""
    block = drafter == "block" or (drafter is None and (layout.charts / "eal.png").is_file())
    charts = {}
    for name, title in BLOCK_CHARTS if block else CHARTS:
        png, svg = layout.charts / f"{name}.png", layout.charts / f"{name}.svg"
        if png.is_file():
            charts[name] = {
                "png": str(png.relative_to(layout.root)),
                "svg": str(svg.relative_to(layout.root)) if svg.is_file() else None,
                "mtime": int(png.stat().st_mtime),
                "title": title,
            }
    return charts


def run_summary(layout: RunLayout, metrics: MetricsCache | None = None) -> dict[str, Any]:
    """Everything a page or a summary shows about a run, as plain JSON (paths relative to the run)."""
    shards = read_shards(layout)
    latest = (metrics or MetricsCache()).latest(layout.train.metrics)
    result = _json_or_empty(layout.train.result)
    checkpoint = result.get("best_checkpoint") or result.get("checkpoint_dir")
    return {
        "run": layout.root.name,
        "shards": [s.as_json() for s in shards],
        "totals": shard_totals(shards),
        "metrics": latest,
        "charts": training_charts(layout, (latest or {}).get("drafter")),
        "checkpoint": checkpoint if isinstance(checkpoint, str) else None,
        "online": online_summary(layout, result),
        "regeneration": regeneration_summary(layout),
        "capture_checks": capture_check_summaries(layout),
        "evaluation": evaluation_summary(layout),
        "files": [str(p.relative_to(layout.root)) for p in readable_files(layout) if p.is_file()],
    }


def list_runs(root: Path, metrics: MetricsCache | None = None) -> list[dict[str, Any]]:
    """Folders under the output root that look like runs (they have shards/ or train/), newest first,
    each with its :func:`run_headline` figures."""
    runs = []
    if not root.is_dir():
        return runs
    for child in root.iterdir():
        try:
            layout = RunLayout.of(root, child.name)
        except UserError:
            continue
        if child.is_dir() and (layout.shards.is_dir() or layout.train.root.is_dir()):
            runs.append({"name": child.name, "modified": child.stat().st_mtime, "headline": run_headline(layout, metrics)})
    return sorted(runs, key=lambda r: -r["modified"])
