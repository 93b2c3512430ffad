"""The Celery deployment, for real: PostgreSQL, Redis and Airflow's CeleryExecutor on this machine.

``celery_stack`` starts what ``docker/docker-compose.yaml`` deploys, with the same Airflow
settings file (``docker/airflow.env``): scheduler, dag-processor, triggerer, api-server, a Celery
worker on the default queue and one on the GPU queue with the GPU pool. The DAG runs twice
through the REST API, each run with faults and each ending in success:

1. two engines serve the shards of one run (the GPU pool given a slot each). The GPU worker is
   SIGKILLed, with everything under it, while the first shards are in flight, then started
   again: the scheduler notices each lost task (no heartbeat), retries it on the restarted
   worker, and no row finished before the kill is written again. Then engine-1 is SIGKILLed
   while it serves a later shard: that try fails, its retry and engine-1's later shards go to
   engine-0, nothing finished is redone, and every row validates;
2. a second GPU-queue worker joins, and training runs on two nodes (two mapped train_drafter
   instances); node-1's task is SIGKILLed mid-epoch: node-0 stops, both retry and resume from the
   last checkpoint, and the result is identical to one node with two ranks.

Each prints how long detection and retry took (README, "Beyond one machine").
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.celery, pytest.mark.timeout(1800)]

DAG_ID = "eagleflow"
ROWS = 24
# The shards of the run with two engines: six of 4 rows (three per engine).
SHARD_OF_4 = [f"rows_{s}-{s + 4}" for s in range(0, ROWS, 4)]
RUN_TIMEOUT = 900.0
GPU_TASKS = {
    "launch_server", "wait_server_ready", "verify_capture", "regenerate_dataset", "extract_shard", "stop_server",
    "train_drafter", "stop_server_after_training", "evaluate_drafter",
}


def _seconds(stamp: str) -> float:
    """Epoch seconds of an Airflow API timestamp."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _files(hidden_states: Path) -> dict[str, tuple[int, int]]:
    """``{file name: (inode, mtime_ns)}``: a rewrite, even by rename, changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(hidden_states.glob("hs_*.safetensors"))}


def _manifests(shards: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in shards.glob("rows_*.json")}


def _pool(slots: int) -> dict[str, Any]:
    """The GPU pool with ``slots`` slots, as the pools API takes it (only ``slots`` is applied)."""
    return {"pool": "gpu", "slots": slots, "include_deferred": False}


def _slow_run(stack: Any, run_inputs: Any, tmp_path: Path, run_id: str, **params: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Inputs, run folder and Params of a ROWS-row run whose engine is slow enough to be caught mid-shard.

    Each request takes at least 1.5 s, two at a time, on one torch thread: a shard runs for
    several seconds, so the test can act while one is in flight.
    """
    from eagleflow.layout import RunLayout

    inputs = run_inputs(ROWS)
    stack.inject_faults(min_request_seconds=1.5)
    conf = inputs.conf(tmp_path / "runs", run_id, concurrency=2, **params)
    return inputs, RunLayout.of(tmp_path / "runs", run_id), conf


# The run's state is asked of the api-server every this many seconds; the files a test waits for are
# looked at every 0.2 s. Asked at every look, the api-server alone spent tens of CPU-seconds per test.
RUN_STATE_EVERY = 2.0
_run_state_asked: dict[str, float] = {}


def _wait_while_running(stack: Any, run_id: str, deadline: float, look_every: float = 0.2) -> None:
    assert time.monotonic() < deadline, stack.describe(run_id)
    if time.monotonic() - _run_state_asked.get(run_id, 0.0) >= RUN_STATE_EVERY:
        _run_state_asked[run_id] = time.monotonic()
        assert stack.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"] in ("queued", "running"), stack.describe(run_id)
    time.sleep(look_every)


