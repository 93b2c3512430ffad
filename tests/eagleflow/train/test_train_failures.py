"""A failed training step's last line (what the task summary shows) names the cause, not only the child's status.

Faults injected for real: a torn ``dataset_info.json`` written into the dataset folder, the only online
engine killed by pid. Each run checks the line, that no traceback reached the step's output, and
that nothing of the step is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import datasets
import pytest
from reference_engines import launch_engine
from training_data import AUX, copy_dataset, train_argv

from eagleflow.errors import UserError
from eagleflow.layout import FeedLayout, TrainLayout
from eagleflow.train.config import TrainConfig
from eagleflow.train.failure import failure_cause, feed_failure, last_error_line
from eagleflow.train.step import check_dataset

ONLINE_ROWS = 40


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny tensors; a shared 2-core machine


def processes_on(folder: Path) -> list[int]:
    """Pids of processes whose command line names ``folder`` (the step, its speculators child)."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmdline:
            found.append(int(pid))
    return found


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ---- the cause, from what the child left --------------------------------------------------------

TRACEBACK = """\
Traceback (most recent call last):
  File "/x/speculators/train/data.py", line 164, in __init__
    self.data = load_from_disk(datapath)
                ^^^^^^^^^^^^^^^^^^^^^^^^
json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)
"""


def test_the_cause_is_the_last_error_line_the_child_printed() -> None:
    assert last_error_line(["step 3 loss 1.2", *TRACEBACK.splitlines()]) == (
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    )
    # A data-loader worker's exception, re-raised in the trainer: the original one is the cause.
    wrapped = TRACEBACK.replace("json.decoder.JSONDecodeError", "RuntimeError: Caught RuntimeError in DataLoader worker process 0.\n"
                                "Original Traceback (most recent call last):\n  File \"w.py\", line 1, in f\nRuntimeError")
    assert last_error_line(wrapped.splitlines()) == "RuntimeError: Expecting value: line 1 column 1 (char 0)"
    # torchrun: each rank's lines carry a prefix, and its ChildFailedError only wraps the rank's failure.
    ranks = [f"[rank0]: {line}" for line in TRACEBACK.splitlines()] + [
        "Traceback (most recent call last):", '  File "run.py", line 9, in main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "====",
    ]
    assert last_error_line(ranks) == "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    # The child's own one-line refusal, after the log lines of a run that went well so far.
    assert last_error_line(["[eagleflow] online feed stopped: x", "error: online feed stopped: x; a retry resumes"]) == (
        "online feed stopped: x; a retry resumes"
    )
    assert last_error_line(["epoch 0 done", "Killed"]) is None


def test_only_this_attempts_lines_and_feed_record_count(tmp_path: Path) -> None:
    paths = TrainLayout(tmp_path / "train")
    paths.root.mkdir(parents=True)
    paths.log.write_text(TRACEBACK)  # an earlier attempt's
    start = paths.log.stat().st_size
    with open(paths.log, "a") as log:
        log.write("[eagleflow] train …\nKilled\n")
    assert failure_cause(paths, start, time.time(), online=False) is None
    assert failure_cause(paths, 0, time.time(), online=False) == "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"

    feed = FeedLayout(paths.online)
    feed.root.mkdir(parents=True)
    feed.failure.write_text(json.dumps({"error": "no engine answered for 3s (engine_wait): engine-0 at http://h:1: gone", "time": 100.0}))
    assert feed_failure(paths.online, since=200.0) is None, "an earlier attempt's record"
    said = failure_cause(paths, start, 50.0, online=True)
    assert said == "online feed stopped: no engine answered for 3s (engine_wait): engine-0 at http://h:1: gone; a retry resumes from the last checkpoint"


# ---- for real, through the CLI ------------------------------------------------------------------


def test_an_empty_dataset_info_is_named_before_the_trainer_reads_it(trained_data: Path, tiny_model: Path, tmp_path: Path) -> None:
    """The issue: speculators' load_from_disk met the empty file, and the step said only "speculators exited
    with status 1" below a traceback. Now the step's checks name it, and the trainer never trains."""
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    (dataset / "dataset_info.json").write_bytes(b"")  # what a write cut short leaves
    out = tmp_path / "train"
    proc = subprocess.run(train_argv(dataset, tiny_model, out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last_line(proc.stderr) == (
        f"error: --dataset {dataset}: dataset_info.json is empty (0 bytes); the prepared dataset is not whole "
        "(a write cut short?); prepare it again (prepare-dataset)"
    )
    assert "Traceback" not in proc.stdout + proc.stderr
    assert processes_on(out) == []
    assert not (out / "checkpoints").exists() and "command:" not in (out / "train.log").read_text()


def test_a_truncated_hidden_state_file_is_named_with_its_bytes(trained_data: Path, tmp_path: Path) -> None:
    """speculators would have met it mid-epoch, in a traceback of its data loader."""
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    torn = dataset / "hidden_states" / "hs_7.safetensors"
    size = torn.stat().st_size
    os.truncate(torn, size - 100)  # a copy or a write cut short
    cfg = TrainConfig(dataset=dataset, verifier=tmp_path, out=tmp_path / "o", aux_layer_ids=AUX)
    with pytest.raises(UserError) as caught:
        check_dataset(cfg, hidden_size=64)
    assert f"unreadable or another dtype: rows 7); {torn}: truncated ({size - 100} bytes, its header promises {size})" in str(caught.value)


def rows_only(dataset: Path, dest: Path, rows: int) -> Path:
    """The prepared dataset's first rows without hidden states (what online training starts from)."""
    datasets.load_from_disk(str(dataset)).select(range(rows)).save_to_disk(str(dest))
    return dest




