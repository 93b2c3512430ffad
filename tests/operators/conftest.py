"""Fixtures for the operator tests: a run's Params, a settable health endpoint, and
cleanup of every process group a test starts (engines outlive their launch by design)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture()
def process_groups() -> Iterator[list[int]]:
    """Process groups (= engine pids, session leaders) a test started; SIGKILLed and reaped afterwards."""
    started: list[int] = []
    yield started
    for pgid in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pgid, 0)


@pytest.fixture()
def params(tmp_path: Path, random_tiny_model: Path) -> dict[str, Any]:
    """A run's Params: the reference engine on the tiny model, any free port, one torch thread."""
    return {
        "engine": "reference",
        "model_path": str(random_tiny_model),
        "dataset_input": str(tmp_path / "unused.jsonl"),
        "output_root": str(tmp_path / "out"),
        "server_port": 0,
        # One thread: the engine shares 2 cores with this test process.
        "server_extra_args": ["--threads", "1"],
    }


