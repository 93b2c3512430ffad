"""Shared test set-up: caches inside the repo, and the tiny verifier built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"

# Nothing leaks into the home folder, and nothing reaches for a model hub.
for _name, _value in {
    "HF_HOME": CACHE / "hf",
    "HF_DATASETS_CACHE": CACHE / "hf" / "datasets",
    "MPLCONFIGDIR": CACHE / "matplotlib",
    "PIP_CACHE_DIR": CACHE / "pip",
}.items():
    os.environ.setdefault(_name, str(_value))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
