"""make demo's terminal: Airflow's output into a file, one line per task (tests/dags/test_dag.py runs it on real DAG runs)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.demo.console import LogsToFile, TaskOutcome, log_tail, task_line

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"


def test_everything_printed_goes_to_the_file_and_the_terminal_gets_only_what_is_said(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Python's prints, a logging handler made on sys.stdout before, and a child process (stdout and stderr) all land in
    the file; ``say`` and everything after the block reach the terminal again."""
    handler = logging.StreamHandler(sys.stdout)
    logger = logging.getLogger("eagleflow.test_console")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with LogsToFile(tmp_path / "run" / "demo.log") as logs:
            print("a print")
            logger.info("a log record")
            subprocess.run([sys.executable, "-c", "import os; os.write(1, b'a child\\n'); os.write(2, b'its stderr\\n')"], check=True)
            start = logs.offset()
            print("the task's own line")
            logs.say("one line per task")
            end = logs.offset()
        print("after")
        logger.info("a record after")
    finally:
        logger.removeHandler(handler)
    assert (tmp_path / "run" / "demo.log").read_text().splitlines() == [
        "a print", "a log record", "a child", "its stderr", "the task's own line",
    ]
    assert log_tail(tmp_path / "run" / "demo.log", start, end) == ["the task's own line"]
    out = capfd.readouterr().out
    assert "one line per task" in out and "after" in out and "a record after" in out and "a print" not in out


def test_a_training_line_gives_its_final_validation_loss_and_accuracy(tmp_path: Path) -> None:
    result = {"metrics_path": str(FIXTURES / "metrics.jsonl"), "train_seconds": 19.0}
    line = task_line(TaskOutcome("train_drafter", "train_drafter[node-0]", "success", 20.4, result, 0))
    assert line == "  success         train_drafter[node-0]                       20s  final val loss 4.274, step-0 accuracy 0.343 (19s of training)"


def test_a_result_of_another_shape_loses_its_figure_never_its_line() -> None:
    """An older run's or a partial result: the line still says the task, its state and duration."""
    for result in ({"bytes": 1}, ["x"], None, {"metrics_path": "/nonexistent/metrics.jsonl", "train_seconds": 1}):
        assert task_line(TaskOutcome("train_drafter", "train_drafter[node-0]", "success", 3.0, result)).endswith("  3s")
    skipped = TaskOutcome("build_vocab", "build_vocab", "success", 0.2, {"skipped": "block drafters read the full vocabulary"})
    assert task_line(skipped).endswith("0s  block drafters read the full vocabulary")
    assert task_line(TaskOutcome("extract_shard", "extract_shard", "upstream_failed", 0.0)) == "  upstream_failed extract_shard"
