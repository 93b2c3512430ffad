"""Run folders and task logs for the UI plugin's tests, importable by name from any of them (``from ui_run_folders
import …``; ``conftest`` is a name every test folder has): a run of two drafters compared, a failed task's log line."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def write_dflash_metrics(metrics: Path) -> list[dict[str, Any]]:
    """The real DFlash training's metric dicts (``fixtures/metrics/dflash``) through the training step's recorder into
    ``metrics``, as speculators logs them; returns the records written."""
    import io
    import logging

    from eagleflow.metrics import read_records
    from eagleflow.train.recorder import MetricsRecorder

    metrics.unlink(missing_ok=True)
    recorder = MetricsRecorder(metrics, stream=io.StringIO(), clock=time.time)
    logger = logging.getLogger("eagleflow.test.plugins.dflash")
    logger.handlers, logger.propagate, logger.level = [recorder], False, logging.INFO
    try:
        for line in (FIXTURES / "dflash" / "metric_dicts.jsonl").read_text().splitlines():
            entry = json.loads(line)
            logger.info(entry["msg"], extra={"step": entry["step"]})
    finally:
        logger.handlers = []
        recorder.close()
    return read_records(metrics)


def write_compared_run(run: Path, chart_png: Path) -> dict[str, Any]:
    """``run``: drafters ``eagle3`` (EAGLE-3 metrics of the fixture run, trained 3725 s) and ``dflash`` (the real DFlash
    training's metrics), each evaluated, with its training and evaluation charts (``chart_png``'s bytes, each tagged
    as its own file); then compared (``eval/compare.json``, eagle3 the winner). Returns ``{run, layouts, dflash_records}``."""
    import argparse

    from drafter_runs import write_two_drafters
    from eagleflow.report.compare import main as compare

    layouts = write_two_drafters(run)
    shutil.copyfile(FIXTURES / "metrics.jsonl", layouts["eagle3"].train.metrics)
    dflash_records = write_dflash_metrics(layouts["dflash"].train.metrics)
    charts = {"eagle3": ("loss", "acc"), "dflash": ("loss", "eal", "acc")}
    for name, layout in layouts.items():
        layout.train.log.write_text(f"{name}: step 0 loss 9.1\n")
        layout.charts.mkdir()
        for chart in charts[name]:
            (layout.charts / f"{chart}.png").write_bytes(chart_png.read_bytes() + f"{name}/{chart}".encode())
        for chart in ("accept", "sweep"):
            (layout.evaluation / f"{chart}.png").write_bytes(chart_png.read_bytes() + f"{name}/{chart}".encode())
    assert compare(argparse.Namespace(run=run, drafters=["eagle3", "dflash"])) == 0
    return {"run": run, "layouts": layouts, "dflash_records": dflash_records}


# A task's exception as Airflow 3.3's task runner logs it (``log.exception("Task failed with exception")``, one JSON
# line of the task's log; read from a real failed task by ``test_ui_in_airflow.py``).
def failed_task_line(exc_type: str, message: str) -> dict[str, Any]:
    return {"timestamp": "2026-12-07T03:21:49.397993Z", "event": "Task failed with exception", "level": "error", "logger": "task",
            "filename": "task_runner.py", "lineno": 1639,
            "error_detail": [{"exc_type": exc_type, "exc_value": message, "exc_notes": [], "syntax_error": None, "is_cause": False,
                              "frames": [{"filename": "step.py", "lineno": 54, "name": "pipeline_config"}], "is_group": False,
                              "exceptions": []}]}
