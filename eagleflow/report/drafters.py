"""The drafters of a run that trains several from one capture (``drafters/<name>/``), read for people.

Built from :mod:`eagleflow.report.run_files`'s sections, for the run page (:mod:`eagleflow.report.run_page`,
which calls this module for a run's drafters): each drafter's training state, charts and evaluation for the run page, its files for
the page's file viewer, and the winner of ``eval/compare.json`` for the list of runs. A run without a
``drafters/`` folder has its one drafter in the run folder itself and nothing here applies to it.
Every file is read through :class:`~eagleflow.report.run_files.RunFiles` (only regular files under the
output root, each up to its bound); a drafter folder that is a link out of the root is named, not read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagleflow.layout import DRAFTERS_DIR, RunLayout, check_run_name
from eagleflow.report.shapes import TrainResultShape, shaped
from eagleflow.report.run_files import (
    EVAL_REPORT, MetricsCache, RunFiles, comparison_summary, evaluation_summary, online_summary, training_charts,
)

EXPORT_REPORT = "export.json"  # in a drafter's drafter/ folder, written by the export step


def drafter_names(layout: RunLayout, files: RunFiles) -> list[str]:
    """The drafters of the run, by name: the plain-named sub-folders of ``drafters/`` (sorted); [] for a run
    of one drafter. A sub-folder resolving out of the output root is left out (and named in ``files.refused``)."""
    folder = layout.root / DRAFTERS_DIR
    if not files.folder(folder):
        return []
    try:
        children = sorted(os.listdir(folder))
    except OSError:
        return []
    names = []
    for name in children:
        try:
            check_run_name(name)
        except ValueError:
            continue
        if files.folder(folder / name):
            names.append(name)
    return names


def train_result(layout: RunLayout, files: RunFiles) -> dict[str, Any]:
    """A drafter's ``train/result.json`` as the page reads it: {} before the training finished, ``{"error": …}``
    when it is refused or of another shape."""
    path = layout.train.result
    result = files.json(path)
    if not result:
        refusal = files.refusal(path)
        return {"error": refusal} if refusal else {}
    return shaped(TrainResultShape, result, path, layout.root)


def drafter_summary(layout: RunLayout, files: RunFiles, metrics: MetricsCache) -> dict[str, Any]:
    """One drafter of the run (``layout`` seen from it): its latest training metrics, its training result
    (time, checkpoint), its charts, its online figures and its evaluation, as :func:`run_summary` gives the run's."""
    latest = metrics.latest(layout.train.metrics, files)
    result = train_result(layout, files)
    evaluation = evaluation_summary(layout, files)
    algorithm = files.json(layout.train.config).get("draft_algorithm") or (evaluation or {}).get("algorithm")
    checkpoint = result.get("best_checkpoint") or result.get("checkpoint_dir")
    return {
        "name": layout.drafter_name,
        "folder": files.name(layout.drafter_root),
        "algorithm": algorithm if isinstance(algorithm, str) else None,
        "metrics": latest,
        "result": result,
        "trained": bool(result) and "error" not in result,
        "train_seconds": result.get("train_seconds"),
        "checkpoint": checkpoint if isinstance(checkpoint, str) else None,
        "charts": training_charts(layout, (latest or {}).get("drafter"), files),
        "online": online_summary(layout, result, files) if "error" not in result else None,
        "evaluation": evaluation,
    }


def shown_drafters(layout: RunLayout, files: RunFiles, planned: Sequence[str] | None = None) -> list[str]:
    """The drafters a page shows, sorted: those the run's plan lists (``planned``: the folders of the drafter plan
    of its newest DAG run, known before any drafter writes its folder) and those with a folder."""
    names = set(drafter_names(layout, files))
    for name in planned or ():
        try:
            check_run_name(name)
        except ValueError:  # not a folder name (the plan checks it): nothing of it can be shown
            continue
        names.add(name)
    return sorted(names)


def drafter_summaries(layout: RunLayout, files: RunFiles, metrics: MetricsCache,
                      planned: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every drafter of the run (:func:`shown_drafters`), each as :func:`drafter_summary` reads it: one planned
    whose folder is not written yet reads as not started."""
    return [drafter_summary(layout.for_drafter(name), files, metrics) for name in shown_drafters(layout, files, planned)]


def drafter_files(layout: RunLayout, files: RunFiles) -> list[Path]:
    """The files of each drafter a reader may open: its training log, metrics and result, its evaluation
    report, its export's report (listed when they are there; every one under the run folder)."""
    paths = []
    for name in drafter_names(layout, files):
        drafter = layout.for_drafter(name)
        paths += [drafter.train.log, drafter.train.metrics, drafter.train.result, drafter.evaluation / EVAL_REPORT,
                  drafter.drafter / EXPORT_REPORT]
    return paths


def winner_headline(layout: RunLayout, files: RunFiles, metrics: MetricsCache | None,
                    planned: Sequence[str] | None = None) -> dict[str, Any]:
    """For a run of several drafters, the figures of the list of runs taken from the winner of ``eval/compare.json``:
    how many drafters it trains (the plan's, ``planned``, while it runs; else the folders), the winner's name, accept
    length (mean over the prompt sets) and speedup (mean of the prompt sets' medians) at the smallest batch size, and
    its latest losses; {} for a run of one drafter (its own figures stand)."""
    names = list(planned) if planned else drafter_names(layout, files)
    if not names:
        return {}
    comparison = comparison_summary(layout, files) or {}
    winner = comparison.get("winner") or {}
    name = winner.get("drafter")
    headline = {"drafters": len(names), "winner": name, "winner_algorithm": winner.get("algorithm"),
                "accept_length": winner.get("accept_length"), "speedup": winner.get("mean_speedup")}
    if name in names:
        latest = (metrics or MetricsCache()).latest(layout.for_drafter(name).train.metrics, files) or {}
        headline |= {"train_loss": (latest.get("train") or {}).get("loss"), "val_loss": (latest.get("val") or {}).get("loss")}
    return headline


def has_drafters(layout: RunLayout, files: RunFiles) -> bool:
    """Whether the run folder has a ``drafters/`` folder (a run of several drafters) under the output root."""
    return files.folder(layout.root / DRAFTERS_DIR)


__all__ = [
    "drafter_files", "drafter_names", "drafter_summaries", "drafter_summary", "has_drafters", "shown_drafters", "train_result",
    "winner_headline",
]
