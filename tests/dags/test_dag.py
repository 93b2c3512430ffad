"""The DAG: wiring as in docs/design.md §1, a light parse, a Params form, and remote-server mode end to end."""

from __future__ import annotations

import json
import re
import subprocess
import time
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from eagleflow.demo.console import TAIL_LINES, LogsToFile
from eagleflow.extract.sample_store import validate_dataset
from eagleflow.engine.process import ServerInfo, pid_alive, stop_server
from reference_engines import ENGINE_COMPUTE_FLAGS, launch_engine

REPO = Path(__file__).resolve().parents[2]


def test_the_dag_tells_the_story(eagleflow_dag) -> None:
    dag = eagleflow_dag
    tasks = dag.task_dict
    assert set(tasks) == {
        "plan_engines", "launch_server", "wait_server_ready", "regenerate_dataset", "prepare_dataset", "dataset_stats",
        "check_disk", "plan_shards", "verify_capture", "extract_shard", "stop_server", "build_vocab", "plan_train_nodes",
        "train_drafter", "stop_server_after_training", "plot_metrics", "export_drafter", "evaluate_drafter",
        "plan_drafters", "compare_drafters",
    }
    # The capture check is a setup too: clearing a shard re-checks the restarted engine.
    assert all(tasks[name].is_setup for name in ("launch_server", "wait_server_ready", "verify_capture"))
    assert tasks["stop_server"].is_teardown
    # one instance of each engine task per engine, named after it
    assert tasks["launch_server"].upstream_task_ids == {"plan_engines"}
    assert tasks["wait_server_ready"].upstream_task_ids == {"launch_server"}
    assert tasks["verify_capture"].upstream_task_ids == {"wait_server_ready", "prepare_dataset"}
    assert tasks["stop_server"].upstream_task_ids >= {"plan_engines", "launch_server", "wait_server_ready", "verify_capture"}
    assert tasks["launch_server"].map_index_template == tasks["stop_server"].map_index_template == "{{ task.engine['name'] }}"
    assert tasks["wait_server_ready"].map_index_template == tasks["verify_capture"].map_index_template == "{{ task.server['name'] }}"
    assert tasks["extract_shard"].upstream_task_ids == {"wait_server_ready", "verify_capture", "plan_shards", "check_disk"}
    assert tasks["stop_server"].upstream_task_ids >= {"extract_shard"}
    # dataset work runs beside the warmup: nothing of it waits for the engine to be ready (the
    # regeneration, when on, waits inside its own task; off, it returns at once after the launch)
    # every engine's launch: regeneration takes the engine list and uses the first it reaches
    assert tasks["regenerate_dataset"].upstream_task_ids == {"launch_server"}
    assert tasks["prepare_dataset"].upstream_task_ids == {"regenerate_dataset"}
    for name in ("regenerate_dataset", "prepare_dataset", "dataset_stats", "check_disk", "plan_shards"):
        assert "wait_server_ready" not in tasks[name].get_flat_relative_ids(upstream=True)
    assert tasks["build_vocab"].upstream_task_ids == {"extract_shard", "stop_server"}
    assert tasks["build_vocab"].trigger_rule == "none_failed"  # online, every shard is skipped
    # the engines' list: online, training asks them
    assert tasks["plan_drafters"].upstream_task_ids == {"plan_engines"}  # after every Param is checked
    assert tasks["plan_train_nodes"].upstream_task_ids == {"build_vocab", "plan_drafters"}
    assert tasks["train_drafter"].upstream_task_ids == {"plan_train_nodes", "wait_server_ready"}
    # one instance per drafter and training node, named after them, all of a drafter's nodes retried when one
    # stops (they resume together)
    assert tasks["train_drafter"].map_index_template == "{{ task.node['name'] }}"
    assert tasks["train_drafter"].retries >= 1
    # online, the engines stop after training, however it ended (disk: stop_server stopped them)
    assert tasks["stop_server_after_training"].upstream_task_ids == {"plan_engines", "train_drafter"}
    assert tasks["stop_server_after_training"].trigger_rule == "all_done"
    assert not tasks["stop_server_after_training"].is_teardown  # so clearing train_drafter relaunches no engine
    # one instance per drafter, named after it; the comparison waits for every evaluation, however it ended
    for name in ("plot_metrics", "export_drafter", "evaluate_drafter"):
        assert tasks[name].map_index_template == "{{ task.drafter['name'] }}"
        assert tasks[name].trigger_rule == "all_done"  # one drafter's failure holds back no other
    assert tasks["plot_metrics"].upstream_task_ids == {"train_drafter", "plan_drafters"}
    assert tasks["export_drafter"].upstream_task_ids == {"train_drafter", "plan_drafters"}
    assert tasks["evaluate_drafter"].upstream_task_ids == {"export_drafter", "plan_drafters"}
    assert tasks["compare_drafters"].upstream_task_ids == {"evaluate_drafter", "plan_drafters"}
    assert tasks["compare_drafters"].trigger_rule == "all_done"
    assert tasks["extract_shard"].map_index_template == "{{ task.shard['name'] }}"
    # a shard whose engine or worker went away is retried (on an engine that is up)
    assert tasks["extract_shard"].retries >= 1


