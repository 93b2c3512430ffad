"""``ShardExtractOperator``: which engine a shard takes, and which failures Airflow retries.

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
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from eagleflow.engine.process import ServerInfo, free_port
from eagleflow.extract import shard
from eagleflow.extract.shard import EXIT_ENGINE_GONE
from operators.extract import ShardExtractOperator
from operators.step import StepFailed

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

