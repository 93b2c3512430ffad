"""Session fixtures of the core tests: the tiny verifier's hidden-state dataset and one trained drafter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import numpy as np
import torch

from eagleflow.export.step import ExportConfig, export
from training_data import AUX, DRAFT_VOCAB, TrainedRun, cached_dataset, random_speculators_checkpoint, train_once_per_run


@pytest.fixture(scope="session")
def trained_data(tiny_model: Path) -> Path:
    """120 rows of the trained tiny verifier's hidden states (cached under .cache/test-data)."""
    return cached_dataset(tiny_model)


@pytest.fixture(scope="session")
def trained_run(trained_data: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """Two epochs of ``python -m eagleflow train`` with the defaults (served with SGLang), run once per test run."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by its workers (each has its own basetemp below it)
    return train_once_per_run(trained_data, tiny_model, root / "trained-run")


@pytest.fixture(scope="session")
def exported_drafters(trained_run: TrainedRun, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The trained drafter and speculators' untrained one of the same shape and vocabulary, exported."""
    assert trained_run.returncode == 0, trained_run.stderr[-3000:]
    folder = tmp_path_factory.mktemp("drafters")
    mapping = tuple(torch.from_numpy(np.load(trained_run.dataset / f"{name}-{DRAFT_VOCAB}.npy")) for name in ("d2t", "t2d"))
    untrained = random_speculators_checkpoint(
        tiny_model, folder / "untrained-checkpoint", False, AUX, DRAFT_VOCAB, num_layers=1, randomize=False, vocab_mapping=mapping
    )
    for name, checkpoint in (("trained", trained_run.best_checkpoint), ("untrained", untrained)):
        export(ExportConfig(checkpoint=checkpoint, verifier=tiny_model, out=folder / name))
    return {name: folder / name for name in ("trained", "untrained")}
