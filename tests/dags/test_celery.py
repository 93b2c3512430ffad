"""The Celery deployment, for real: PostgreSQL, Redis and Airflow's CeleryExecutor on this machine.

``celery_stack`` starts what ``docker/docker-compose.yaml`` deploys, with the same Airflow
settings file (``docker/airflow.env``): scheduler, dag-processor, triggerer, api-server, a Celery
worker on the default queue and one on the GPU queue with the GPU pool. The DAG runs twice
through the REST API, each run with a fault and each ending in success:

1. two engines serve the shards of one run (the GPU pool given a slot each); engine-1 is
   SIGKILLed while it serves its second shard: that try fails, its retry and engine-1's later
   shards go to engine-0, and nothing finished is redone;
2. the GPU worker is SIGKILLed, with everything under it, while a shard is in flight, then
   started again: the scheduler notices the lost task (no heartbeat), retries it on the
   restarted worker, every row validates, and no row finished before the kill is written again.

Both print how long detection and retry took (README, "Beyond one machine").
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
# Shards of the two runs: six of 4 rows (three per engine), two of 12 rows.
SHARD_OF_4 = [f"rows_{s}-{s + 4}" for s in range(0, ROWS, 4)]
SHARD_OF_12 = [f"rows_{s}-{s + 12}" for s in range(0, ROWS, 12)]
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


def _slow_run(run_inputs: Any, tmp_path: Path, run_id: str, **params: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Inputs, run folder and Params of a ROWS-row run whose engine is slow enough to be caught mid-shard.

    Each request takes at least 1.5 s, two at a time, on one torch thread: a shard runs for
    several seconds, so the test can act while one is in flight.
    """
    from eagleflow.layout import RunLayout

    inputs = run_inputs(ROWS)
    conf = inputs.conf(
        tmp_path / "runs", run_id, concurrency=2,
        server_extra_args=["--warmup-seconds", "3", "--threads", "1", "--min-request-seconds", "1.5"], **params,
    )
    return inputs, RunLayout.of(tmp_path / "runs", run_id), conf


def _wait_while_running(stack: Any, run_id: str, deadline: float) -> None:
    assert time.monotonic() < deadline, stack.describe(run_id)
    assert stack.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"] in ("queued", "running"), stack.describe(run_id)
    time.sleep(0.2)


def test_two_engines_serve_one_run_on_celery_and_losing_one_mid_shard_loses_nothing(
    celery_stack: Any, run_inputs: Any, in_flight: Any, tmp_path: Path
) -> None:
    from eagleflow.engine.process import pid_alive

    started = time.monotonic()
    run_id = "celery-two-engines"
    inputs, layout, conf = _slow_run(run_inputs, tmp_path, run_id, shard_size=4, num_engines=2)
    # Two engines feed two shards at once: the GPU pool gets a slot per engine, as README says.
    celery_stack.request("PATCH", "/pools/gpu", json=_pool(2), params={"update_mask": ["slots"]})
    try:
        celery_stack.trigger(run_id, conf)
        # Kill engine-1 while it serves a shard, once it has finished one.
        deadline = time.monotonic() + RUN_TIMEOUT
        while True:
            victim = in_flight(layout.root, min_rows=1, engine="engine-1 ")
            served = [m for m in _manifests(layout.shards).values() if m["engine"].startswith("engine-1 ")]
            if victim and any(m["state"] == "success" for m in served):
                break
            _wait_while_running(celery_stack, run_id, deadline)
        engine_1 = json.loads(layout.engine_state("engine-1").read_text())
        os.killpg(int(engine_1["pid"]), signal.SIGKILL)
        killed_at = time.time()
        finished_before = _files(layout.hidden_states)
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
    # Both served whole shards; the killed one and engine-1's later shards went to engine-0.
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
    after = _files(layout.hidden_states)
    assert {name: after[name] for name in finished_before} == finished_before  # nothing finished was redone
    inputs.check_every_row(layout.dataset)

    # The teardowns: engine-1 was already gone, engine-0 was stopped; no engine is left.
    stops = {tis[("stop_server", i)]["rendered_map_index"]: celery_stack.xcom(run_id, "stop_server", i) for i in (0, 1)}
    assert "had already exited" in stops["engine-1"] and "stopped" in stops["engine-0"], stops
    assert not any(pid_alive(int(e["pid"])) for e in engines.values())
    failed, retried, done = (_seconds(t) - killed_at for t in (tries[0]["end_date"], tries[1]["start_date"], tries[1]["end_date"]))
    print(
        f"two engines: engine-1 killed in {victim['name']} with {manifests[victim['name']]['skipped']} rows done: its try "
        f"failed after {failed:.0f}s, the retry on engine-0 started after {retried:.0f}s, finished after {done:.0f}s; "
        f"run {time.monotonic() - started:.0f}s"
    )