def test_engine_extraction_and_training_run_on_the_gpu_queue_and_pool(eagleflow_dag) -> None:
    """The names docker/ deploys (tests/docker checks the compose side of the same constants)."""
    from eagleflow.deploy import GPU_POOL, GPU_QUEUE

    on_gpu = {t.task_id for t in eagleflow_dag.tasks if (t.queue, t.pool) == (GPU_QUEUE, GPU_POOL)}
    assert on_gpu == {
        "launch_server", "wait_server_ready", "verify_capture", "extract_shard", "stop_server", "train_drafter",
        "stop_server_after_training", "evaluate_drafter",
    }
    for task in eagleflow_dag.tasks:
        if task.task_id not in on_gpu:
            assert task.pool != GPU_POOL
    # regeneration talks to a launched engine, which listens on its GPU node's loopback: same
    # queue, no GPU slot
    regenerate = eagleflow_dag.task_dict["regenerate_dataset"]
    assert (regenerate.queue, regenerate.pool) == (GPU_QUEUE, "default_pool")


def test_every_param_has_a_title_and_description(eagleflow_dag) -> None:
    params = eagleflow_dag.params
    for name in ("engine", "model_path", "dataset_input", "output_root", "run_name", "shard_size", "aux_layer_ids",
                 "max_len", "concurrency", "server_port", "server_extra_args", "num_engines", "server_urls", "epochs", "lr",
                 "noise_std", "ttt_steps", "draft_vocab_size", "serve_with", "eval_rows", "eval_max_new_tokens",
                 "eval_concurrency", "eval_sets", "eval_prompts", "eval_configs", "eval_rounds", "regenerate_responses", "regen_temperature", "regen_max_new_tokens",
                 "regen_concurrency", "verify_rows"):
        param = params.get_param(name)
        # A long help is the form's Markdown (its first sentence and a README link): Airflow shows description_md then.
        assert param.schema.get("title") and (param.description or param.schema.get("description_md")), name
    assert params.get_param("shard_size").value == 2000 and params.get_param("verify_rows").value == 4
    assert params.get_param("num_engines").value == 1 and params.get_param("server_urls").value == []
    assert params.get_param("epochs").value == 5 and params.get_param("lr").value == 3e-5


