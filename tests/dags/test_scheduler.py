"""The DAG under a real Airflow: scheduler, dag-processor, triggerer and api-server as subprocesses.

Runs through the REST API. One trains two drafters (an EAGLE-3 and a DFlash reading other layers)
from one capture, with the reference engine told to fail one row of the middle shard: the run
fails on that shard only; clearing that one mapped instance through the API re-runs it with its
setups (engine launch and readiness) and teardown without touching any other shard's files
(speculators' own reader loads every row of the union capture); then the DFlash's training is
refused by a stray trainer holding its folder while the EAGLE-3 is trained, exported, measured and
compared alone, and clearing only the DFlash's training instance trains, exports and measures it,
while the EAGLE-3's instances reuse their results and both are compared; last, a complete shard
cleared with its downstream tasks (Airflow's default) starts no engine and trains, exports and
measures nothing again: each task's log says it reused its result.
(A run whose scheduler is killed while a shard extracts, and restarted, is the browser's run from the form:
``tests/plugins/test_ui_in_airflow.py``.)
(Two engines in one run, one of them killed, run in ``test_celery.py``, on the Celery deployment.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(1500)]

DAG_ID = "eagleflow"

ROWS, SHARD_SIZE, FAIL_ROW = 30, 10, 13
FAILED_SHARD = FAIL_ROW // SHARD_SIZE  # map index of rows_10-20
SHARD_NAMES = [f"rows_{s}-{s + SHARD_SIZE}" for s in range(0, ROWS, SHARD_SIZE)]
# One engine: its setups (the capture check is one: a restarted engine is checked again) and
# teardown are the single instance (map index 0) of each engine task.
SETUPS_AND_TEARDOWN = [("launch_server", 0), ("wait_server_ready", 0), ("verify_capture", 0), ("stop_server", 0)]
# Two drafters from one capture: the DFlash reads other layers (the capture holds the union).
EAGLE3_LAYERS, DFLASH_LAYERS = [2, 4, 5], [1, 3, 5, 7]
DRAFTERS = ["eagle3", {"name": "dflash", "draft_algorithm": "dflash", "block_size": 4, "num_layers": 1, "mask_token_id": 0,
                       "max_anchors": 16, "aux_layer_ids": DFLASH_LAYERS}]
EAGLE3, DFLASH = 0, 1  # map indexes of each drafter's instances (one training node)
PER_DRAFTER = ("plot_metrics", "export_drafter", "evaluate_drafter")
DOWNSTREAM = [(task, -1) for task in ("build_vocab", "plan_train_nodes", "train_drafter")]
# Run whatever training's outcome, each instance skipped while its own drafter is not trained.
DRAFTER_INSTANCES = [(task, i) for task in PER_DRAFTER for i in (EAGLE3, DFLASH)]
COMPARE = [("compare_drafters", -1)]
# Runs whatever training's outcome (it stops an online run's engines; here, disk mode, nothing).
AFTER_TRAINING = [("stop_server_after_training", 0)]
UNTOUCHED = [
    (task, -1)
    for task in ("plan_engines", "regenerate_dataset", "prepare_dataset", "dataset_stats", "check_disk", "plan_shards", "plan_drafters")
]
RUN_TIMEOUT = 600.0


def _conf(inputs: Any, output_root: Path, run_name: str) -> dict[str, Any]:
    """Params of the run: shards of 10 rows (row 13 is refused once by the engine: ``inject_faults``)."""
    return inputs.conf(output_root, run_name, shard_size=SHARD_SIZE, drafters=DRAFTERS)


def _file_identities(folder: Path, pattern: str = "hs_*.safetensors") -> dict[str, tuple[int, int]]:
    """``{file name: (inode, mtime_ns)}``: a rewrite (even by rename) changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.glob(pattern))}


def _tries(tis: dict[tuple[str, int], dict[str, Any]]) -> dict[tuple[str, int], int]:
    return {key: ti["try_number"] for key, ti in tis.items()}


