"""train: the disk of the training folder fills up while speculators saves a checkpoint.

A real 1 MB tmpfs holds the first epoch's checkpoint but not the second: speculators' save fails
(torch says only "iostream error"), and train.log itself can no longer be written. The step must
say "no space" naming the folder, keep the finished epoch untouched, and resume once the same
filesystem is made bigger (``mount -o remount,size=…``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from eagleflow.train.resume import checkpoint_complete

from training_data import assert_records, copy_dataset, train_argv

pytestmark = pytest.mark.e2e


def identity(folder: Path) -> dict[str, tuple[int, int, str]]:
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_disk_full_while_saving_a_checkpoint_says_no_space_keeps_the_epoch_and_the_retry_resumes(
    trained_data: Path, tiny_model: Path, tmp_path: Path, small_tmpfs
) -> None:
    disk = small_tmpfs("1m")
    out = disk / "train"
    argv = train_argv(copy_dataset(trained_data, tmp_path / "dataset"), tiny_model, out, "--epochs", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failed = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert failed.returncode != 0
    error = failed.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: no space left on the device of {out / 'checkpoints'}: "), failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "checkpoints of finished epochs are kept" in error
    assert checkpoint_complete(out / "checkpoints" / "0") and not checkpoint_complete(out / "checkpoints" / "1")
    kept = identity(out / "checkpoints" / "0")

    grown = subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], capture_output=True, text=True)
    if grown.returncode != 0:
        pytest.skip(f"cannot grow the tmpfs: {grown.stderr.strip()}")
    retry = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert "resuming from checkpoint" in retry.stdout
    assert identity(out / "checkpoints" / "0") == kept  # the finished epoch was never rewritten
    assert checkpoint_complete(out / "checkpoints" / "1")
    assert_records(out / "metrics.jsonl", 2)  # every step recorded once across both runs
