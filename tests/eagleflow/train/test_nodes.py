"""Training on two nodes, for real: two ``python -m eagleflow train --train-nodes 2`` processes on this machine.

Each node runs its own torchrun (static rendezvous on node-0, gloo on CPU); they meet through
the shared training folder. Checked: the two nodes train exactly what one node with two ranks
trains (same global batch); a SIGKILLed node makes the other fail within a bound, and the
retry of both resumes from the last checkpoint without touching it; a node that never joins is
named by the one that waited.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from eagleflow.layout import TrainLayout
from eagleflow.results import find_result
from eagleflow.train.nodes import read_publication

from training_data import assert_records, cached_dataset, copy_dataset, train_argv

pytestmark = pytest.mark.timeout(900)

EPOCHS = 3
NODE_FLAGS = ["--device", "cpu", "--train-nodes", "2", "--node-address", "127.0.0.1"]
STOP_BOUND_SECONDS = 60.0  # a killed node's peer fails at its next collective (measured: 5-10 s here, mostly torchrun's exit)


@pytest.fixture()
def dataset(random_tiny_model: Path, tmp_path: Path) -> Path:
    return copy_dataset(cached_dataset(random_tiny_model), tmp_path / "dataset")


@pytest.fixture()
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """The nodes a test starts (each in its own session); killed afterwards, and nothing of theirs may be left."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while _processes_mentioning(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)  # the kernel's parent-death signals reach torchrun and its workers
    assert not _processes_mentioning(tmp_path), "processes of the test's nodes left behind"


def _processes_mentioning(folder: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(folder) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
    return pids


def _start_node(procs: list, dataset: Path, verifier: Path, out: Path, rank: int, *extra: str) -> subprocess.Popen[str]:
    argv = train_argv(dataset, verifier, out, "--epochs", str(EPOCHS), *NODE_FLAGS, "--node-rank", str(rank), *extra)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    procs.append(proc)
    return proc


def _finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def _two_nodes(procs: list, dataset: Path, verifier: Path, out: Path, *extra: str) -> list[tuple[int, str]]:
    nodes = [_start_node(procs, dataset, verifier, out, rank, *extra) for rank in (1, 0)]
    return [_finish(node) for node in reversed(nodes)]


@pytest.mark.e2e
def test_two_nodes_train_exactly_what_one_node_with_two_ranks_trains(
    dataset: Path, random_tiny_model: Path, tmp_path: Path, started: list
) -> None:
    out = tmp_path / "two-nodes"
    (code0, log0), (code1, log1) = _two_nodes(started, dataset, random_tiny_model, out)
    assert code0 == 0 and code1 == 0, log0[-3000:] + log1[-3000:]
    paths = TrainLayout(out)
    assert "every node joined (node-1): starting" in log0
    assert "--nnodes=2 --node-rank=0" in log0 and "--nnodes=2 --node-rank=1" in log1
    # Rank 0 alone writes the metrics (one record per step, each once) and the checkpoints.
    train, _val = assert_records(paths.metrics, EPOCHS)
    assert find_result(log1.splitlines())["node"] == "node-1"
    assert paths.node_log("node-1").read_text().count("Started distributed with local_rank=0, dp_size=2") == 1
    # The same global batch on one node: the command node-0 published, under one torchrun with two ranks.
    entry = read_publication(paths).entry
    one = tmp_path / "one-node"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               *[arg.replace(str(out), str(one)) for arg in entry]]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one_train, _ = assert_records(one / "metrics.jsonl", EPOCHS)
    assert len(one_train) == len(train)
    worst = 0.0
    for a, b in zip(train, one_train):
        for key, value in a.items():
            if key not in ("time", "tokens_per_s") and isinstance(value, float):
                worst = max(worst, abs(value - b[key]))
    weights = [
        (load_file(paths.checkpoints / str(e) / "model.safetensors"), load_file(one / "checkpoints" / str(e) / "model.safetensors"))
        for e in range(EPOCHS)
    ]
    weight_diff = max((a[k].float() - b[k].float()).abs().max().item() for a, b in weights for k in a)
    print(f"two nodes vs one node of two ranks: {len(train)} steps, worst metric difference {worst:.3g}, "
          f"worst weight difference {weight_diff:.3g}")
    # Two ranks sum their gradients in the same order either way (gloo, a + b): nothing may differ.
    assert worst == 0.0 and weight_diff == 0.0


