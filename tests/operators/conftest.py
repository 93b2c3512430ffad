"""Fixtures for the operator tests (a run's Params, the settable health endpoint and the
process-group cleanup are shared, in tests/conftest.py)."""

from __future__ import annotations

import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


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