def test_two_engines_serve_one_run_on_celery_and_losing_the_gpu_worker_then_an_engine_mid_shard_loses_nothing(
    celery_stack: Any, run_inputs: Any, in_flight: Any, tmp_path: Path
) -> None:
    """Two engines serve one run's shards of 4 rows (the GPU pool given a slot each). Two faults, one after the other:

    1. the GPU worker is SIGKILLed, with everything under it, while its first shards are in flight, then started
       again: the scheduler notices each lost task (no heartbeat), retries it on the restarted worker, and no row
       finished before the kill is written again;
    2. engine-1 is SIGKILLed while it serves a later shard, once it has finished one: that try fails naming it, its
       retry and engine-1's later shards go to engine-0, and nothing finished is redone.
    """
    from eagleflow.engine.process import pid_alive

    started = time.monotonic()
    run_id = "celery-two-engines"
    inputs, layout, conf = _slow_run(celery_stack, run_inputs, tmp_path, run_id, shard_size=4, num_engines=2, stop_after_extraction=True)
    celery_stack.request("PATCH", "/pools/gpu", json=_pool(2), params={"update_mask": ["slots"]})
    try:
        celery_stack.trigger(run_id, conf)
        deadline = time.monotonic() + RUN_TIMEOUT

        # 1. The GPU worker, once a shard has a row written (looked for often: the shard's other rows follow in
        # about a request's time).
        while in_flight(layout.root, min_rows=1) is None:
            _wait_while_running(celery_stack, run_id, deadline, look_every=0.05)
        finished_at_worker_kill: dict[str, tuple[int, int]] = {}
        lost: dict[str, dict[str, Any]] = {}

        def record_what_is_lost() -> None:  # every process under the worker is frozen now
            finished_at_worker_kill.update(_files(layout.hidden_states))
            manifests = _manifests(layout.shards)
            running = [i for (task, i), ti in celery_stack.task_instances(run_id).items() if task == "extract_shard" and ti["state"] == "running"]
            lost.update({SHARD_OF_4[i]: manifests.get(SHARD_OF_4[i], {"start": 4 * i, "end": 4 * i + 4}) for i in running})

        killed = celery_stack.processes.kill("worker-gpu", while_frozen=record_what_is_lost)
        worker_killed_at = time.time()
        celery_stack.processes.start_component("worker-gpu")
        assert len(killed) >= 3 and lost, (killed, lost)  # the worker, its pool process, the task and its extraction step

        # 2. engine-1, while it serves a shard not lost with the worker, once it has finished one.
        while True:
            victim = in_flight(layout.root, min_rows=1, engine="engine-1 ", leaving_out=lost)
            served = [m for m in _manifests(layout.shards).values() if m["engine"].startswith("engine-1 ")]
            if victim and any(m["state"] == "success" for m in served):
                break
            _wait_while_running(celery_stack, run_id, deadline)
        engine_1 = json.loads(layout.engine_state("engine-1").read_text())
        os.killpg(int(engine_1["pid"]), signal.SIGKILL)
        engine_killed_at = time.time()
        finished_at_engine_kill = _files(layout.hidden_states)
        state = celery_stack.wait_for_run(run_id, RUN_TIMEOUT)
    finally:
        celery_stack.request("PATCH", "/pools/gpu", json=_pool(1), params={"update_mask": ["slots"]})
    assert state == "success", celery_stack.describe(run_id)

    tis = celery_stack.task_instances(run_id)
    for (task_id, _), ti in tis.items():  # each task ran where the deployment puts it
        assert ti["queue"] == ("gpu" if task_id in GPU_TASKS else "default"), (task_id, ti["queue"])
    engines = {tis[("launch_server", i)]["rendered_map_index"]: celery_stack.xcom(run_id, "launch_server", i) for i in (0, 1)}
    assert set(engines) == {"engine-0", "engine-1"} and engines["engine-0"]["url"] != engines["engine-1"]["url"]
    manifests = _manifests(layout.shards)
    assert sorted(manifests) == sorted(SHARD_OF_4) and all(m["state"] == "success" for m in manifests.values())
    by_engine = {name: m["engine"].split(" ")[0] for name, m in manifests.items()}
    after = _files(layout.hidden_states)
    assert sorted(after) == sorted(f"hs_{row}.safetensors" for row in range(ROWS))
    inputs.check_every_row(layout.dataset)

    # 1. Each task lost with the worker: found by its missing heartbeat (the scheduler records that in the event log),
    # retried once; no row finished before the kill was written again, the retry did only the rest.
    events = celery_stack.request(
        "GET", "/eventLogs", params={"dag_id": DAG_ID, "run_id": run_id, "event": "heartbeat timeout", "limit": 100}
    )["event_logs"]
    lost_indexes = sorted(SHARD_OF_4.index(name) for name in lost)
    assert sorted((e["task_id"], e["map_index"], e["try_number"]) for e in events) == [
        ("extract_shard", i, 1) for i in lost_indexes], (events, lost)
    assert {name: after[name] for name in finished_at_worker_kill} == finished_at_worker_kill
    for name, shard in lost.items():
        tries = celery_stack.tries(run_id, "extract_shard", SHARD_OF_4.index(name))
        assert [t["try_number"] for t in tries] == [1, 2], tries
        assert tries[0]["state"] in ("failed", "up_for_retry") and tries[1]["state"] == "success", tries
        done = [n for n in finished_at_worker_kill if shard["start"] <= int(n[3:-12]) < shard["end"]]
        assert (manifests[name]["skipped"], manifests[name]["done"]) == (len(done), 4 - len(done)), (name, manifests[name])
    assert any(0 < sum(shard["start"] <= int(n[3:-12]) < shard["end"] for n in finished_at_worker_kill) < 4
               for shard in lost.values()), (lost, sorted(finished_at_worker_kill))  # caught mid-shard
    first_retry = min(_seconds(celery_stack.tries(run_id, "extract_shard", i)[1]["start_date"]) for i in lost_indexes)
    detected = min(_seconds(e["when"]) for e in events) - worker_killed_at

    # 2. Both engines served whole shards; the one killed with engine-1 and engine-1's later shards went to engine-0.
    assert "engine-1" in by_engine.values() and "engine-0" in by_engine.values(), by_engine
    assert by_engine[victim["name"]] == "engine-0", by_engine
    index = SHARD_OF_4.index(victim["name"])
    for later in SHARD_OF_4[index + 1:]:
        assert by_engine[later] == "engine-0", by_engine  # engine-1 was down when they started
    # The killed shard: its first try failed naming engine-1, its retry resumed on engine-0.
    tries = celery_stack.tries(run_id, "extract_shard", index)
    assert [t["try_number"] for t in tries] == [1, 2] and tries[-1]["state"] == "success", tries
    first_log = celery_stack.task_log(run_id, "extract_shard", 1, index)
    assert f"uses engine-1 at {engines['engine-1']['url']}" in first_log, first_log[-3000:]
    second_log = celery_stack.task_log(run_id, "extract_shard", 2, index)
    assert "Passing over engine-1" in second_log and f"uses engine-0 at {engines['engine-0']['url']}" in second_log
    assert manifests[victim["name"]]["skipped"] >= 1
    assert {name: after[name] for name in finished_at_engine_kill} == finished_at_engine_kill  # nothing finished was redone

    # The teardowns: engine-1 was already gone, engine-0 was stopped; no engine is left.
    stops = {tis[("stop_server", i)]["rendered_map_index"]: celery_stack.xcom(run_id, "stop_server", i) for i in (0, 1)}
    assert "had already exited" in stops["engine-1"] and "stopped" in stops["engine-0"], stops
    assert not any(pid_alive(int(e["pid"])) for e in engines.values())
    failed, retried, done = (_seconds(t) - engine_killed_at for t in (tries[0]["end_date"], tries[1]["start_date"], tries[1]["end_date"]))
    print(
        f"lost GPU worker: killed with {len(finished_at_worker_kill)} rows done, {sorted(lost)} in flight: lost tasks "
        f"detected after {detected:.0f}s, first retry started after {first_retry - worker_killed_at:.0f}s; "
        f"two engines: engine-1 killed in {victim['name']} with {manifests[victim['name']]['skipped']} rows done: its try "
        f"failed after {failed:.0f}s, the retry on engine-0 started after {retried:.0f}s, finished after {done:.0f}s; "
        f"run {time.monotonic() - started:.0f}s"
    )


