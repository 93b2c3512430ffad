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


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The trained tiny DeepSeek-V3 verifier (built once, cached under .cache/ across runs)."""
    from eagleflow.tiny_model import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(out=CACHE / "test-models" / "tiny-trained"))


@pytest.fixture(scope="session")
def random_tiny_model() -> Path:
    """An untrained tiny verifier with the same tokenizer recipe: fast, for plumbing tests."""
    from eagleflow.tiny_model import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(out=CACHE / "test-models" / "tiny-random", train_steps=0, corpus_rows=400))
