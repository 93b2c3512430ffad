"""The README's Params table is generated from the Params themselves and must not drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_params_table_is_current() -> None:
    done = subprocess.run([sys.executable, "scripts/params_table.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_readme_names_the_commands_and_the_layout() -> None:
    text = (REPO / "README.md").read_text()
    for needle in ("make test", "make demo", "make airflow", "dags/", "operators/", "eagleflow/", "sglang_patch/", "plugins/", "docker/"):
        assert needle in text
