"""The DAG under a real Airflow: scheduler, dag-processor, triggerer and api-server as subprocesses.

One DAG run through the REST API, with the reference engine told to fail one row of the middle
shard: the run fails on that shard only; clearing that one mapped instance through the API
re-runs it with its setups (engine launch and readiness) and teardown, and the run then
succeeds without touching any other shard's files; speculators' own reader loads every row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(1500)]

DAG_ID = "eagleflow"

ROWS, SHARD_SIZE, FAIL_ROW = 30, 10, 13
FAILED_SHARD = FAIL_ROW // SHARD_SIZE  # map index of rows_10-20
SHARD_NAMES = [f"rows_{s}-{s + SHARD_SIZE}" for s in range(0, ROWS, SHARD_SIZE)]
SETUPS_AND_TEARDOWN = ["launch_server", "wait_server_ready", "stop_server"]
DOWNSTREAM = ["build_vocab", "train_drafter", "plot_metrics", "export_drafter", "evaluate_drafter"]
UNTOUCHED = ["regenerate_dataset", "prepare_dataset", "dataset_stats", "check_disk", "plan_shards"]
RUN_TIMEOUT = 600.0
MAX_LEN = 256


def _conf(model: Path, conversations: Path, output_root: Path, run_name: str) -> dict[str, Any]:
    """Params of the run: the 2-core sizes of the tiny plumbing model."""
    return {
        "engine": "reference",
        "model_path": str(model),
        "dataset_input": str(conversations),
        "output_root": str(output_root),
        "run_name": run_name,
        "shard_size": SHARD_SIZE,
        "max_len": MAX_LEN,
        "concurrency": 4,
        "server_port": 0,
        "server_extra_args": ["--warmup-seconds", "3", "--fail-row", str(FAIL_ROW)],
        "warmup_timeout_minutes": 5.0,
        "epochs": 1,
        "total_seq_len": 512,
        "num_workers": 0,
        "draft_vocab_size": 256,
        "device": "cpu",
        "eval_rows": 2,
        "eval_max_new_tokens": 8,
        "eval_concurrency": 1,
    }


def _make_conversations(model: Path, out: Path, rows: int = ROWS) -> None:
    subprocess.run(
        [sys.executable, "-m", "eagleflow", "make-dataset", "--tokenizer", str(model), "--out", str(out), "--rows", str(rows)],
        check=True,
        capture_output=True,
        text=True,
    )


def _file_identities(hidden_states: Path) -> dict[str, tuple[int, int]]:
    """``{file name: (inode, mtime_ns)}``: a rewrite (even by rename) changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(hidden_states.glob("hs_*.safetensors"))}


def _tries(tis: dict[tuple[str, int], dict[str, Any]]) -> dict[tuple[str, int], int]:
    return {key: ti["try_number"] for key, ti in tis.items()}


