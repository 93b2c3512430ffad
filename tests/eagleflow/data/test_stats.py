"""dataset-stats: the bytes it estimates are the bytes the sample files take, in either storage dtype."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagleflow.data.prepare import write_training_dataset
from eagleflow.data.stats import dataset_stats
from eagleflow.extract.sample_store import write_sample
from eagleflow.results import find_result

SLOTS, HIDDEN = 4, 64
LENGTHS = [17, 40, 5, 123]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_estimate_is_the_files_bytes_without_their_headers(tmp_path: Path, dtype: str) -> None:
    rows = [list(range(3, 3 + n)) for n in LENGTHS]
    write_training_dataset(rows, [[1] * n for n in LENGTHS], tmp_path / "dataset")
    stats = dataset_stats(tmp_path / "dataset", SLOTS, HIDDEN, dtype)
    hidden_states = tmp_path / "dataset" / "hidden_states"
    for row, ids in enumerate(rows):
        write_sample(hidden_states, row, torch.randn(len(ids), SLOTS, HIDDEN), torch.tensor(ids), dtype)
    written = sum(p.stat().st_size for p in hidden_states.glob("hs_*.safetensors"))
    assert stats["tokens"] == sum(LENGTHS) and stats["hidden_states_dtype"] == dtype
    assert stats["bytes_per_token"] == (SLOTS * HIDDEN * 2 + 8 if dtype == "bf16" else SLOTS * HIDDEN + 4 + 8)
    headers = written - stats["estimated_bytes"]
    assert 0 <= headers < 400 * len(rows), headers  # a few hundred header bytes per file on top


def test_cli_prints_the_storage_dtype_and_reports_the_estimate(tmp_path: Path, random_tiny_model: Path) -> None:
    write_training_dataset([[3, 4, 5, 6]], [[1, 1, 1, 1]], tmp_path / "dataset")
    argv = [sys.executable, "-m", "eagleflow", "dataset-stats", "--dataset", str(tmp_path / "dataset"),
            "--verifier", str(random_tiny_model), "--aux-layer-ids", "2,4,6"]
    results = {}
    for dtype in ("bf16", "fp8"):
        done = subprocess.run([*argv, "--hidden-states-dtype", dtype], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert f"{dtype}, " in done.stdout and "B per token" in done.stdout
        results[dtype] = find_result(done.stdout.splitlines())
    hidden = json.loads((random_tiny_model / "config.json").read_text())["hidden_size"]
    assert results["bf16"]["estimated_bytes"] == 4 * (4 * hidden * 2 + 8)
    assert results["fp8"]["estimated_bytes"] == 4 * (4 * hidden + 4 + 8)
    bad = subprocess.run([*argv, "--hidden-states-dtype", "fp16"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--hidden-states-dtype" in bad.stderr
