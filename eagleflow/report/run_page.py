"""What a run folder holds, read for people: shards, totals, charts, latest metrics, files, and the list of runs.

A whole run folder (docs/design.md §3.6) for the UI plugin's pages and ``make demo``'s summary, built from
:mod:`eagleflow.report.run_files` (the one reader of its files) and :mod:`eagleflow.report.drafters` (a
run's several drafters). Light on purpose: no torch, so the Airflow API server can import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError
from eagleflow.layout import DRAFTERS_DIR, RunLayout
from eagleflow.report.drafters import drafter_files, drafter_summaries, winner_headline
from eagleflow.report.run_files import (
    EVAL_REPORT, MetricsCache, RunFiles, ShardSummary, comparison_summary, evaluation_summary, online_summary, read_shards,
    training_charts,
)
from eagleflow.report.shapes import CaptureCheckShape, capture_check_summary, shaped


def readable_files(layout: RunLayout, files: RunFiles | None = None) -> list[Path]:
    """The logs a reader of the run may open: training log, the engines' logs, metrics, reports (only those
    in folders under the output root are listed)."""
    from eagleflow.data import SKIPPED_FILE, SUMMARY_FILE

    files = files or RunFiles(layout)
    engine_logs = layout.engine_logs if files.folder(layout.server) else []
    checks = layout.capture_check_reports if files.folder(layout.capture_checks) else []
    return [
        layout.regenerated / SUMMARY_FILE, layout.regenerated / SKIPPED_FILE, layout.train.log, *engine_logs,
        layout.train.metrics, *checks, layout.evaluation / EVAL_REPORT, layout.comparison, *drafter_files(layout, files),
    ]


def regeneration_summary(layout: RunLayout, files: RunFiles | None = None) -> dict[str, Any] | None:
    """What regeneration did (``regenerated/regenerate.json``): rows, rows left out, conversations shortened to
    fit the context and the turns they lost; None when the run did not regenerate (or has not finished it)."""
    from eagleflow.data import SUMMARY_FILE

    summary = (files or RunFiles(layout)).json(layout.regenerated / SUMMARY_FILE)
    if not summary:
        return None
    keys = ("rows", "skipped_rows", "shortened_conversations", "dropped_turns", "capped_answers", "context_length",
            "max_new_tokens", "temperature", "seconds")
    return {key: summary.get(key) for key in keys}


def capture_check_summaries(layout: RunLayout, files: RunFiles | None = None) -> list[dict[str, Any]]:
    """Each engine's capture-check verdict and figures (``verify/<engine>/report.json``), in engine order."""
    files = files or RunFiles(layout)
    summaries = []
    for path in layout.capture_check_reports if files.folder(layout.capture_checks) else []:
        report = files.json(path)
        if report:
            report = shaped(CaptureCheckShape, report, path, layout.root)
        elif files.refusal(path):
            report = {"error": files.refusal(path)}
        summary = {"error": report["error"]} if "error" in report else capture_check_summary(report)
        if summary:
            summaries.append({"name": path.parent.name, **summary})
    return summaries


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


def run_headline(layout: RunLayout, metrics: MetricsCache | None = None, planned: Sequence[str] | None = None) -> dict[str, Any]:
    """A run's figures at a glance, for the list of runs: extraction totals, the latest training and
    validation loss, the drafter's accept length and single-stream speedup (None where a stage has not run); for
    a run of several drafters (``planned``: its drafter plan's folders, when known), how many and compare.json's
    winner's (:func:`eagleflow.report.drafters.winner_headline`)."""
    files = RunFiles(layout)
    latest = (metrics or MetricsCache()).latest(layout.train.metrics, files) or {}
    evaluation = evaluation_summary(layout, files) or {}
    single = ((evaluation.get("tokens_per_s") or {}).get("single_stream")) or {}
    return {
        **shard_totals(read_shards(layout, files)),
        "train_loss": (latest.get("train") or {}).get("loss"),
        "val_loss": (latest.get("val") or {}).get("loss"),
        "accept_length": (evaluation.get("accept_length") or {}).get("mean"),
        "speedup": None if single.get("disturbed") else single.get("speedup"),
        **winner_headline(layout, files, metrics, planned),
    }


def run_summary(layout: RunLayout, metrics: MetricsCache | None = None, planned: Sequence[str] | None = None) -> dict[str, Any]:
    """Everything a page or a summary shows about a run, as plain JSON (paths relative to the run); ``refused``
    names each file left unread and why (:class:`RunFiles`); ``drafters`` each drafter of a run of several, those
    ``planned`` (its drafter plan's folders, when known) included before they write their folders."""
    files, metrics = RunFiles(layout), metrics or MetricsCache()
    shards = read_shards(layout, files)
    latest = metrics.latest(layout.train.metrics, files)
    result = files.json(layout.train.result)
    checkpoint = result.get("best_checkpoint") or result.get("checkpoint_dir")
    return {
        "run": layout.root.name,
        "shards": [s.as_json() for s in shards],
        "totals": shard_totals(shards),
        "metrics": latest,
        "charts": training_charts(layout, (latest or {}).get("drafter"), files),
        "checkpoint": checkpoint if isinstance(checkpoint, str) else None,
        "online": online_summary(layout, result, files),
        "regeneration": regeneration_summary(layout, files),
        "capture_checks": capture_check_summaries(layout, files),
        "evaluation": evaluation_summary(layout, files),
        "comparison": comparison_summary(layout, files),
        "drafters": drafter_summaries(layout, files, metrics, planned),
        "files": [files.name(p) for p in readable_files(layout, files) if files.stat(p)],
        "refused": [f"{name}: {why}" for name, why in sorted(files.refused.items())],
    }


def list_runs(root: Path, metrics: MetricsCache | None = None, planned: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """Folders under the output root that look like runs (they have shards/, train/ or drafters/), newest first,
    each with its :func:`run_headline` figures (``planned``: each run's drafter plan's folders, by run name, when known)."""
    runs = []
    if not root.is_dir():
        return runs
    for child in root.iterdir():
        try:
            layout = RunLayout.of(root, child.name)
        except UserError:
            continue
        files = RunFiles(layout)  # a run folder that is a link out of the output root is not listed
        parts = (layout.shards, layout.train.root, layout.root / DRAFTERS_DIR)
        if files.folder(layout.root) and any(files.folder(part) for part in parts):
            headline = run_headline(layout, metrics, (planned or {}).get(child.name))
            runs.append({"name": child.name, "modified": child.stat().st_mtime, "headline": headline})
    return sorted(runs, key=lambda r: -r["modified"])
