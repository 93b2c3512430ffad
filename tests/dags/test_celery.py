"""The Celery deployment, for real: PostgreSQL, Redis and Airflow's CeleryExecutor on this machine.

``celery_stack`` starts what ``docker/docker-compose.yaml`` deploys, with the same Airflow
settings file (``docker/airflow.env``): scheduler, dag-processor, triggerer, api-server, a Celery
worker on the default queue and one on the GPU queue with the GPU pool. The DAG runs twice
through the REST API:

1. a plain run, which must succeed with every task where the deployment puts it (the GPU tasks
   on the GPU worker, the others on the default one);
2. a run whose GPU worker is SIGKILLed, with everything under it, while a shard is in flight,
   then started again: the scheduler notices the lost task (no heartbeat), retries it on the
   restarted worker, the run succeeds, every row validates, and no row finished before the kill
   is written again. The test prints how long detection and retry took (README, multi-machine).
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.celery, pytest.mark.timeout(1800)]

ROWS, SHARD_SIZE = 16, 8  # two shards: the fewest that still fan out
SHARDS = [f"rows_{s}-{s + SHARD_SIZE}" for s in range(0, ROWS, SHARD_SIZE)]
RUN_TIMEOUT = 900.0
# Slow requests in the second run: a shard takes ~8 s, long enough to be caught in flight.
SLOW_REQUEST_SECONDS = 2.0
GPU_TASKS = {"launch_server", "wait_server_ready", "extract_shard", "stop_server", "train_drafter"}


def _seconds(stamp: str) -> float:
    """Epoch seconds of an Airflow API timestamp."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _files(hidden_states: Path) -> dict[str, tuple[int, int]]:
    """``{file name: (inode, mtime_ns)}``: a rewrite, even by rename, changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(hidden_states.glob("hs_*.safetensors"))}


def test_the_dag_runs_on_celery_and_survives_losing_the_gpu_worker_mid_shard(
    celery_stack: Any, run_inputs: Any, in_flight: Any, tmp_path: Path
) -> None:
    from eagleflow.layout import RunLayout

    inputs = run_inputs(ROWS)
    output_root = tmp_path / "runs"
    started = time.monotonic()

    # --- 1. a plain run ----------------------------------------------------------------------
    celery_stack.trigger("celery-plain", inputs.conf(output_root, "celery-plain", shard_size=SHARD_SIZE))
    state = celery_stack.wait_for_run("celery-plain", RUN_TIMEOUT)
    assert state == "success", celery_stack.describe("celery-plain")
    plain_seconds = time.monotonic() - started
    tis = celery_stack.task_instances("celery-plain")
    # Each task ran on the worker of its queue (Celery node names: <queue>@host).
    for (task_id, _), ti in tis.items():
        queue = "gpu" if task_id in GPU_TASKS else "default"
        assert ti["queue"] == queue, (task_id, ti["queue"])
    inputs.check_every_row(RunLayout.of(output_root, "celery-plain").dataset)

    # --- 2. the GPU worker is lost while a shard is in flight ---------------------------------
    run_id = "celery-lost-worker"
    layout = RunLayout.of(output_root, run_id)
    conf = inputs.conf(
        output_root, run_id, shard_size=SHARD_SIZE, concurrency=2,
        server_extra_args=["--warmup-seconds", "3", "--threads", "1", "--min-request-seconds", str(SLOW_REQUEST_SECONDS)],
    )
    celery_stack.trigger(run_id, conf)
    deadline = time.monotonic() + RUN_TIMEOUT
    while (in_flight_shard := in_flight(layout.root, min_rows=2)) is None:
        assert time.monotonic() < deadline, celery_stack.describe(run_id)
        state = celery_stack.request("GET", f"/dags/eagleflow/dagRuns/{run_id}")["state"]
        assert state in ("queued", "running"), celery_stack.describe(run_id)
        time.sleep(0.2)
    victim = in_flight_shard["name"]

    finished_before: dict[str, tuple[int, int]] = {}

    def record_finished_rows() -> None:  # every process under the worker is frozen now
        finished_before.update(_files(layout.hidden_states))

    killed = celery_stack.processes.kill("worker-gpu", while_frozen=record_finished_rows)
    killed_at = time.time()
    celery_stack.processes.start_component("worker-gpu")
    assert len(killed) >= 3, killed  # the worker, its pool process, the task and its extraction step

    state = celery_stack.wait_for_run(run_id, RUN_TIMEOUT)
    assert state == "success", celery_stack.describe(run_id)
    map_index = SHARDS.index(victim)
    tries = celery_stack.tries(run_id, "extract_shard", map_index)
    assert [t["try_number"] for t in tries] == [1, 2], tries
    assert tries[0]["state"] in ("failed", "up_for_retry") and tries[1]["state"] == "success", tries
    # The scheduler found the lost try by its missing heartbeat (it records that in the event log).
    events = celery_stack.request(
        "GET", "/eventLogs", params={"dag_id": "eagleflow", "run_id": run_id, "event": "heartbeat timeout", "limit": 100}
    )["event_logs"]
    assert [(e["task_id"], e["map_index"], e["try_number"]) for e in events] == [("extract_shard", map_index, 1)], events

    # No row finished before the kill was written again; the retry did only the rest.
    after = _files(layout.hidden_states)
    assert {name: after[name] for name in finished_before} == finished_before
    in_victim = [n for n in finished_before if int(n[3:-12]) in range(map_index * SHARD_SIZE, (map_index + 1) * SHARD_SIZE)]
    manifest = json.loads(layout.shard_manifest(victim).read_text())
    assert (manifest["state"], manifest["skipped"], manifest["done"]) == ("success", len(in_victim), SHARD_SIZE - len(in_victim))
    assert 2 <= len(in_victim) < SHARD_SIZE
    assert sorted(after) == sorted(f"hs_{row}.safetensors" for row in range(ROWS))
    inputs.check_every_row(layout.dataset)

    detected = _seconds(events[0]["when"]) - killed_at
    retried = _seconds(tries[1]["start_date"]) - killed_at
    done = _seconds(tries[1]["end_date"]) - killed_at
    print(
        f"celery test: plain run {plain_seconds:.0f}s; GPU worker killed with {len(in_victim)}/{SHARD_SIZE} rows of "
        f"{victim} done: lost task detected after {detected:.0f}s, retry started after {retried:.0f}s, "
        f"shard done after {done:.0f}s; whole test {time.monotonic() - started:.0f}s"
    )