TRAIN_ROWS = 96
TRAIN_EPOCHS = 2


def _node_task(run_folder: Path, rank: int) -> int | None:
    """pid of the Airflow task process running node ``rank``'s training step (the step's parent)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if b"train" in argv and f"--node-rank={rank}".encode() in argv and f"--out={run_folder}/train".encode() in argv:
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return None


def _max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(value - b[key]) for key, value in a.items() if key not in ("time", "tokens_per_s") and isinstance(value, float))


def test_two_gpu_workers_train_as_two_nodes_and_a_killed_node_loses_nothing(
    celery_stack: Any, run_inputs: Any, tmp_path: Path
) -> None:
    """train_drafter runs as two mapped instances (node-0, node-1) on two GPU-queue workers; node-1's task
    is SIGKILLed mid-epoch: node-0's ranks stop at their next collective, both instances retry and resume
    from the last checkpoint. Against one node with two ranks (the same global batch), from the same
    starting points: the first epoch and the resumed one are identical."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file

    from eagleflow.layout import RunLayout
    from eagleflow.metrics.records import read_records
    from eagleflow.train.nodes import read_publication

    celery_stack.inject_faults()  # no slow requests left over from the tests before

    started = time.monotonic()
    run_id = "celery-two-nodes"
    inputs = run_inputs(TRAIN_ROWS)
    layout = RunLayout.of(tmp_path / "runs", run_id)
    conf = inputs.conf(tmp_path / "runs", run_id, epochs=TRAIN_EPOCHS, total_seq_len=256, train_nodes=2, rendezvous_timeout=300)
    # A second worker on the GPU queue: the two workers act as two GPU nodes (every node's instance at once: a pool slot each).
    worker = celery_stack.processes.components["worker-gpu"]
    celery_stack.processes.components["worker-gpu-2"] = [*worker[:-1], "gpu-2@%h"]
    celery_stack.processes.start_component("worker-gpu-2")
    celery_stack.request("PATCH", "/pools/gpu", json=_pool(2), params={"update_mask": ["slots"]})
    try:
        celery_stack.trigger(run_id, conf)
        deadline = time.monotonic() + RUN_TIMEOUT
        # Kill node-1's task once the first epoch is saved and the second is under way.
        while not (layout.train.metrics.exists() and '"epoch": 1' in layout.train.metrics.read_text()):
            _wait_while_running(celery_stack, run_id, deadline)
        victim = _node_task(layout.root, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        saved_at_kill = sorted(p.name for p in layout.train.checkpoints.iterdir() if p.name.isdigit())
        kept = (layout.train.checkpoints / "0" / "model.safetensors").stat()
        state = celery_stack.wait_for_run(run_id, RUN_TIMEOUT)
    finally:
        celery_stack.request("PATCH", "/pools/gpu", json=_pool(1), params={"update_mask": ["slots"]})
    assert state == "success", celery_stack.describe(run_id)
    assert saved_at_kill == ["0"], saved_at_kill

    tis = celery_stack.task_instances(run_id)
    assert {tis[("train_drafter", i)]["rendered_map_index"] for i in (0, 1)} == {"node-0", "node-1"}
    tries = {i: celery_stack.tries(run_id, "train_drafter", i) for i in (0, 1)}
    for i in (0, 1):
        assert [t["try_number"] for t in tries[i]] == [1, 2] and tries[i][-1]["state"] == "success", tries[i]
    # node-0's first try stopped on its own (its peer's connection reset), within seconds of the kill.
    stopped = _seconds(tries[0][0]["end_date"]) - killed_at
    assert stopped < 60, stopped
    first_log = celery_stack.task_log(run_id, "train_drafter", 1, 0)
    assert "a retry resumes from the last checkpoint" in first_log, first_log[-3000:]
    second_log = celery_stack.task_log(run_id, "train_drafter", 2, 0)
    assert f"resuming from checkpoint {layout.train.checkpoints / '0'}" in second_log, second_log[-3000:]
    assert "--nnodes=2 --node-rank=1" in celery_stack.task_log(run_id, "train_drafter", 2, 1)  # each node's log in its own task
    after = (layout.train.checkpoints / "0" / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns), "the finished epoch was written again"
    records = list(read_records(layout.train.metrics))
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(sum(r["kind"] == "train" for r in records)))

    # One node with two ranks, the command node-0 published: from scratch, and resumed from the same epoch-0 checkpoint.
    entry = read_publication(layout.train).entry

    def one_node(folder: Path, resume_from: Path | None) -> Path:
        if resume_from is not None:  # a copy: speculators passes over symlinked epochs
            shutil.copytree(resume_from, folder / "checkpoints" / resume_from.name)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   *[arg.replace(str(layout.train.root), str(folder)) for arg in entry]]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return folder

    fresh = one_node(tmp_path / "one-node", None)
    resumed = one_node(tmp_path / "one-node-resumed", layout.train.checkpoints / "0")
    ours = [r for r in records if r["kind"] == "train"]
    theirs = {e: [r for r in read_records(f / "metrics.jsonl") if r["kind"] == "train" and r["epoch"] == e]
              for e, f in ((0, fresh), (1, resumed))}
    metric_difference = max(
        _max_difference(a, b) for e in (0, 1) for a, b in zip([r for r in ours if r["epoch"] == e], theirs[e], strict=True)
    )
    weight_difference = 0.0
    for epoch, folder in ((0, fresh), (1, resumed)):
        a = load_file(layout.train.checkpoints / str(epoch) / "model.safetensors")
        b = load_file(folder / "checkpoints" / str(epoch) / "model.safetensors")
        weight_difference = max(weight_difference, max((a[k].float() - b[k].float()).abs().max().item() for k in a))
    assert metric_difference == 0.0 and weight_difference == 0.0, (metric_difference, weight_difference)

    print(
        f"two nodes on two Celery workers: node-1 killed in epoch 2, node-0 stopped {stopped:.0f}s later, both retried "
        f"and resumed from epoch 1's checkpoint; identical to one node of two ranks (metrics and weights, difference "
        f"{metric_difference}, {weight_difference}); run {time.monotonic() - started:.0f}s"
    )
