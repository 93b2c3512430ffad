"""Fixtures for the operator tests: a run's Params (the settable health endpoint and the
process-group cleanup are shared, in tests/conftest.py)."""

from __future__ import annotations

import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


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




@pytest.fixture()
def step_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """``step_interpreter(source)``: ``EAGLEFLOW_PYTHON`` points the steps at an executable running ``source``."""

    def make(source: str) -> Path:
        script = tmp_path / "stand-in-python"
        script.write_text(f"#!{sys.executable}\n{source}")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("EAGLEFLOW_PYTHON", str(script))
        return script

    return make