@pytest.mark.e2e
def test_a_killed_node_stops_its_peer_and_the_retry_resumes_from_the_last_checkpoint(
    dataset: Path, random_tiny_model: Path, tmp_path: Path, started: list
) -> None:
    out = tmp_path / "train"
    paths = TrainLayout(out)
    node1 = _start_node(started, dataset, random_tiny_model, out, 1)
    node0 = _start_node(started, dataset, random_tiny_model, out, 0)
    deadline = time.monotonic() + 600
    while not (paths.metrics.exists() and '"epoch": 1' in paths.metrics.read_text()):
        assert node0.poll() is None and node1.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    kept = (paths.checkpoints / "0" / "model.safetensors").stat()
    os.kill(node1.pid, signal.SIGKILL)  # the step; its torchrun and worker die with it (parent-death signal)
    killed_at = time.monotonic()
    code0, log0 = _finish(node0, timeout=STOP_BOUND_SECONDS + 30)
    stopped_after = time.monotonic() - killed_at
    _finish(node1)
    assert code0 != 0
    assert "a retry resumes from the last checkpoint" in log0
    assert "Connection reset by peer" in log0 or "Connection closed by peer" in log0, log0[-3000:]
    assert stopped_after < STOP_BOUND_SECONDS
    finished_before = sorted(p.name for p in paths.checkpoints.iterdir() if p.name.isdigit())

    (code0, log0), (code1, log1) = _two_nodes(started, dataset, random_tiny_model, out)
    assert code0 == 0 and code1 == 0, log0[-3000:] + log1[-3000:]
    assert f"resuming from checkpoint {paths.checkpoints / finished_before[-1]}" in log0
    after = (paths.checkpoints / "0" / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns), "a finished epoch was written again"
    assert_records(paths.metrics, EPOCHS)
    print(f"killed node-1 in epoch 2 with {finished_before} saved: node-0 stopped {stopped_after:.1f}s later; "
          "the retry resumed from the last checkpoint")


def test_a_node_that_never_joins_is_named_after_the_rendezvous_timeout(
    dataset: Path, random_tiny_model: Path, tmp_path: Path, started: list
) -> None:
    alone = _start_node(started, dataset, random_tiny_model, tmp_path / "a", 0, "--rendezvous-timeout", "3")
    code, log = _finish(alone)
    assert code != 0
    assert "error: node-1 never joined the rendezvous at 127.0.0.1:" in log and "within 3s (Param rendezvous_timeout" in log
    follower = _start_node(started, dataset, random_tiny_model, tmp_path / "b", 1, "--rendezvous-timeout", "3")
    code, log = _finish(follower)
    assert code != 0
    assert "error: node-1: node-0 published no rendezvous within 3s (Param rendezvous_timeout): node-0 never joined" in log
    assert not (tmp_path / "b" / "checkpoints").exists()  # a node other than node-0 never prepares the folder


def test_every_node_must_be_one_of_the_nodes() -> None:
    from eagleflow.train.config import TrainConfig

    with pytest.raises(ValueError, match="--node-rank 2 is not one of --train-nodes 2"):
        TrainConfig(dataset="d", verifier="v", out="o", aux_layer_ids=[2], hidden_states_dtype="bf16", train_nodes=2, node_rank=2)
    with pytest.raises(ValueError, match="--hidden-states-source disk"):
        TrainConfig(dataset="d", verifier="v", out="o", aux_layer_ids=[2], hidden_states_dtype="bf16", train_nodes=2,
                    hidden_states_source="engine")


def test_node_0_and_a_node_meet_in_the_folder_and_a_stale_go_starts_nobody(tmp_path: Path) -> None:
    import threading

    from eagleflow.train.child import TrainingFailed
    from eagleflow.train.nodes import Publication, gather_nodes, join_node_0, publish

    paths = TrainLayout(tmp_path / "train")
    # A go left by a killed node-0: it names the nonce of an older join, so node-1 joins and waits, then gives up.
    publish(paths, Publication("old", "127.0.0.1", 1, 2, 1, ["-m", "x"], go={"node-1": "an older join"}))
    with pytest.raises(TrainingFailed, match="node-1: node-0 did not start rendezvous old within 1s"):
        join_node_0(paths, 1, timeout=1.0, say=lambda _: None)
    assert json.loads((paths.rendezvous / "node-1.json").read_text())["rdzv_id"] == "old"
    # node-0's new attempt: node-1 (still waiting) joins it anew, and starts on the go that names its join.
    fresh = Publication("new", "127.0.0.1", 2, 2, 1, ["-m", "x"])
    publish(paths, fresh)
    joined: list[Publication] = []
    follower = threading.Thread(target=lambda: joined.append(join_node_0(paths, 1, timeout=30, say=lambda _: None)))
    follower.start()
    gather_nodes(paths, fresh, timeout=30, say=lambda _: None)
    follower.join(timeout=30)
    nonce = json.loads((paths.rendezvous / "node-1.json").read_text())["nonce"]
    assert joined and joined[0].rdzv_id == "new" and joined[0].go == {"node-1": nonce}