def test_failed_shard_cleared_through_the_api_reruns_alone(
    airflow_stack: Any, random_tiny_model: Path, tmp_path: Path
) -> None:
    from eagleflow.layout import RunLayout
    from eagleflow.engine.process import pid_alive

    started = time.monotonic()
    conversations = tmp_path / "conversations.jsonl"
    _make_conversations(random_tiny_model, conversations)
    run_id = run_name = "scheduler-clear-one-shard"
    layout = RunLayout.of(tmp_path / "runs", run_name)

    airflow_stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    airflow_stack.request(
        "POST",
        f"/dags/{DAG_ID}/dagRuns",
        json={"dag_run_id": run_id, "logical_date": None, "conf": _conf(random_tiny_model, conversations, tmp_path / "runs", run_name)},
    )

    # --- first pass: only the shard holding the failing row fails -------------------------
    state = airflow_stack.wait_for_run(run_id, RUN_TIMEOUT)
    first_pass = time.monotonic() - started
    tis = airflow_stack.task_instances(run_id)
    assert state == "failed", airflow_stack.describe(run_id)
    shard_states = {tis[("extract_shard", i)]["rendered_map_index"]: tis[("extract_shard", i)]["state"] for i in range(3)}
    assert shard_states == {
        SHARD_NAMES[0]: "success",
        SHARD_NAMES[1]: "failed",
        SHARD_NAMES[2]: "success",
    }, airflow_stack.describe(run_id)
    for task_id in SETUPS_AND_TEARDOWN + UNTOUCHED:
        assert tis[(task_id, -1)]["state"] == "success", airflow_stack.describe(run_id)
    for task_id in DOWNSTREAM:
        assert tis[(task_id, -1)]["state"] == "upstream_failed", airflow_stack.describe(run_id)

    # The failure is explained in the shard's log as the UI shows it.
    failed_log = airflow_stack.task_log(run_id, "extract_shard", tis[("extract_shard", FAILED_SHARD)]["try_number"], FAILED_SHARD)
    assert f"1 row(s) failed: {FAIL_ROW};" in failed_log, failed_log[-3000:]
    manifest = json.loads(layout.shard_manifest(SHARD_NAMES[1]).read_text())
    assert [f["row"] for f in manifest["failed"]] == [FAIL_ROW], manifest
    # The teardown stopped the first engine although a shard failed.
    first_engine = airflow_stack.xcom(run_id, "launch_server")
    assert not pid_alive(int(first_engine["pid"])), f"first engine {first_engine} still running after stop_server"

    before = _file_identities(layout.hidden_states)
    assert len(before) == ROWS - 1 and f"hs_{FAIL_ROW}.safetensors" not in before, sorted(before)
    tries_before = _tries(tis)

    # --- clear that one mapped instance, as the UI's "Clear" with downstream does -------------
    clear = {
        "dag_run_id": run_id,
        "task_ids": [["extract_shard", FAILED_SHARD]],
        "include_downstream": True,
        "only_failed": False,  # the setups and teardown succeeded; they must be cleared too
        "reset_dag_runs": True,
    }
    planned = airflow_stack.request("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={**clear, "dry_run": True})
    planned_keys = {(ti["task_id"], ti["map_index"]) for ti in planned["task_instances"]}
    expected_keys = {("extract_shard", FAILED_SHARD)} | {(t, -1) for t in SETUPS_AND_TEARDOWN + DOWNSTREAM}
    assert planned_keys == expected_keys, sorted(planned_keys)
    airflow_stack.request("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={**clear, "dry_run": False})

    # --- second pass: the run finishes green ----------------------------------------------------
    state = airflow_stack.wait_for_run(run_id, RUN_TIMEOUT)
    tis = airflow_stack.task_instances(run_id)
    assert state == "success", airflow_stack.describe(run_id)
    assert {tis[("extract_shard", i)]["rendered_map_index"] for i in range(3)} == set(SHARD_NAMES)
    assert all(ti["state"] == "success" for ti in tis.values()), airflow_stack.describe(run_id)

    # Exactly the cleared instances ran again; everything else kept its single try.
    tries_after = _tries(tis)
    rerun = {key for key in tries_after if tries_after[key] != tries_before[key]}
    assert rerun == expected_keys, airflow_stack.describe(run_id)
    for key in expected_keys:
        assert tries_after[key] == tries_before[key] + 1, (key, tries_before[key], tries_after[key])

    # The setups really started a fresh engine (the old one had been stopped), and the
    # teardown stopped it again: no engine is left behind.
    second_engine = airflow_stack.xcom(run_id, "launch_server")
    assert second_engine["pid"] != first_engine["pid"]
    assert not pid_alive(int(second_engine["pid"])), f"second engine {second_engine} still running after stop_server"
    assert layout.server_log.read_text().count("starting:") == 2

    # No finished row was rewritten, not even in the cleared shard: only the failed row is new.
    after = _file_identities(layout.hidden_states)
    assert set(after) == set(before) | {f"hs_{FAIL_ROW}.safetensors"}
    assert {name: after[name] for name in before} == before
    manifest = json.loads(layout.shard_manifest(SHARD_NAMES[1]).read_text())
    assert (manifest["done"], manifest["skipped"], manifest["failed"]) == (1, SHARD_SIZE - 1, []), manifest
    # Nothing else in the folder: no temporary or partial file was left behind.
    assert sorted(p.name for p in layout.hidden_states.iterdir()) == sorted(after)

    _check_every_row_readable(layout.dataset, random_tiny_model)
    plots = airflow_stack.xcom(run_id, "plot_metrics")
    assert plots["png"] and all(Path(p).is_file() for p in plots["png"] + plots["svg"]), plots
    evaluation = airflow_stack.xcom(run_id, "evaluate_drafter")
    assert evaluation["accept_length"] >= 1.0 and Path(evaluation["report"]).is_file(), evaluation
    print(f"scheduler test: first pass {first_pass:.0f}s, total {time.monotonic() - started:.0f}s")


def _check_every_row_readable(dataset: Path, model: Path, num_rows: int = ROWS) -> None:
    """Every row's file passes ``validate`` and speculators' ArrowDataset loads it."""
    from datasets import load_from_disk
    from speculators.train.data import ArrowDataset

    from eagleflow.data.verifier import config_int, resolve_aux_layer_ids
    from eagleflow.extract.sample_store import sample_path, validate_dataset

    hidden = config_int(str(model), "hidden_size")
    slots = len(resolve_aux_layer_ids(model, None)) + 1
    rows = load_from_disk(str(dataset))
    assert len(rows) == num_rows
    assert validate_dataset(dataset, slots, hidden) == []

    reader = ArrowDataset(max_len=MAX_LEN, datapath=str(dataset), on_missing="raise")
    assert len(reader) == num_rows
    for row in range(num_rows):
        item = reader[row]
        expected = [int(t) for t in rows[row]["input_ids"]]
        assert item["input_ids"].tolist() == expected
        assert item["hidden_states"].shape[-1] == hidden * (slots - 1), item["hidden_states"].shape
        assert os.path.getsize(sample_path(dataset / "hidden_states", row)) > 0


def test_scheduler_killed_mid_extraction_and_restarted_finishes_the_run_without_redoing_a_row(
    airflow_stack: Any, random_tiny_model: Path, tmp_path: Path
) -> None:
    """The scheduler crashes (SIGKILL to it and its LocalExecutor workers) while a shard extracts,
    and comes back. Airflow keeps each task process in a process group of its own, so the running
    shard's task and step outlive the crash and finish their rows, but nobody is left to report it:
    the new scheduler resets the orphaned task at start-up and runs it again, the rerun finds every
    finished row complete and skips it, and the run succeeds."""
    from eagleflow.layout import RunLayout

    rows, shard_size = 12, 6
    conversations = tmp_path / "conversations.jsonl"
    _make_conversations(random_tiny_model, conversations, rows)
    run_id = run_name = "scheduler-restart"
    layout = RunLayout.of(tmp_path / "runs", run_name)
    # A disk slower than the engine (each dump waits 1.5 s) keeps a shard busy when the scheduler dies.
    conf = {**_conf(random_tiny_model, conversations, tmp_path / "runs", run_name), "shard_size": shard_size,
            "server_extra_args": ["--warmup-seconds", "3", "--test-write-delay", "1.5"]}
    airflow_stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    airflow_stack.request("POST", f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None, "conf": conf})

    deadline = time.monotonic() + RUN_TIMEOUT
    while not (layout.hidden_states.is_dir() and any(layout.hidden_states.glob("hs_*.safetensors"))):
        running = airflow_stack.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"] in ("queued", "running")
        assert running and time.monotonic() < deadline and not airflow_stack.processes.dead(), airflow_stack.describe(run_id)
        time.sleep(0.5)
    running_shards = {key for key, ti in airflow_stack.task_instances(run_id).items() if key[0] == "extract_shard" and ti["state"] == "running"}
    assert running_shards, airflow_stack.describe(run_id)
    airflow_stack.processes.kill_component("scheduler")
    killed_at = time.monotonic()
    # A restart a little later than the old scheduler's heartbeat threshold (30 s): the new one then
    # finds its tasks orphaned at start-up and resets them. What was published by then is finished work.
    time.sleep(max(0.0, killed_at + 35 - time.monotonic()))
    before = _file_identities(layout.hidden_states)
    airflow_stack.processes.start_component("scheduler")

    assert airflow_stack.wait_for_run(run_id, RUN_TIMEOUT) == "success", airflow_stack.describe(run_id)
    tis = airflow_stack.task_instances(run_id)
    for key in running_shards:
        assert tis[key]["try_number"] >= 2, airflow_stack.describe(run_id)  # reset by the new scheduler and run again
    after = _file_identities(layout.hidden_states)
    assert before and {name: after[name] for name in before} == before, "a finished row was rewritten"
    assert len(after) == rows
    _check_every_row_readable(layout.dataset, random_tiny_model, rows)


def test_bad_aux_layer_ids_are_refused_at_trigger_or_by_the_first_tasks(
    airflow_stack: Any, random_tiny_model: Path, tmp_path: Path
) -> None:
    """[2, 2] never becomes a run; ids past the verifier's depth stop the run before any extraction."""
    conversations = tmp_path / "conversations.jsonl"
    _make_conversations(random_tiny_model, conversations)
    airflow_stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    conf = _conf(random_tiny_model, conversations, tmp_path / "runs", "bad-aux")

    # What the Param's schema can say (distinct, non-negative) Airflow refuses before the run exists.
    for ids in ([2, 2], [-1, 3]):
        refused = airflow_stack.request(
            "POST", f"/dags/{DAG_ID}/dagRuns", expect=400,
            json={"dag_run_id": f"bad-aux-{ids[0]}", "logical_date": None, "conf": {**conf, "aux_layer_ids": ids}},
        )
        assert "aux_layer_ids" in json.dumps(refused), refused
        airflow_stack.request("GET", f"/dags/{DAG_ID}/dagRuns/bad-aux-{ids[0]}", expect=404)

    # The verifier's depth (8 layers) lives in its folder, on the workers: the first task that
    # starts (the engine's launch) reads it and fails, naming the Param; nothing after it runs.
    run_id = "bad-aux-depth"
    airflow_stack.request(
        "POST", f"/dags/{DAG_ID}/dagRuns",
        json={"dag_run_id": run_id, "logical_date": None, "conf": {**conf, "aux_layer_ids": [2, 9]}},
    )
    assert airflow_stack.wait_for_run(run_id, RUN_TIMEOUT) == "failed", airflow_stack.describe(run_id)
    tis = airflow_stack.task_instances(run_id)
    assert tis[("launch_server", -1)]["state"] == "failed", airflow_stack.describe(run_id)
    log = airflow_stack.task_log(run_id, "launch_server", tis[("launch_server", -1)]["try_number"])
    assert "Param aux_layer_ids: aux layer ids [9] are outside 0..8" in log, log[-2000:]
    ran = {task for (task, _), ti in tis.items() if ti["state"] not in ("upstream_failed", "skipped", None)}
    assert ran <= {"launch_server", "stop_server"}, airflow_stack.describe(run_id)
    assert not (tmp_path / "runs" / "bad-aux" / "dataset").exists()
