"""benchmarks/gpu_check.py on a machine without CUDA: what it says, and the parts that run anyway.

No GPU here, so the GPU figures themselves are not measured; what is checked is everything
around them: the skip and its reason, rows whose inputs or packages are missing, the bundle
``--prepare`` makes on the CPU machine, and the speculative-decoding and fp8 measurements run
with ``device="cpu"`` (the same code the GPU runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check


def test_without_cuda_it_says_why_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_check: skipped: no CUDA device: torch ")
    assert "run `make gpu-check` on one" in done.stdout and "result" not in done.stdout  # no table of nothing


def test_rows_without_their_inputs_or_packages_are_skipped_naming_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (spec,) = gpu_check.speculative_rows(tmp_path / "no-bundle", "cuda")
    assert (spec.value, spec.ok) == ("skipped", None) and "--prepare" in spec.note and "python scripts/demo.py" in spec.note
    monkeypatch.setattr(gpu_check, "TRAINING_NEEDS", ("json", "no_such_module_here"))
    (training,) = gpu_check.training_rows(tmp_path, tmp_path, "cuda")
    assert (training.value, training.ok) == ("skipped", None) and "needs no_such_module_here" in training.note
    assert "json" not in training.note


def test_a_figure_that_breaks_is_one_failed_row_not_the_end_of_the_check() -> None:
    def broken() -> list:
        raise RuntimeError("CUDA error: out of memory")

    (row,) = gpu_check.guarded("capture hook", broken)
    assert row.ok is False and "RuntimeError" in row.value and "out of memory" in row.note


def test_fp8_on_the_device_is_hs_connectors_bytes() -> None:
    rows = gpu_check.quantisation_rows("cpu")
    check = next(r for r in rows if "equals hs-connectors" in r.figure)
    assert (check.value, check.ok) == ("bit for bit", True)


def test_prepare_makes_a_bundle_that_the_speculative_rows_measure(tiny_model: Path, tmp_path: Path) -> None:
    """A run folder shaped like ``make demo``'s (a dataset, an exported drafter: here speculators'
    untrained initialisation, so no training), bundled, then measured on the CPU: speculative
    decoding gives exactly plain greedy decoding's tokens, and the figures come out."""
    import shutil

    import torch
    from training_data import (
        AUX,
        DRAFT_VOCAB,
        cached_dataset,
        random_dflash_checkpoint,
        random_speculators_checkpoint,
    )

    from eagleflow.export.step import ExportConfig, export

    run = tmp_path / "run"
    shutil.copytree(cached_dataset(tiny_model), run / "dataset")
    checkpoint = random_speculators_checkpoint(tiny_model, tmp_path / "checkpoint", False, AUX, DRAFT_VOCAB, num_layers=1, randomize=False)
    export(ExportConfig(checkpoint=checkpoint, verifier=tiny_model, out=run / "drafter"))
    block_run = tmp_path / "block-run"  # the DFlash demo's run: its drafter for the block-decoding row
    block = random_dflash_checkpoint(tiny_model, tmp_path / "dflash-checkpoint", AUX, block_size=4, num_layers=1)
    export(ExportConfig(checkpoint=block, verifier=tiny_model, out=block_run / "drafter"))

    bundle = gpu_check.prepare(run, tiny_model, tmp_path / "gpu-check", block_run)
    manifest = json.loads((bundle / gpu_check.BUNDLE_MANIFEST).read_text())
    assert len(manifest["prompts"]) == gpu_check.PROMPTS and manifest["num_steps"] >= 1
    assert (bundle / "verifier" / "config.json").is_file() and (bundle / "drafter" / "config.json").is_file()
    assert (bundle / "dataset" / "hidden_states").is_dir()
    assert not list(tmp_path.glob(".gpu-check*")), "published by rename, no temp folder left"

    manifest["prompts"] = manifest["prompts"][:3]  # the CPU's time is the suite's: three prompts make the point
    (bundle / gpu_check.BUNDLE_MANIFEST).write_text(json.dumps(manifest))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's many small ops: parallel regions on shared cores cost 10x
    try:
        speed, same = gpu_check.speculative_rows(bundle, "cpu")
        block_speed, block_same = gpu_check.speculative_rows(bundle, "cpu", block=True)
    finally:
        torch.set_num_threads(threads)
    assert (same.value, same.ok) == ("3 of 3 prompts", True)
    assert "tokens/s" in speed.value and speed.ok is None and "accept length" in speed.note
    assert manifest["block_drafter"] == {"path": "dflash-drafter", "block_size": 4}
    assert (block_same.value, block_same.ok) == ("3 of 3 prompts", True) and "block decoding (DFlash)" in block_speed.figure