def test_failed_shard_cleared_reruns_alone_one_drafter_cleared_alone_a_complete_shard_cleared_reuses_everything(
    airflow_stack: Any, run_inputs: Any, tmp_path: Path
) -> None:
    from eagleflow.layout import RunLayout
    from eagleflow.engine.process import pid_alive
    from eagleflow.train.lock import TrainFolderLock

    started = time.monotonic()
    inputs = run_inputs(ROWS)
    run_id = run_name = "scheduler-clear-one-shard"
    layout = RunLayout.of(tmp_path / "runs", run_name)
    airflow_stack.inject_faults(fail_row=[FAIL_ROW])
    airflow_stack.trigger(run_id, _conf(inputs, tmp_path / "runs", run_name))

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
    for key in SETUPS_AND_TEARDOWN + UNTOUCHED + AFTER_TRAINING:
        assert tis[key]["state"] == "success", airflow_stack.describe(run_id)
    for key in DOWNSTREAM:
        assert tis[key]["state"] == "upstream_failed", airflow_stack.describe(run_id)
    for key in DRAFTER_INSTANCES:
        assert tis[key]["state"] == "skipped", airflow_stack.describe(run_id)
    # The comparison, the run's last word, names the drafters it could not measure.
    assert tis[COMPARE[0]]["state"] == "failed", airflow_stack.describe(run_id)
    # A row the engine refused fails its shard for good: no retry, only a clear redoes it.
    assert tis[("extract_shard", FAILED_SHARD)]["try_number"] == 1, airflow_stack.describe(run_id)

    # The failure is explained in the shard's log as the UI shows it.
    failed_log = airflow_stack.task_log(run_id, "extract_shard", tis[("extract_shard", FAILED_SHARD)]["try_number"], FAILED_SHARD)
    assert f"1 row(s) failed: {FAIL_ROW};" in failed_log, failed_log[-3000:]
    manifest = json.loads(layout.shard_manifest(SHARD_NAMES[1]).read_text())
    assert [f["row"] for f in manifest["failed"]] == [FAIL_ROW], manifest
    # The teardown stopped the first engine although a shard failed.
    first_engine = airflow_stack.xcom(run_id, "launch_server", 0)
    assert not pid_alive(int(first_engine["pid"])), f"first engine {first_engine} still running after stop_server"

    before = _file_identities(layout.hidden_states)
    assert len(before) == ROWS - 1 and f"hs_{FAIL_ROW}.safetensors" not in before, sorted(before)
    tries_before = _tries(tis)

    # A stray trainer (say, a training started by hand) holds the DFlash's training folder from now on.
    stray = TrainFolderLock(layout.for_drafter("dflash").train.lock, 0)
    layout.for_drafter("dflash").train.root.mkdir(parents=True)
    stray.acquire()

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
    expected_keys = {("extract_shard", FAILED_SHARD), *SETUPS_AND_TEARDOWN, *DOWNSTREAM, *DRAFTER_INSTANCES, *COMPARE, *AFTER_TRAINING}
    assert planned_keys == expected_keys, sorted(planned_keys)
    airflow_stack.request("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={**clear, "dry_run": False})

    # --- second pass: the shard is whole; the EAGLE-3 is trained, exported, measured; the DFlash's folder is held ---
    state = airflow_stack.wait_for_run(run_id, RUN_TIMEOUT)
    tis = airflow_stack.task_instances(run_id)
    assert state == "failed", airflow_stack.describe(run_id)
    assert {tis[("extract_shard", i)]["rendered_map_index"] for i in range(3)} == set(SHARD_NAMES)
    assert {tis[("extract_shard", i)]["state"] for i in range(3)} == {"success"}
    # One train_drafter instance per drafter, named by it; the held one refused at once (bad input: no retry).
    assert tis[("train_drafter", EAGLE3)]["rendered_map_index"] == "eagle3"
    assert tis[("train_drafter", DFLASH)]["rendered_map_index"] == "dflash"
    assert (tis[("train_drafter", EAGLE3)]["state"], tis[("train_drafter", DFLASH)]["state"]) == ("success", "failed")
    refused = airflow_stack.task_log(run_id, "train_drafter", tis[("train_drafter", DFLASH)]["try_number"], DFLASH)
    assert "Two trainers on one checkpoints/ folder would overwrite each other" in refused, refused[-3000:]
    for task in PER_DRAFTER:
        assert tis[(task, EAGLE3)]["rendered_map_index"] == "eagle3"
        assert (tis[(task, EAGLE3)]["state"], tis[(task, DFLASH)]["state"]) == ("success", "skipped"), airflow_stack.describe(run_id)
    assert tis[COMPARE[0]]["state"] == "failed"
    compare_log = airflow_stack.task_log(run_id, "compare_drafters", tis[COMPARE[0]]["try_number"])
    assert "not measured in this run: dflash" in compare_log, compare_log[-3000:]
    assert [d["label"] for d in json.loads(layout.comparison.read_text())["drafters"]] == ["eagle3"]

    # Exactly the cleared instances ran again; everything else kept its single try. The per-drafter
    # tasks, never expanded before the clear (their upstream had failed), are now one instance per drafter.
    tries_after = _tries(tis)
    for task in ("train_drafter",):
        assert tries_after.pop((task, EAGLE3)) == tries_after.pop((task, DFLASH)) == tries_before[(task, -1)] + 1
    tries_after[("train_drafter", -1)] = tries_before[("train_drafter", -1)] + 1
    rerun = {key for key in tries_after if tries_after[key] != tries_before.get(key)}
    assert rerun == expected_keys, airflow_stack.describe(run_id)

    # The setups really started a fresh engine (the old one had been stopped), and the
    # teardown stopped it again: no engine is left behind.
    second_engine = airflow_stack.xcom(run_id, "launch_server", 0)
    assert second_engine["pid"] != first_engine["pid"]
    assert not pid_alive(int(second_engine["pid"])), f"second engine {second_engine} still running after stop_server"
    assert layout.engine_log("engine-0").read_text().count("starting:") == 2

    # No finished row was rewritten, not even in the cleared shard: only the failed row is new.
    after = _file_identities(layout.hidden_states)
    assert set(after) == set(before) | {f"hs_{FAIL_ROW}.safetensors"}
    assert {name: after[name] for name in before} == before
    manifest = json.loads(layout.shard_manifest(SHARD_NAMES[1]).read_text())
    assert (manifest["done"], manifest["skipped"], manifest["failed"]) == (1, SHARD_SIZE - 1, []), manifest
    # Nothing else in the folder: no temporary or partial file was left behind.
    assert sorted(p.name for p in layout.hidden_states.iterdir()) == sorted(after)

    # --- third pass: the stray trainer is gone; only the DFlash's training is cleared, with its downstream ---
    stray.release()
    eagle3 = layout.for_drafter("eagle3")
    eagle3_results = {**_file_identities(eagle3.drafter / "sglang", "*"), **_file_identities(eagle3.evaluation, "report.json")}
    tries_before = _tries(tis)
    clear = {**clear, "task_ids": [["train_drafter", DFLASH]]}
    planned = airflow_stack.request("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={**clear, "dry_run": True})
    cleared = {(ti["task_id"], ti["map_index"]) for ti in planned["task_instances"]}
    # Airflow relates no per-drafter instance to one training instance: it clears every drafter's; the EAGLE-3's
    # training is not among them.
    assert cleared == {("train_drafter", DFLASH), *DRAFTER_INSTANCES, *COMPARE, *AFTER_TRAINING}, sorted(cleared)
    airflow_stack.request("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={**clear, "dry_run": False})
    state = airflow_stack.wait_for_run(run_id, RUN_TIMEOUT)
    tis = airflow_stack.task_instances(run_id)
    assert state == "success", airflow_stack.describe(run_id)
    assert all(ti["state"] == "success" for ti in tis.values()), airflow_stack.describe(run_id)
    assert {key for key, tries in _tries(tis).items() if tries != tries_before[key]} == cleared
    # The EAGLE-3's instances finished at once on the results they had made (files untouched), saying so;
    # the DFlash was trained, exported and measured.
    for task in PER_DRAFTER:
        log = airflow_stack.task_log(run_id, task, tis[(task, EAGLE3)]["try_number"], EAGLE3)
        assert "reusing the finished result" in log, (task, log[-2000:])
        log = airflow_stack.task_log(run_id, task, tis[(task, DFLASH)]["try_number"], DFLASH)
        assert "reusing the finished result" not in log, (task, log[-2000:])
    assert {**_file_identities(eagle3.drafter / "sglang", "*"), **_file_identities(eagle3.evaluation, "report.json")} == eagle3_results
    dflash = layout.for_drafter("dflash")
    trained = json.loads(dflash.train.result.read_text())
    assert trained["train_seconds"] > 0
    assert json.loads((dflash.drafter / "export.json").read_text())["sglang"]["algorithm"] == "DFLASH"
    for drafter, layers in ((eagle3, EAGLE3_LAYERS), (dflash, DFLASH_LAYERS)):
        # Each trained on its own layers of the one capture.
        assert json.loads(drafter.train.config.read_text())["aux_layer_ids"] == layers
    comparison = json.loads(layout.comparison.read_text())
    assert [d["label"] for d in comparison["drafters"]] == ["eagle3", "dflash"], comparison
    assert comparison["winner"]["drafter"] in ("eagle3", "dflash") and comparison["winner"]["sglang_flags"], comparison
    assert not comparison["missing"], comparison

    # --- fourth pass: a complete shard cleared with its downstream tasks, as Airflow's clear dialog offers ---
    # Nothing was added: no engine starts, and every task after it finishes at once on the result it made, saying so.
    made = {**{str(p): p.stat().st_mtime_ns for d in (eagle3, dflash) for p in d.train.checkpoints.rglob("*") if p.is_file()},
            **_file_identities(dflash.drafter / "sglang", "*"), **_file_identities(dflash.evaluation, "report.json")}
    clear = {**clear, "task_ids": [["extract_shard", 0]]}
    airflow_stack.request("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={**clear, "dry_run": False})
    state = airflow_stack.wait_for_run(run_id, RUN_TIMEOUT)
    tis = airflow_stack.task_instances(run_id)
    assert state == "success", airflow_stack.describe(run_id)
    launch = airflow_stack.task_log(run_id, "launch_server", tis[("launch_server", 0)]["try_number"], 0)
    assert "Not launching engine-0: every shard of run" in launch, launch[-2000:]
    reused = {"build_vocab": [-1], "train_drafter": [EAGLE3, DFLASH], **{task: [EAGLE3, DFLASH] for task in PER_DRAFTER}}
    for task, indexes in reused.items():
        for index in indexes:
            log = airflow_stack.task_log(run_id, task, tis[(task, index)]["try_number"], index)
            assert "reusing the finished result" in log, (task, index, log[-2000:])
    assert {**{str(p): p.stat().st_mtime_ns for d in (eagle3, dflash) for p in d.train.checkpoints.rglob("*") if p.is_file()},
            **_file_identities(dflash.drafter / "sglang", "*"), **_file_identities(dflash.evaluation, "report.json")} == made

    inputs.check_every_row(layout.dataset, captured=sorted(set(EAGLE3_LAYERS + DFLASH_LAYERS)))
    for index in (EAGLE3, DFLASH):
        plots = airflow_stack.xcom(run_id, "plot_metrics", index)
        assert plots["png"] and all(Path(p).is_file() for p in plots["png"] + plots["svg"]), plots
        evaluation = airflow_stack.xcom(run_id, "evaluate_drafter", index)
        assert evaluation["accept_length"] >= 1.0 and Path(evaluation["report"]).is_file(), evaluation
    print(f"scheduler test: first pass {first_pass:.0f}s, total {time.monotonic() - started:.0f}s")


def _failed_task_logs(stack: Any, run_id: str) -> str:
    """The Airflow logs of the run's failed tries (every try of every task that failed once), for a failure message."""
    parts = []
    for (task_id, map_index), ti in sorted(stack.task_instances(run_id).items()):
        for attempt in stack.tries(run_id, task_id, map_index):
            if attempt["state"] in ("failed", "up_for_retry"):
                log = stack.task_log(run_id, task_id, attempt["try_number"], map_index)
                parts.append(f"--- {task_id}[{map_index}] try {attempt['try_number']} ({attempt['state']}) ---\n{log[-4000:]}")
    return "\n".join(parts)


def test_bad_aux_layer_ids_are_refused_at_trigger_or_by_the_first_tasks(
    airflow_stack: Any, run_inputs: Any, tmp_path: Path
) -> None:
    """[2, 2] never becomes a run; ids past the verifier's depth stop the run before any extraction."""
    airflow_stack.inject_faults()  # none left over from the tests before
    airflow_stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    conf = _conf(run_inputs(ROWS), tmp_path / "runs", "bad-aux")

    # What the Param's schema can say (distinct, non-negative) Airflow refuses before the run exists.
    for ids in ([2, 2], [-1, 3]):
        refused = airflow_stack.request(
            "POST", f"/dags/{DAG_ID}/dagRuns", expect=400,
            json={"dag_run_id": f"bad-aux-{ids[0]}", "logical_date": None, "conf": {**conf, "aux_layer_ids": ids}},
        )
        assert "aux_layer_ids" in json.dumps(refused), refused
        airflow_stack.request("GET", f"/dags/{DAG_ID}/dagRuns/bad-aux-{ids[0]}", expect=404)
    # A number out of range, as typed in the form (which leaves it as typed: no top-level bounds to clamp to).
    refused = airflow_stack.request("POST", f"/dags/{DAG_ID}/dagRuns", expect=400,
                                    json={"dag_run_id": "bad-shard-size", "logical_date": None, "conf": {**conf, "shard_size": -5}})
    assert "shard_size" in json.dumps(refused) and "-5 is less than the minimum of 1" in json.dumps(refused), refused

    # The verifier's depth (8 layers) lives in its folder, on the workers: the first task (plan_engines) reads it and
    # fails naming the Param; nothing after it runs, and the last task repeats its sentence.
    run_id = "bad-aux-depth"
    airflow_stack.trigger(run_id, {**conf, "aux_layer_ids": [2, 9]})
    assert airflow_stack.wait_for_run(run_id, RUN_TIMEOUT) == "failed", airflow_stack.describe(run_id)
    tis = airflow_stack.task_instances(run_id)
    assert tis[("plan_engines", -1)]["state"] == "failed", airflow_stack.describe(run_id)
    log = airflow_stack.task_log(run_id, "plan_engines", tis[("plan_engines", -1)]["try_number"], -1)
    assert 'Param aux_layer_ids ("Aux layer ids"): aux layer ids [9] are outside 0..8' in log, log[-2000:]
    ran = {task for (task, _), ti in tis.items() if ti["state"] not in ("upstream_failed", "skipped", None)}
    # The last task runs whatever happened before it, to fail the run by name.
    assert ran <= {"plan_engines", "stop_server", "stop_server_after_training", "compare_drafters"}, airflow_stack.describe(run_id)
    compare = airflow_stack.task_log(run_id, "compare_drafters", tis[("compare_drafters", -1)]["try_number"], -1)
    assert "failed in this run: plan_engines (refused the run's Params: Param aux_layer_ids" in compare, compare[-2000:]
    assert "task(s) that could not run after them" in compare, compare[-2000:]
    assert not (tmp_path / "runs" / "bad-aux" / "dataset").exists()