def test_the_run_survives_losing_the_gpu_worker_mid_shard(
    celery_stack: Any, run_inputs: Any, in_flight: Any, tmp_path: Path
) -> None:
    started = time.monotonic()
    run_id = "celery-lost-worker"
    inputs, layout, conf = _slow_run(run_inputs, tmp_path, run_id, shard_size=12)
    celery_stack.trigger(run_id, conf)
    deadline = time.monotonic() + RUN_TIMEOUT
    while (shard := in_flight(layout.root, min_rows=2)) is None:
        _wait_while_running(celery_stack, run_id, deadline)
    victim = shard["name"]

    finished_before: dict[str, tuple[int, int]] = {}

    def record_finished_rows() -> None:  # every process under the worker is frozen now
        finished_before.update(_files(layout.hidden_states))

    killed = celery_stack.processes.kill("worker-gpu", while_frozen=record_finished_rows)
    killed_at = time.time()
    celery_stack.processes.start_component("worker-gpu")
    assert len(killed) >= 3, killed  # the worker, its pool process, the task and its extraction step

    state = celery_stack.wait_for_run(run_id, RUN_TIMEOUT)
    assert state == "success", celery_stack.describe(run_id)
    index = SHARD_OF_12.index(victim)
    tries = celery_stack.tries(run_id, "extract_shard", index)
    assert [t["try_number"] for t in tries] == [1, 2], tries
    assert tries[0]["state"] in ("failed", "up_for_retry") and tries[1]["state"] == "success", tries
    # The scheduler found the lost try by its missing heartbeat (it records that in the event log).
    events = celery_stack.request(
        "GET", "/eventLogs", params={"dag_id": DAG_ID, "run_id": run_id, "event": "heartbeat timeout", "limit": 100}
    )["event_logs"]
    assert [(e["task_id"], e["map_index"], e["try_number"]) for e in events] == [("extract_shard", index, 1)], events

    # No row finished before the kill was written again; the retry did only the rest.
    after = _files(layout.hidden_states)
    assert {name: after[name] for name in finished_before} == finished_before
    in_victim = [n for n in finished_before if shard["start"] <= int(n[3:-12]) < shard["end"]]
    manifest = json.loads(layout.shard_manifest(victim).read_text())
    assert (manifest["state"], manifest["skipped"], manifest["done"]) == ("success", len(in_victim), 12 - len(in_victim))
    assert 2 <= len(in_victim) < 12
    assert sorted(after) == sorted(f"hs_{row}.safetensors" for row in range(ROWS))
    inputs.check_every_row(layout.dataset)

    detected, retried, done = (_seconds(t) - killed_at for t in (events[0]["when"], tries[1]["start_date"], tries[1]["end_date"]))
    print(
        f"lost GPU worker: killed with {len(in_victim)}/12 rows of {victim} done: lost task detected after {detected:.0f}s, "
        f"retry started after {retried:.0f}s, shard done after {done:.0f}s; run {time.monotonic() - started:.0f}s"
    )
