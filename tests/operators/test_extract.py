"""``ShardExtractOperator``: which engine a shard takes, which failures Airflow retries, and what a cleared,
complete shard does (says so; no engine, no step) unless the run re-extracts complete shards.

The step is a real child process: ``EAGLEFLOW_PYTHON`` points the operator at a stand-in
interpreter that prints its argv and exits with the status under test; the engines are real
HTTP endpoints.
"""

from __future__ import annotations

import argparse
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from eagleflow.engine.process import ServerInfo, free_port
from eagleflow.extract import shard
from eagleflow.extract.manifest import SUCCESS, ShardManifest
from eagleflow.extract.sample_store import write_sample
from eagleflow.extract.shard import EXIT_ENGINE_GONE
from eagleflow.layout import RunLayout
from operators.extract import PLAN_SHARDS_TASK_ID, ShardExtractOperator, VerifyCaptureOperator, nothing_to_extract
from operators.links import RUN_NAME_XCOM_KEY
from operators.server import NOT_LAUNCHED_KEY, ServerReadySensor, SGLangServerOperator
from operators.step import StepFailed, pipeline_config

# Prints the flags it was given, then exits as told by STAND_IN_EXIT (a signal when negative).
STAND_IN = r"""
import os, signal, sys
print("argv:", " ".join(sys.argv[1:]), flush=True)
code = int(os.environ["STAND_IN_EXIT"])
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class MapIndex:
    """The part of a task instance the operator reads: its map index (the shard's position)."""

    def __init__(self, map_index: int) -> None:
        self.map_index = map_index


@pytest.fixture()
def stand_in(step_interpreter: Callable[[str], Path]) -> Path:
    return step_interpreter(STAND_IN)


def shard_operator(engines: list[ServerInfo]) -> ShardExtractOperator:
    return ShardExtractOperator(
        task_id="extract_shard", shard={"name": "rows_10-20", "start": 10, "end": 20}, engines=[e.as_dict() for e in engines]
    )


def context(params: dict[str, Any], map_index: int) -> dict[str, Any]:
    return {"params": params, "run_id": "test_run", "ti": MapIndex(map_index)}


def test_the_shard_takes_a_ready_engine_and_names_it(health, params) -> None:
    health.status = 200
    down = ServerInfo(url=f"http://127.0.0.1:{free_port()}", pid=None, host="", log_path="", dump_dir="/d1", name="engine-1")
    up = ServerInfo(url=health.url, pid=None, host="", log_path="", dump_dir="/d0", name="engine-0")
    argv = shard_operator([up, down]).step_argv(context(params, map_index=1))  # engine-1's shard; it is down
    parser = argparse.ArgumentParser()
    shard.add_arguments(parser)  # the extract step's own flags read what the operator wrote
    args = vars(parser.parse_args(argv))
    assert (args["server"], args["engine_name"], str(args["dump_dir"])) == (health.url, "engine-0", "/d0")
    assert args["rows"] == "10:20" and "server_pid" not in args


def test_no_engine_ready_fails_the_try_so_that_it_is_retried(health, params) -> None:
    health.status = 503
    warming = ServerInfo(url=health.url, pid=None, host="", log_path="", dump_dir="/d", name="engine-0")
    with pytest.raises(AirflowException, match="no engine of this run is ready: engine-0 at .* 503") as raised:
        shard_operator([warming]).step_argv(context(params, map_index=0))
    assert not isinstance(raised.value, AirflowFailException)


@pytest.mark.parametrize(
    ("exit_code", "retried"),
    [(EXIT_ENGINE_GONE, True), (-signal.SIGKILL, True), (1, False), (2, False)],
    ids=["engine-gone", "killed", "rows-failed", "bad-input"],
)
def test_only_a_lost_engine_or_a_killed_step_is_retried(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch, exit_code: int, retried: bool
) -> None:
    monkeypatch.setenv("STAND_IN_EXIT", str(exit_code))
    op = shard_operator([])
    with pytest.raises((StepFailed, AirflowFailException)) as failed:
        op.run_step("extract", ["--rows", "10:20"])
    # AirflowFailException ends the task at once; anything else uses its retries.
    assert isinstance(failed.value, AirflowFailException) is not retried
    assert f"exited with code {exit_code}" in str(failed.value)
    assert "argv: -u -m eagleflow extract --rows 10:20" in str(failed.value)  # the tail of its output


def test_the_host_of_a_launched_engine_is_this_machine_when_local() -> None:
    local = ServerInfo(url="http://127.0.0.1:1", pid=1, host=socket.gethostname(), log_path="", dump_dir="")
    assert local.is_local and local.describe() == "engine-0 at http://127.0.0.1:1"



# ---- a cleared shard that is complete -----------------------------------------------------------------------------


class TaskInstance(MapIndex):
    """The rest of a task instance these operators use: XCom in (plan_shards' plan) and out (the run name)."""

    def __init__(self, map_index: int, plan: list[dict[str, Any]] | None = None) -> None:
        super().__init__(map_index)
        self.plan, self.pushed = plan, {}

    def xcom_pull(self, task_ids: str, map_indexes: int) -> Any:
        return self.plan if (task_ids, map_indexes) == (PLAN_SHARDS_TASK_ID, -1) else None

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def complete_shard_on_disk(layout: RunLayout, start: int, end: int) -> ShardManifest:
    """What a finished extraction leaves: every row's file and a ``success`` manifest counting their bytes."""
    for row in range(start, end):
        write_sample(layout.hidden_states, row, torch.ones(3 + row, 4, 8), torch.arange(3 + row))
    files = [layout.hidden_states / f"hs_{row}.safetensors" for row in range(start, end)]
    manifest = ShardManifest(f"rows_{start}-{end}", start, end, state=SUCCESS, done=end - start, tokens=77,
                             bytes=sum(f.stat().st_size for f in files), seconds=4.0)
    manifest.total_tokens, manifest.total_bytes = manifest.tokens, manifest.bytes
    manifest.write(layout.shard_manifest(manifest.name))
    return manifest


def test_a_cleared_complete_shard_says_so_and_starts_neither_the_step_nor_an_engine(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch, params, health, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STAND_IN_EXIT", "1")  # the step, were it started, would fail the task
    layout = RunLayout.of(params["output_root"], "test_run")
    manifest = complete_shard_on_disk(layout, 10, 20)
    plan = [{"name": "rows_0-10", "start": 0, "end": 10}, {"name": "rows_10-20", "start": 10, "end": 20}]
    complete_shard_on_disk(layout, 0, 10)
    ti = TaskInstance(1, plan)

    # The engine setups, cleared with the shard, pass an engine that was never started straight on.
    cfg = pipeline_config({"params": params, "run_id": "test_run"})
    reason = nothing_to_extract(cfg, {"ti": ti})
    assert reason is not None and "every shard of run test_run is complete (2 shards, rows 0:20)" in reason
    engine = SGLangServerOperator(task_id="launch_server", engine={"name": "engine-0", "index": 0, "url": None, "port": 0})
    launched = engine.execute({"params": params, "run_id": "test_run", "ti": ti})
    assert launched[NOT_LAUNCHED_KEY] == reason and launched["pid"] is None
    assert not layout.engine_state("engine-0").exists() and not layout.engine_log("engine-0").exists()  # nothing started
    ready = ServerReadySensor(task_id="wait_server_ready", server=launched).execute({"params": params, "run_id": "test_run"})
    assert ready == launched  # no wait, no deferral
    checked = VerifyCaptureOperator(task_id="verify_capture", server=launched).execute({"params": params, "run_id": "test_run"})
    assert checked == {"passed": None, NOT_LAUNCHED_KEY: reason}

    op = ShardExtractOperator(
        task_id="extract_shard", shard={"name": "rows_10-20", "start": 10, "end": 20}, engines=[launched]
    )
    capsys.readouterr()
    result = op.execute({"params": params, "run_id": "test_run", "ti": ti})
    assert result == manifest.result(layout.shard_manifest("rows_10-20"))  # the shard's XCom, as its extraction left it
    assert ti.pushed == {RUN_NAME_XCOM_KEY: "test_run"}  # the "eagleflow run" button still works
    said = capsys.readouterr().out  # the task log
    assert f"shard rows_10-20 already complete (rows 10:20, files hs_10.safetensors … hs_19.safetensors in {layout.hidden_states}" in said
    assert "nothing to extract — set Param reextract_complete_shards (\"Re-extract complete shards\") to re-extract cleared shards" in said

    # One planned shard incomplete: the engines start. The Param on: the shard is extracted again, and the step told so.
    (layout.hidden_states / "hs_3.safetensors").unlink()
    assert nothing_to_extract(cfg, {"ti": ti}) is None
    forced = {**params, "reextract_complete_shards": True}
    complete_shard_on_disk(layout, 0, 10)
    assert nothing_to_extract(pipeline_config({"params": forced, "run_id": "test_run"}), {"ti": ti}) is None
    with pytest.raises(AirflowFailException, match="not complete, but the engines were not launched"):
        op.execute({"params": forced, "run_id": "test_run", "ti": ti})
    health.status = 200
    up = ServerInfo(url=health.url, pid=None, host="", log_path="", dump_dir="/d0", name="engine-0")
    assert "--reextract-complete-shards" in shard_operator([up]).step_argv(context(forced, map_index=1))
    assert "--reextract-complete-shards" not in shard_operator([up]).step_argv(context(params, map_index=1))
