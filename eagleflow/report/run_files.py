"""The files of a run folder, read for people: the one reader, and the sections every part of a page shares.

Every file of a run folder is read through :class:`RunFiles`: only regular files under the output root,
each up to the bound of its kind. The run page (:mod:`eagleflow.report.run_page`) and each drafter's
sections (:mod:`eagleflow.report.drafters`) are built from these. Light on purpose: no torch, so the
Airflow API server can import it (pandas is imported only when a metrics file is read).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from eagleflow.errors import UserError
from eagleflow.extract import ShardManifest
from eagleflow.files import RefusedFile, open_under, read_under, resolve_under, size_text, stat_under
from eagleflow.layout import RunLayout
from eagleflow.report.shapes import ComparisonShape, EvaluationShape, shaped

if TYPE_CHECKING:
    from pydantic import BaseModel

# The charts the plot step draws (its file stem, and a title for people): an EAGLE-3 drafter's, a block drafter's.
CHARTS = (("loss", "Loss per TTT step"), ("acc", "Accuracy per TTT step"))
BLOCK_CHARTS = (("loss", "Loss"), ("eal", "Expected accept length"), ("acc", "Accuracy per block slot"))
EVAL_REPORT, EVAL_CHART, SWEEP_CHART = "report.json", "accept", "sweep"  # written by eagleflow.evaluate.step / .charts
# What a page reads of a file, by kind: a JSON report or shard manifest is read whole up to a bound far above
# any real one (KBs; a sweep's per-prompt lists a few MB) and refused beyond it; of a longer metrics.jsonl
# only its end is read (where the latest records are), so a page costs the same at any length of training.
JSON_MAX_BYTES = 8 * 10**6
METRICS_TAIL_BYTES = 8 * 10**6


class RunFiles:
    """The one way a run's files are opened for people: the run pages, ``make demo``'s summary, the file route.

    Every path is resolved (symlinks followed) and refused when it lands outside the output root (the
    run folder's parent), when it is not a regular file (a device such as ``/dev/zero``, a FIFO or a
    socket: judged on its status, never opened) or when it is over the bound of its kind, so a link or
    a huge file in a run folder can neither show what lies outside nor stall the API server. The checks
    are :func:`eagleflow.files.open_under`'s. A refused file counts as absent and is kept in ``refused``
    (its path in the run: why), for the page to name.
    """

    def __init__(self, layout: RunLayout) -> None:
        self.layout, self.output_root = layout, layout.root.parent.resolve()
        self.refused: dict[str, str] = {}

    def name(self, path: Path) -> str:
        """``path`` as the page names it: relative to the run folder."""
        return str(path.relative_to(self.layout.root)) if path.is_relative_to(self.layout.root) else str(path)

    def refusal(self, path: Path) -> str | None:
        """``<path in the run>: not read: <why>`` when ``path`` was refused, else None."""
        reason = self.refused.get(self.name(path))
        return f"{self.name(path)}: not read: {reason}" if reason else None

    def open(self, path: Path, max_bytes: int | None = None) -> BinaryIO:
        """``path`` opened after the checks (the file route streams it); FileNotFoundError or RefusedFile."""
        try:
            return open_under(path, self.output_root, max_bytes)
        except RefusedFile as exc:
            self.refused[self.name(path)] = exc.reason
            raise

    def stat(self, path: Path) -> os.stat_result | None:
        """The status of a file the page links or checks without reading it now (a chart, a log); None when
        it is absent or refused."""
        try:
            return stat_under(path, self.output_root)
        except RefusedFile as exc:
            self.refused[self.name(path)] = exc.reason
        except OSError:
            pass
        return None

    def folder(self, path: Path) -> bool:
        """Whether ``path`` is a folder under the output root, to be listed (one resolving outside is refused)."""
        try:
            return resolve_under(path, self.output_root).is_dir()
        except RefusedFile as exc:
            self.refused[self.name(path)] = exc.reason
            return False

    def text(self, path: Path, max_bytes: int = JSON_MAX_BYTES, *, tail: bool = False) -> str | None:
        """``path``'s text: the whole file up to ``max_bytes`` (with ``tail``, the whole lines in the last
        ``max_bytes`` of a longer one); None when it is absent, refused or cannot be read (the last two named
        in ``refused``)."""
        try:
            data, size = read_under(path, self.output_root, max_bytes, tail=tail)
        except FileNotFoundError:
            return None
        except RefusedFile as exc:
            self.refused[self.name(path)] = exc.reason
            return None
        except OSError as exc:
            self.refused[self.name(path)] = f"cannot be read ({exc.strerror or exc})"
            return None
        if size > max_bytes:  # read from the middle of a line: that part is no line
            data = data.partition(b"\n")[2]
        return data.decode("utf-8", errors="replace")

    def json(self, path: Path) -> dict[str, Any]:
        """The JSON object in ``path``; {} when it is missing, torn, not an object, or refused (:meth:`refusal`)."""
        text = self.text(path)
        try:
            data = json.loads(text) if text is not None else None
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


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


def read_shards(layout: RunLayout, files: RunFiles | None = None) -> list[ShardSummary]:
    """Every ``shards/*.json`` manifest, ordered by first row; an unreadable or refused one is shown as such."""
    files = files or RunFiles(layout)
    shards: list[ShardSummary] = []
    if not files.folder(layout.shards):
        return shards
    for path in layout.shards.glob("*.json"):
        text = files.text(path)
        refusal = files.refusal(path)
        if text is None:  # refused, or gone since the glob
            if refusal:
                shards.append(ShardSummary(name=path.stem, state="unreadable", error=refusal))
            continue
        try:
            shards.append(ShardSummary.from_text(text))
        except (ValueError, TypeError) as exc:
            shards.append(ShardSummary(name=path.stem, state="unreadable", error=f"{path.name}: {exc}"))
    return sorted(shards, key=lambda s: (s.start, s.name))


class MetricsCache:
    """``latest_metrics`` of a metrics file, re-read only when the file changes (it can be MBs); of a file
    over :data:`METRICS_TAIL_BYTES` only the end is read, and ``note`` says so."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[int, int, int, int], dict[str, Any]]] = {}

    def latest(self, path: Path, files: RunFiles) -> dict[str, Any] | None:
        from eagleflow.metrics import latest_metrics, parse_metrics

        stat = files.stat(path)
        if stat is None:
            refusal = files.refusal(path)
            return self._failed(refusal) if refusal else None
        key = (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        cached = self._entries.get(path)
        if cached and cached[0] == key:
            return cached[1]
        text = files.text(path, METRICS_TAIL_BYTES, tail=True)
        if text is None:
            return self._failed(files.refusal(path) or f"{files.name(path)}: gone while it was read")
        tail, name = stat.st_size > METRICS_TAIL_BYTES, files.name(path)
        source = f"{name} (its last {size_text(METRICS_TAIL_BYTES)})" if tail else name
        try:
            latest = latest_metrics(parse_metrics(text, "auto", source))
        except UserError as exc:
            latest = self._failed(str(exc))
        if tail:
            latest["note"] = (f"{name} is {size_text(stat.st_size)}: these figures are from its last "
                              f"{size_text(METRICS_TAIL_BYTES)} ({latest['records']:,} records)")
        self._entries[path] = (key, latest)
        return latest

    @staticmethod
    def _failed(error: str) -> dict[str, Any]:
        return {"error": error, "records": 0, "drafter": None, "train": None, "val": None, "ttt": [], "positions": []}


def _shaped_report(files: RunFiles, path: Path, shape: type[BaseModel]) -> dict[str, Any] | None:
    """The report in ``path`` as ``shape`` reads it; ``{"error": …}`` when it is refused or of another shape, None when absent."""
    report = files.json(path)
    if not report:
        refusal = files.refusal(path)
        return {"error": refusal} if refusal else None
    return shaped(shape, report, path, files.layout.root)


def evaluation_summary(layout: RunLayout, files: RunFiles | None = None) -> dict[str, Any] | None:
    """The drafter's evaluation (accept length, speedup, estimate) and its chart, or None before one ran."""
    files = files or RunFiles(layout)
    report = _shaped_report(files, layout.evaluation / EVAL_REPORT, EvaluationShape)
    if report is None or "error" in report:
        return report
    keys = ("engine", "algorithm", "block_size", "prompts", "max_new_tokens", "concurrency", "num_steps", "accept_length", "accept_rate",
            "tokens_per_s", "same_tokens_as_baseline", "offline_estimate", "versions", "prompt_sets", "rounds", "fastest")
    summary = {key: report.get(key) for key in keys}
    summary["sweep"] = [{"config": row["config"], "set": name, **figures}
                        for row in report["sweep"] for name, figures in row["sets"].items()]
    summary["chart"], summary["sweep_chart"] = (_chart_files(files, layout.evaluation, name) for name in (EVAL_CHART, SWEEP_CHART))
    return summary


def comparison_summary(layout: RunLayout, files: RunFiles | None = None) -> dict[str, Any] | None:
    """Every drafter of the run side by side (``eval/compare.json``, the compare step's) with its chart; None before it ran."""
    files = files or RunFiles(layout)
    comparison = _shaped_report(files, layout.comparison, ComparisonShape)
    if comparison and "error" not in comparison:
        comparison["chart"] = _chart_files(files, layout.comparison.parent, layout.comparison.stem)
    return comparison


def _chart_files(files: RunFiles, folder: Path, name: str) -> dict[str, Any]:
    """A chart's PNG and SVG in ``folder`` (paths in the run; None where there is none or it is refused) and its mtime."""
    png, svg = (files.stat(folder / f"{name}.{suffix}") for suffix in ("png", "svg"))
    return {
        "png": f"{files.name(folder)}/{name}.png" if png else None,
        "svg": f"{files.name(folder)}/{name}.svg" if svg else None,
        "mtime": int(png.st_mtime) if png else 0,
    }


def online_summary(layout: RunLayout, result: dict[str, Any], files: RunFiles | None = None) -> dict[str, Any] | None:
    """Online training's figures (samples fetched, peak bytes on disk, the trainer's data wait): from the
    finished step's result, else the feed's live status; None for a run trained from disk."""
    from eagleflow.layout import FeedLayout

    figures = result.get("online")
    if not isinstance(figures, dict):
        figures = (files or RunFiles(layout)).json(FeedLayout(layout.train.online).status) or None
    if not figures:
        return None
    keys = ("fetched", "fetched_bytes", "cached", "peak_bytes", "window_bytes", "cache_bytes", "data_wait_s", "seconds")
    return {key: figures.get(key) for key in keys}


def training_charts(layout: RunLayout, drafter: str | None, files: RunFiles | None = None) -> dict[str, dict[str, Any]]:
    """The plot step's charts there are, in page order, each ``{png, svg, mtime, title}``: a block
    drafter's (its metrics say so, or an ``eal`` chart is there) or an EAGLE-3 drafter's."""
    files = files or RunFiles(layout)
    block = drafter == "block" or (drafter is None and files.stat(layout.charts / "eal.png") is not None)
    charts = {}
    for name, title in BLOCK_CHARTS if block else CHARTS:
        chart = _chart_files(files, layout.charts, name)
        if chart["png"]:
            charts[name] = {**chart, "title": title}
    return charts