def test_parsing_the_dag_imports_no_heavy_library() -> None:
    """The DAG processor parses the file often: no torch, transformers, datasets or speculators."""
    probe = (
        "import sys, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('dag', {str(REPO / 'dags' / 'eagleflow_dag.py')!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'speculators', 'matplotlib') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def assert_task_lines(said: list[str], tis: dict[tuple[str, int], Any]) -> None:
    """``said`` opens with one line per task instance of ``tis``: its state and its name, as ``make demo`` prints them."""
    lines = said[:len(tis)]
    shown = {line.split()[1]: line.split()[0] for line in lines}
    named = {ti.task_id if index < 0 else f"{ti.task_id}[{ti.rendered_map_index or index}]": str(ti.state) for (_, index), ti in tis.items()}
    assert len(lines) == len(tis) and shown == named, said


def start_outside_engine(tmp_path: Path, model: Path, **faults: Any) -> ServerInfo:
    """A reference engine started by hand, outside Airflow (another team's server), injecting the test-only ``faults``."""
    return launch_engine(model, tmp_path / "remote-dumps", tmp_path / "remote.log", aux=[2, 4, 5], faults=faults)


@pytest.fixture()
def outside_engine(tmp_path: Path, random_tiny_model: Path):
    info = start_outside_engine(tmp_path, random_tiny_model)
    yield info
    stop_server(info.pid, grace=10)


def remote_conf(tmp_path: Path, model: Path, engine: ServerInfo, run_name: str) -> dict[str, object]:
    """The Params of a small run against ``engine``: 12 rows in 5-row shards."""
    from eagleflow.demo.synthetic_data import DatasetConfig, make_dataset

    make_dataset(DatasetConfig(verifier=model, out=tmp_path / "conv.jsonl", rows=12))
    return {
        "model_path": str(model), "dataset_input": str(tmp_path / "conv.jsonl"), "output_root": str(tmp_path / "runs"),
        "run_name": run_name, "shard_size": 5, "max_len": 256, "server_urls": [engine.url], "server_dump_dir": engine.dump_dir,
        # said explicitly: dag.test() keeps an earlier test's run_conf
        "stop_after_extraction": False, "sample_transport": "file", "sample_store_conn_id": "",
    }


@pytest.mark.e2e
def test_remote_server_mode_launches_and_stops_nothing_and_extracts_everything(
    eagleflow_dag, outside_engine, tmp_path: Path, random_tiny_model: Path, scripts: Callable[[str], ModuleType]
) -> None:
    # Training and export are covered elsewhere; here the point is the engine hand-off, and the run
    # stops after extraction: everything after it skipped, the run a success. It runs as make demo runs
    # it: one line per task on the terminal, with the figure that matters for it; the logs in a file.
    conf = {**remote_conf(tmp_path, random_tiny_model, outside_engine, "remote"), "stop_after_extraction": True}
    said: list[str] = []
    with LogsToFile(tmp_path / "demo.log") as logs:
        run = scripts("demo").run_with_task_lines(eagleflow_dag, conf, logs, said.append)
    tis = {(ti.task_id, ti.map_index): ti for ti in run.get_task_instances()}
    assert str(run.state) == "success", {k: ti.state for k, ti in tis.items()}
    assert_task_lines(said, tis)
    assert len(said) == len(tis), "a run that succeeds prints no log lines"
    line = {line.split()[1]: line for line in said}
    assert re.search(r"  passed: worst final-slot logprob error \d\.\d{3}, top-1 agreement \d+%$", line["verify_capture[engine-0]"])
    assert re.search(r"\d+s  2 rows, [\d,]+ tokens, [\d.]+ kB of hidden states$", line["extract_shard[rows_10-12]"])
    assert line["stop_server[engine-0]"].endswith("  remote engine left running")
    assert line["build_vocab"] == "  skipped         build_vocab", "a skipped task: no duration, no figure"
    assert "[DAG TEST] end task task_id=extract_shard" in (tmp_path / "demo.log").read_text()
    after_extraction = ("build_vocab", "plan_train_nodes", "train_drafter", "compare_drafters")
    assert {task: tis[(task, -1)].state for task in after_extraction} == dict.fromkeys(after_extraction, "skipped")
    # One instance per drafter (the run's one), each skipped: its drafter was never trained.
    per_drafter = ("plot_metrics", "export_drafter", "evaluate_drafter")
    assert {task: tis[(task, 0)].state for task in per_drafter} == dict.fromkeys(per_drafter, "skipped")
    assert tis[("launch_server", 0)].xcom_pull(task_ids="launch_server", map_indexes=0) == {
        "url": outside_engine.url, "pid": None, "host": "", "log_path": "", "dump_dir": outside_engine.dump_dir,
        "name": "engine-0", "sample_store": None,
    }
    assert tis[("stop_server", 0)].xcom_pull(task_ids="stop_server", map_indexes=0) == "remote engine left running"
    assert pid_alive(outside_engine.pid)  # nobody stopped the remote engine
    assert not list((tmp_path / "runs" / "remote").glob("server/engine-*"))  # nobody launched one
    assert sorted(ti.rendered_map_index for (task, _), ti in tis.items() if task == "extract_shard") == [
        "rows_0-5", "rows_10-12", "rows_5-10",
    ]
    import datasets

    dataset = tmp_path / "runs" / "remote" / "dataset"
    assert len(datasets.load_from_disk(str(dataset))) == 12
    assert validate_dataset(dataset, 4, 64) == []


@pytest.mark.e2e
def test_a_wrong_capture_stops_the_run_before_any_shard(eagleflow_dag, tmp_path: Path, random_tiny_model: Path) -> None:
    """An engine that captures the post-norm final state (TEST-ONLY fault): verify_capture fails with the
    cause, no shard runs, no hidden-state file is written, and the report is left for the run page."""
    engine = start_outside_engine(tmp_path, random_tiny_model, capture_fault="post-norm-final")
    try:
        conf = remote_conf(tmp_path, random_tiny_model, engine, "wrong-capture")
        run = eagleflow_dag.test(run_conf=conf, mark_success_pattern="build_vocab|train_drafter|plot_metrics|export_drafter")
    finally:
        stop_server(engine.pid, grace=10)
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert str(run.state) == "failed" and states["verify_capture"] == "failed", states
    assert states["extract_shard"] == "upstream_failed" and states["stop_server"] == "success", states
    run_dir = tmp_path / "runs" / "wrong-capture"
    assert not list((run_dir / "dataset" / "hidden_states").glob("hs_*")) and not list((run_dir / "shards").glob("*.json"))
    report = json.loads((run_dir / "verify" / "engine-0" / "report.json").read_text())
    assert not report["passed"] and [f["check"] for f in report["findings"]] == ["final slot is pre-norm"]
    assert report["findings"][0]["cause"].startswith("post-norm final state")


@pytest.mark.e2e
def test_online_mode_skips_every_shard_trains_from_the_engine_through_the_runs_store_and_stops_both_after_training(
    eagleflow_dag, tmp_path: Path, random_tiny_model: Path
) -> None:
    """hidden_states_source engine through dag.test(): the run launches its engine, every shard is skipped
    (visibly, by name), the engine outlives the teardown after extraction, training asks it for every
    sample, and the stop after training stops it. The samples travel through the Mooncake Store the run
    starts beside its engine (sample_transport mooncake, no connection): the capture check and the trainer
    read them there, the engine's dump folder never holds one, and the store stops with the engine. The
    drafter is a DFlash block drafter (the online feed hands it the same samples as EAGLE-3), exported for
    SGLang's DFLASH worker."""
    import threading

    from eagleflow.demo.synthetic_data import DatasetConfig, make_dataset
    from eagleflow.engine.sample_store_service import STATE_FILE
    from eagleflow.layout import RunLayout

    make_dataset(DatasetConfig(verifier=random_tiny_model, out=tmp_path / "conv.jsonl", rows=12))
    conf = {
        "model_path": str(random_tiny_model), "dataset_input": str(tmp_path / "conv.jsonl"), "output_root": str(tmp_path / "runs"),
        "run_name": "online", "shard_size": 5, "max_len": 256, "server_port": 0, "server_extra_args": ENGINE_COMPUTE_FLAGS,
        "hidden_states_source": "engine", "dump_queue_gb": 0.001, "epochs": 1, "total_seq_len": 256, "num_workers": 0,
        "device": "cpu", "draft_algorithm": "dflash", "num_layers": 1, "block_size": 4, "mask_token_id": 0, "max_anchors": 16,
        "sample_transport": "mooncake", "sample_store_conn_id": "",
        # Said explicitly: dag.test() keeps an earlier test's run_conf in the shared DAG's params.
        "server_urls": [], "server_dump_dir": None, "stop_after_extraction": False,
    }
    layout = RunLayout(tmp_path / "runs" / "online")
    held: list[str] = []
    looks, done = [0], threading.Event()

    def watch() -> None:  # the engine's dump folder, sampled throughout the run
        while not done.is_set():
            held.extend(p.name for p in layout.dump_dir.glob("*") if p.name.endswith((".safetensors", ".tmp")))
            looks[0] += 1
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run = eagleflow_dag.test(run_conf=conf, mark_success_pattern="plot_metrics|evaluate_drafter|compare_drafters")
    finally:
        done.set()
        watcher.join()
    tis = {(ti.task_id, ti.map_index): ti for ti in run.get_task_instances()}
    states = {f"{task}[{index}]": ti.state for (task, index), ti in tis.items()}
    assert str(run.state) == "success", states
    shards = {ti.rendered_map_index: ti.state for (task, _), ti in tis.items() if task == "extract_shard"}
    assert shards == {"rows_0-5": "skipped", "rows_5-10": "skipped", "rows_10-12": "skipped"}
    assert not layout.hidden_states.exists() and not list(layout.shards.glob("*.json")), "nothing was extracted"
    assert tis[("stop_server", 0)].xcom_pull(task_ids="stop_server", map_indexes=0) == "left for the stop after training"
    engine = tis[("launch_server", 0)].xcom_pull(task_ids="launch_server", map_indexes=0)
    result = json.loads(layout.train.result.read_text())
    assert result["online"]["fetched"] == 12, "training asked the engine for every row (1 epoch, no cache)"
    assert 0 < result["online"]["peak_bytes"] <= result["online"]["window_bytes"] + 256 * 4 * 64 * 2 + 64
    assert tis[("stop_server_after_training", 0)].state == "success"
    assert not pid_alive(int(engine["pid"])), "the stop after training stopped the engine"
    store = engine["sample_store"]
    assert store["namespace"] == "eagleflow/online" and store["master"].startswith("127.0.0.1:"), store
    assert json.loads(layout.capture_check_report("engine-0").read_text())["passed"], "the capture check read its samples from the store"
    assert looks[0] > 100 and held == [], f"the dump folder held {sorted(set(held))[:5]}"
    assert not (layout.server / STATE_FILE).exists(), "the run's store stopped with its last engine"
    records = [json.loads(line) for line in layout.train.metrics.read_text().splitlines()]
    assert {"eal", "full_acc", "position_3_acc"} <= set(records[-1]), "a block drafter's metrics"
    exported = json.loads((layout.drafter / "export.json").read_text())["sglang"]
    assert (exported["algorithm"], exported["block_size"]) == ("DFLASH", 4)


def test_a_missing_model_folder_fails_the_first_task_saying_so_and_nothing_starts(
    eagleflow_dag, tmp_path: Path, random_tiny_model: Path, scripts: Callable[[str], ModuleType]
) -> None:
    """The first task (plan_engines) checks every path Param: the run fails there, its message the reason in plain
    words (no retry: the same Params fail alike), and no engine is launched nor any folder written. Run as
    ``make demo`` runs it, the terminal gets one line per task, then the failed task's last log lines with the
    reason and the log file's path; Airflow's logs go to that file."""
    (tmp_path / "conv.jsonl").write_text("")
    conf = {
        "model_path": str(tmp_path / "models" / "Kimi-K2.5"), "dataset_input": str(tmp_path / "conv.jsonl"),
        "output_root": str(tmp_path / "runs"), "run_name": "missing-model",
        # Said explicitly: dag.test() keeps an earlier test's run_conf in the shared DAG's params.
        "server_urls": [], "server_dump_dir": None, "stop_after_extraction": False, "drafters": [], "sample_transport": "file",
    }
    said: list[str] = []
    with LogsToFile(tmp_path / "demo.log") as logs:
        run = scripts("demo").run_with_task_lines(eagleflow_dag, conf, logs, said.append)
    tis = {(ti.task_id, ti.map_index): ti for ti in run.get_task_instances()}
    assert str(run.state) == "failed"
    assert tis[("plan_engines", -1)].state == "failed" and tis[("plan_engines", -1)].try_number == 1
    # Nothing ran after the first task: every other task could not (upstream_failed), but the last one, which runs
    # whatever happened (all_done) and fails the run naming the refusal's sentence, which the first task kept.
    others = {key: str(ti.state) for key, ti in tis.items() if key[0] not in ("plan_engines", "compare_drafters")}
    assert set(others.values()) == {"upstream_failed"}, others
    assert ("plan_drafters", -1) in others and tis[("compare_drafters", -1)].state == "failed"
    assert refusal_of(run.run_id).startswith('Param model_path ("Verifier model folder"): ')
    assert_task_lines(said, tis)
    # then each failed task's last log lines: plan_engines with the reason, compare_drafters saying it compared nothing
    headers = [i for i, line in enumerate(said) if line.startswith("[demo] ")]
    assert [said[i] for i in headers] == [
        f"[demo] {task} failed; the last {TAIL_LINES} lines of its log (all of Airflow's logs: {tmp_path / 'demo.log'}):"
        for task in ("plan_engines", "compare_drafters")
    ], said
    tail = said[headers[0] + 1:headers[1]]
    assert 0 < len(tail) <= TAIL_LINES and all(said[i].startswith("    ") for i in range(headers[0], len(said)) if i not in headers)
    assert any('Param model_path ("Verifier model folder")' in line for line in tail), tail
    assert "[DAG TEST] starting task_id=plan_engines" in (tmp_path / "demo.log").read_text(), "Airflow's logs went to the file"
    assert not (tmp_path / "runs").exists(), "nothing was written before the check"
    from operators.step import ParamsRefused
    from operators.server import PlanEnginesOperator

    context = {"params": conf, "run_id": "manual__x"}
    with pytest.raises(ParamsRefused, match=r'^Param model_path \("Verifier model folder"\): .*Kimi-K2.5 does not exist$'):
        PlanEnginesOperator(task_id="plan_engines").execute(context)  # type: ignore[arg-type]


def refusal_of(run_id: str) -> str:
    """The first task's refusal of a run's Params, as it kept it (its XCom)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from operators.step import REFUSAL_XCOM

    with create_session() as session:
        value = session.scalar(select(XComModel.value).where(
            XComModel.run_id == run_id, XComModel.task_id == "plan_engines", XComModel.key == REFUSAL_XCOM))
    return value
