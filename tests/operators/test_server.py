"""Engine lifecycle operators, driven directly: launch (setup), readiness sensor + trigger, stop
(teardown), and the step operator's child-process handling.

Real processes and real HTTP throughout: the reference engine on the tiny model for the
end-to-end checks (issue 3's Done-when), a settable HTTP health endpoint and small Python
"engines" for the trigger/sensor/teardown edge cases. Every process group a test starts is
killed by the ``process_groups`` fixture, whatever the test's outcome.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import structlog
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowRescheduleException,
    AirflowSensorTimeout,
    AirflowSkipException,
    TaskDeferred,
)

from eagleflow.errors import UserError
from eagleflow.layout import RunLayout
from eagleflow.engine.process import ServerInfo, free_port, group_members, pid_alive, start_server
from operators.server import (
    PlanEnginesOperator,
    ServerReadySensor,
    ServerReadyTrigger,
    SGLangServerOperator,
    StopServerOperator,
)
from operators.step import EagleflowStepOperator, StepFailed

RUN_ID = "test_run"
HOST = socket.gethostname()

# A stand-in engine: starts a `sleep` in its group, prints, records its pid, then waits.
# "ignore-term": the whole group ignores SIGTERM (SIG_IGN survives the sleep's exec).
# "child-ignores-term": only the sleep ignores it (a worker that outlives its leader).
ENGINE_SCRIPT = r"""
import os, signal, subprocess, sys, time
mode, pid_file = sys.argv[-2], sys.argv[-1]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ignore = (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if mode == "child-ignores-term" else None
child = subprocess.Popen(["sleep", "300"], preexec_fn=ignore)
# print before the pid file appears: the test kills as soon as it sees the file
print("stand-in engine up, child", child.pid, flush=True)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(child.pid))
os.replace(pid_file + ".tmp", pid_file)
while True:
    time.sleep(1)
"""


def make_context(params: dict[str, Any]) -> dict[str, Any]:
    """The part of an Airflow task context the engine operators read."""
    return {"params": params, "run_id": RUN_ID, "ti": None}




def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def first_event(trigger: ServerReadyTrigger, timeout: float = 30.0) -> dict[str, Any]:
    """Run the trigger as the triggerer would, until its first event."""

    async def go() -> Any:
        return await asyncio.wait_for(trigger.run().asend(None), timeout)

    return asyncio.run(go()).payload


def exited_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def server_dict(url: str, pid: int | None, log_path: str = "", host: str = HOST) -> dict[str, Any]:
    return {"url": url, "pid": pid, "host": host, "log_path": log_path, "dump_dir": "/unused"}


def answers(url: str, path: str) -> int | None:
    """HTTP status of ``GET url+path``, None while nothing listens."""
    try:
        return requests.get(url + path, timeout=5).status_code
    except requests.ConnectionError:
        return None


ENGINE_0 = {"name": "engine-0", "index": 0, "url": None, "port": 0}


def plan(params: dict[str, Any]) -> list[dict[str, Any]]:
    return PlanEnginesOperator(task_id="plan_engines").execute(make_context(params))


def launch(params: dict[str, Any], process_groups: list[int], engine: dict[str, Any] = ENGINE_0) -> dict[str, Any]:
    """``SGLangServerOperator.execute`` for one engine, registered for cleanup."""
    info = SGLangServerOperator(task_id="launch_server", engine=engine).execute(make_context(params))
    if info.get("pid"):
        process_groups.append(int(info["pid"]))
    return info


# ---- ServerReadyTrigger ------------------------------------------------------------------------


def test_trigger_serialize_is_exactly_its_init_arguments() -> None:
    server = server_dict("http://127.0.0.1:30000", 1234, "/run/server/server.log")
    trigger = ServerReadyTrigger(server=server, deadline=1_800_000_000.5, poll_interval=0.5, log_offset=42, report_every=7.0)
    classpath, kwargs = trigger.serialize()
    assert (classpath, kwargs) == (
        "operators.server.ServerReadyTrigger",
        {"server": server, "deadline": 1_800_000_000.5, "poll_interval": 0.5, "log_offset": 42, "report_every": 7.0},
    )
    # The triggerer rebuilds it from the classpath and kwargs, possibly on another machine.
    module, name = classpath.rsplit(".", 1)
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)


def test_trigger_fires_ready_when_health_generate_answers_200(health) -> None:
    health.status = 200
    deadline = time.time() + 60
    trigger = ServerReadyTrigger(server_dict(health.url, os.getpid()), deadline, poll_interval=0.1, log_offset=5)
    assert first_event(trigger) == {
        "status": "ready",
        "message": "/health_generate answered 200",
        "log_offset": 5,
        "deadline": deadline,
    }


def test_trigger_waits_through_503_until_ready(health) -> None:
    health.status = 503
    threading.Timer(0.6, lambda: setattr(health, "status", 200)).start()
    trigger = ServerReadyTrigger(server_dict(health.url, os.getpid()), time.time() + 60, poll_interval=0.1)
    assert first_event(trigger)["status"] == "ready"
    assert len(health.requests) >= 3


def test_trigger_fires_dead_at_once_when_the_local_pid_is_gone(health) -> None:
    health.status = 503
    pid = exited_pid()
    trigger = ServerReadyTrigger(server_dict(health.url, pid), time.time() + 3600, poll_interval=30)
    started = time.monotonic()
    event = first_event(trigger)
    assert time.monotonic() - started < 2
    assert event["status"] == "dead"
    assert f"engine process {pid} has exited" in event["message"]


def test_trigger_fires_timeout_when_the_deadline_has_passed(health) -> None:
    health.status = 503
    deadline = time.time() - 1
    event = first_event(ServerReadyTrigger(server_dict(health.url, os.getpid()), deadline, poll_interval=30))
    assert event == {"status": "timeout", "message": "/health_generate answered 503", "log_offset": 0, "deadline": deadline}


def test_trigger_reports_running_after_report_every(health) -> None:
    health.status = 503
    trigger = ServerReadyTrigger(
        server_dict(health.url, os.getpid()), time.time() + 60, poll_interval=0.1, log_offset=17, report_every=0.5
    )
    started = time.monotonic()
    event = first_event(trigger)
    assert 0.5 <= time.monotonic() - started < 5
    assert event["status"] == "running" and event["log_offset"] == 17
    assert "503" in event["message"]


def test_trigger_treats_connection_refused_as_not_ready_yet() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trigger = ServerReadyTrigger(server_dict(url, os.getpid()), time.time() + 60, poll_interval=0.1, report_every=0.4)
    event = first_event(trigger)
    assert event["status"] == "running"
    assert "not accepting connections yet" in event["message"]
    timed_out = first_event(ServerReadyTrigger(server_dict(url, os.getpid()), time.time() + 0.3, poll_interval=0.1))
    assert timed_out["status"] == "timeout"


# ---- ServerReadySensor -------------------------------------------------------------------------


def write_log(path: Path, lines: int, first: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.writelines(f"server line {i}\n" for i in range(first, first + lines))


def test_sensor_defers_with_an_absolute_deadline_when_not_ready(health, params) -> None:
    health.status = 503
    params["warmup_timeout"] = 120
    server = server_dict(health.url, os.getpid())
    sensor = ServerReadySensor(task_id="wait_server_ready", server=server, poll_interval=0.25)
    before = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(make_context(params))
    trigger = deferred.value.trigger
    assert isinstance(trigger, ServerReadyTrigger)
    assert before + 120 <= trigger.deadline <= time.time() + 120
    assert (trigger.server, trigger.poll_interval, trigger.log_offset) == (server, 0.25, 0)
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout >= timedelta(seconds=119)


def test_a_retried_wait_counts_its_warmup_from_the_engines_start(health, params, tmp_path: Path) -> None:
    """wait_server_ready's retry (after Airflow failed a deferred wait that was fine) waits only what is left."""
    health.status = 503
    params["warmup_timeout"] = 120
    log = tmp_path / "server.log"
    started = time.time() - 100
    log.write_text(f"old engine\n===== {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))} starting: serve\nloading\n")
    sensor = ServerReadySensor(task_id="wait_server_ready", server=server_dict(health.url, os.getpid(), str(log)))
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(make_context(params))
    assert abs(deferred.value.trigger.deadline - (started + 120)) <= 1.5  # about 20 s left, not a fresh 120


def test_sensor_returns_at_once_when_ready_and_fails_at_once_when_dead(health, params, tmp_path: Path) -> None:
    health.status = 200
    server = server_dict(health.url, os.getpid())
    assert ServerReadySensor(task_id="w", server=server).execute(make_context(params)) == server
    log = tmp_path / "server.log"
    write_log(log, 3)
    dead = server_dict(health.url, exited_pid(), str(log))
    with pytest.raises(AirflowException, match="the engine process died") as failed:
        ServerReadySensor(task_id="w", server=dead).execute(make_context(params))
    assert "server line 2" in str(failed.value)


def test_an_explicit_sensor_timeout_wins_over_the_param(health, params) -> None:
    health.status = 503
    params["warmup_timeout"] = 120
    sensor = ServerReadySensor(task_id="w", server=server_dict(health.url, os.getpid()), timeout=30)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(make_context(params))
    assert deferred.value.trigger.deadline <= time.time() + 30


def test_not_deferrable_it_pokes_in_place_times_out_and_soft_fails_like_any_sensor(health, params) -> None:
    """BaseSensorOperator's contract: poke mode, timeout, soft_fail, the XCom of PokeReturnValue."""
    health.status = 503
    server = server_dict(health.url, os.getpid())
    plain = {"task_id": "w", "server": server, "deferrable": False, "poll_interval": 0.1, "timeout": 0.6}
    asked = len(health.requests)
    with pytest.raises(AirflowSensorTimeout):
        ServerReadySensor(**plain).execute(make_context(params))
    assert len(health.requests) - asked >= 3  # several pokes in this process, no deferral
    with pytest.raises(AirflowSkipException):
        ServerReadySensor(**plain, soft_fail=True).execute(make_context(params))
    threading.Timer(0.3, lambda: setattr(health, "status", 200)).start()
    assert ServerReadySensor(**{**plain, "timeout": 30}).execute(make_context(params)) == server


def test_reschedule_mode_gives_the_worker_back_between_pokes(health, params) -> None:
    class FirstTry:  # the task instance's one question in reschedule mode
        def get_first_reschedule_date(self, context: Any) -> None:
            return None

    health.status = 503
    sensor = ServerReadySensor(task_id="w", server=server_dict(health.url, os.getpid()), deferrable=False, mode="reschedule")
    with pytest.raises(AirflowRescheduleException):
        sensor.execute({**make_context(params), "ti": FirstTry()})


def test_a_trigger_timeout_is_a_sensor_timeout_that_soft_fail_turns_into_a_skip(tmp_path: Path) -> None:
    server = server_dict("http://127.0.0.1:1", None, host="")
    event = {"status": "timeout", "message": "m", "log_offset": 0, "deadline": 0}
    with pytest.raises(AirflowSensorTimeout, match="the engine was not ready in time"):
        ServerReadySensor(task_id="w", server=server).resume_execution("execute_complete", {"event": event}, context={})
    with pytest.raises(AirflowSkipException):
        ServerReadySensor(task_id="w", server=server, soft_fail=True).resume_execution(
            "execute_complete", {"event": event}, context={}
        )


def test_sensor_without_launch_info_says_so(params) -> None:
    with pytest.raises(AirflowException, match="no engine info from launch_server"):
        ServerReadySensor(task_id="w", server=None).execute(make_context(params))


def test_execute_complete_ready_returns_the_server(tmp_path: Path) -> None:
    server = server_dict("http://127.0.0.1:1", 1, str(tmp_path / "server.log"))
    sensor = ServerReadySensor(task_id="w", server=server)
    event = {"status": "ready", "message": "/health_generate answered 200", "log_offset": 0, "deadline": time.time() + 60}
    assert sensor.execute_complete(context={}, event=event) == server


def test_execute_complete_running_shows_new_log_lines_and_defers_again(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    write_log(log, 3)
    server = server_dict("http://127.0.0.1:1", 1, str(log))
    sensor = ServerReadySensor(task_id="w", server=server, poll_interval=0.5)
    deadline = time.time() + 600
    with structlog.testing.capture_logs() as logs, pytest.raises(TaskDeferred) as deferred:
        sensor.execute_complete(context={}, event={"status": "running", "message": "m", "log_offset": 0, "deadline": deadline})
    shown = [entry["event"] for entry in logs if entry["event"].startswith("[server]")]
    assert shown == ["[server] server line 0", "[server] server line 1", "[server] server line 2"]
    again = deferred.value.trigger
    assert isinstance(again, ServerReadyTrigger)
    assert again.deadline == deadline  # the wait's deadline does not move
    assert again.log_offset == log.stat().st_size
    # The next report shows only what the server wrote since.
    write_log(log, 2, first=3)
    with structlog.testing.capture_logs() as logs, pytest.raises(TaskDeferred):
        sensor.execute_complete(
            context={}, event={"status": "running", "message": "m", "log_offset": again.log_offset, "deadline": deadline}
        )
    shown = [entry["event"] for entry in logs if entry["event"].startswith("[server]")]
    assert shown == ["[server] server line 3", "[server] server line 4"]


@pytest.mark.parametrize(("status", "reason"), [("dead", "the engine process died"), ("timeout", "the engine was not ready in time")])
def test_execute_complete_dead_or_timeout_fails_with_the_log_tail(tmp_path: Path, status: str, reason: str) -> None:
    log = tmp_path / "server.log"
    write_log(log, 120)
    sensor = ServerReadySensor(task_id="w", server=server_dict("http://127.0.0.1:1", 1, str(log)))
    event = {"status": status, "message": "engine process 1 has exited", "log_offset": 0, "deadline": time.time()}
    with pytest.raises(AirflowException) as failed:
        sensor.execute_complete(context={}, event=event)
    message = str(failed.value)
    assert message.startswith(f"{reason}: engine process 1 has exited")
    assert f"--- last lines of {log} ---" in message
    assert "server line 119" in message and "server line 70" in message  # the last 50 lines
    assert "server line 69\n" not in message


def test_a_dead_engine_is_reported_by_its_own_last_error_line_first(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "===== 2026-01-01 00:00:00 starting: old engine\nValueError: an earlier start's error\n"
        "===== 2026-01-01 00:01:00 starting: python -m eagleflow serve-reference …\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "safetensors_rust.SafetensorError: Error while deserializing header: /m/model.safetensors is truncated\n"
        "reference engine stopped (server stopped); dumps flushed\n"
    )
    sensor = ServerReadySensor(task_id="w", server=server_dict("http://127.0.0.1:1", 1, str(log)))
    event = {"status": "dead", "message": "engine process 1 has exited", "log_offset": 0, "deadline": time.time()}
    with pytest.raises(AirflowException) as failed:
        sensor.execute_complete(context={}, event=event)
    first = str(failed.value).splitlines()[0]
    assert first == (
        "the engine process died: engine process 1 has exited; its last error: safetensors_rust.SafetensorError: "
        "Error while deserializing header: /m/model.safetensors is truncated"
    )


def test_execute_complete_timeout_of_a_remote_server_says_there_is_no_local_log() -> None:
    sensor = ServerReadySensor(task_id="w", server=server_dict("http://gpu-node:30000", None, host=""))
    with pytest.raises(AirflowException, match=r"(?s)not ready in time.*remote server: no local log"):
        sensor.execute_complete(context={}, event={"status": "timeout", "message": "m", "log_offset": 0, "deadline": 0})


# ---- launch and stop ---------------------------------------------------------------------------


def test_remote_mode_launches_nothing_and_stops_nothing(params, tmp_path: Path) -> None:
    dumps = tmp_path / "shared-dumps"  # the remote hooks' folder, as the workers see it
    dumps.mkdir()
    params.update(server_urls=["http://gpu-node-1:30000", "http://gpu-node-2:30000/"], server_dump_dir=str(dumps))
    engines = plan(params)
    assert engines == [
        {"name": "engine-0", "index": 0, "url": "http://gpu-node-1:30000", "port": None},
        {"name": "engine-1", "index": 1, "url": "http://gpu-node-2:30000", "port": None},
    ]
    infos = [SGLangServerOperator(task_id="launch_server", engine=e).execute(make_context(params)) for e in engines]
    assert infos[1] == {
        "url": "http://gpu-node-2:30000", "pid": None, "host": "", "log_path": "", "dump_dir": str(dumps), "name": "engine-1",
        "sample_store": None,
    }
    assert not (tmp_path / "out").exists()  # no server folder, log or state: nothing started
    for engine in engines:
        stopped = StopServerOperator(task_id="stop_server", engine=engine).execute(make_context(params))
        assert stopped == "remote engine left running"


def test_remote_engines_hand_samples_through_the_store_an_airflow_connection_names(
    params, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sample_transport mooncake with remote engines: no dump folder needed, the store is the connection's (its
    master's RPC and admin addresses, metadata server, namespace), and it reaches every step that reads samples."""
    from airflow.sdk.exceptions import AirflowFailException

    from eagleflow.engine import ServerInfo
    from eagleflow.run.pipeline import PipelineConfig

    params.update(server_urls=["http://gpu-node-1:30000"], server_dump_dir=None, sample_transport="mooncake")
    with pytest.raises(Exception, match="sample_transport mooncake with server_urls needs sample_store_conn_id"):
        plan(params)
    params["sample_store_conn_id"] = "mooncake_store"
    engine = plan(params)[0]
    with pytest.raises(AirflowFailException, match="Param sample_store_conn_id: no Airflow connection 'mooncake_store'"):
        SGLangServerOperator(task_id="launch_server", engine=engine).execute(make_context(params))
    # An extra Airflow's extra_dejson would read as {} (every default) or hand over as a list: refused, named.
    for extra, said in (('{"admin_port": 9003,', "its extra is not JSON (Expecting property name"),
                        ('[{"admin_port": 9003}]', "its extra is a JSON list, not an object such as")):
        monkeypatch.setenv("AIRFLOW_CONN_MOONCAKE_STORE", json.dumps({"conn_type": "generic", "host": "m", "port": 50051, "extra": extra}))
        with pytest.raises(AirflowFailException, match=re.escape(f"Param sample_store_conn_id: Airflow connection 'mooncake_store': {said}")):
            SGLangServerOperator(task_id="launch_server", engine=engine).execute(make_context(params))
    monkeypatch.setenv("AIRFLOW_CONN_MOONCAKE_STORE", json.dumps({
        "conn_type": "generic", "host": "mooncake-master", "port": 50051,
        "extra": {"admin_port": 9003, "metadata_server": "http://mooncake-metadata:8080/metadata", "namespace": "eagleflow"},
    }))
    info = SGLangServerOperator(task_id="launch_server", engine=engine).execute(make_context(params))
    assert info["sample_store"] == {
        "master": "mooncake-master:50051", "admin": "mooncake-master:9003",
        "metadata_server": "http://mooncake-metadata:8080/metadata", "namespace": "eagleflow", "protocol": "tcp",
    }
    server = ServerInfo.from_dict(info)
    cfg = PipelineConfig.from_params(params, "manual__x")
    assert json.loads(cfg.verify_capture_config(server).sample_store) == info["sample_store"]
    assert json.loads(cfg.extract_config(server, {"name": "rows_0-5", "start": 0, "end": 5}).sample_store) == info["sample_store"]
    assert json.loads(cfg.train_config([server]).sample_store) == info["sample_store"]
    assert not (tmp_path / "out").exists(), "nothing started here: the store is the connection's"


def test_the_engine_plan_gives_each_launched_engine_its_port(params) -> None:
    params.update(num_engines=3, server_port=31000)
    assert [(e["name"], e["port"], e["url"]) for e in plan(params)] == [
        ("engine-0", 31000, None), ("engine-1", 31001, None), ("engine-2", 31002, None),
    ]
    params["server_port"] = 0
    assert {e["port"] for e in plan(params)} == {0}  # each picks a free port when it starts


def test_a_bad_param_fails_the_launch_naming_it(params) -> None:
    del params["model_path"]
    with pytest.raises(UserError, match="Param model_path"):
        SGLangServerOperator(task_id="launch_server", engine=ENGINE_0).execute(make_context(params))


def test_launch_reuses_the_running_engine_and_starts_a_new_one_after_stop(params, process_groups: list[int]) -> None:
    first = launch(params, process_groups)
    log = Path(first["log_path"])
    assert log == RunLayout.of(params["output_root"], RUN_ID).engine_log("engine-0")
    assert first["host"] == HOST and first["url"].startswith("http://127.0.0.1:")
    again = launch(params, process_groups)
    assert again == first  # same pid: the warming-up engine is reused
    assert log.read_text().count("starting: ") == 1  # and no second process was started
    assert group_members(first["pid"]) == [first["pid"]]
    # A short grace: the engine is still importing torch and finishes that before obeying SIGTERM.
    StopServerOperator(task_id="stop_server", engine=ENGINE_0, grace_seconds=1).execute(make_context(params))
    assert not pid_alive(first["pid"])
    assert not RunLayout.of(params["output_root"], RUN_ID).engine_state("engine-0").exists()
    fresh = launch(params, process_groups)
    assert fresh["pid"] != first["pid"] and pid_alive(fresh["pid"])
    assert log.read_text().count("starting: ") == 2  # the same log, appended
    StopServerOperator(task_id="stop_server", engine=ENGINE_0, grace_seconds=1).execute(make_context(params))
    assert not pid_alive(fresh["pid"])


def test_setup_readiness_generate_teardown_with_the_reference_engine(params, process_groups: list[int]) -> None:
    """Issue 3 Done-when: setup -> readiness through a >= 10 s warmup -> /generate -> teardown, no process left."""
    from eagleflow.extract.sample_store import load_sample
    from eagleflow.extract.dump_wait import wait_for_dump
    from eagleflow.extract.handoff_reader import FolderHandOff

    params["server_extra_args"] = ["--threads", "1", "--warmup-seconds", "10"]
    context = make_context(params)
    launched_at = time.monotonic()
    server = launch(params, process_groups)
    pid = server["pid"]

    # A watcher records what the health endpoint answers once the engine listens (warming up).
    health_seen: set[int | None] = set()
    waiting = threading.Event()

    def watch() -> None:
        while not waiting.wait(0.5):
            if answers(server["url"], "/model_info") == 200:
                health_seen.add(answers(server["url"], "/health_generate"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    sensor = ServerReadySensor(task_id="wait_server_ready", server=server, poll_interval=0.5)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context)
    result = None
    with structlog.testing.capture_logs() as logs:
        for _ in range(20):  # each round: the trigger until its event, then the task's resume
            event = first_event(deferred.value.trigger, timeout=90)
            try:
                result = sensor.execute_complete(context={}, event=event)
                break
            except TaskDeferred as resumed:
                deferred = resumed
    ready_after = time.monotonic() - launched_at
    waiting.set()
    watcher.join()
    assert result == server, event
    assert 503 in health_seen, f"/health_generate answered {health_seen} while the engine listened"
    assert ready_after >= 10, f"ready after {ready_after:.1f}s, inside the 10 s warmup"
    log_text = Path(server["log_path"]).read_text()
    assert "warmup 10s" in log_text and "The server is fired up and ready to roll!" in log_text
    shown = [entry["event"] for entry in logs if entry["event"].startswith("[server]")]
    assert any("listening on http://127.0.0.1:" in line for line in shown)  # the server log reached the task log

    response = requests.post(
        server["url"] + "/generate",
        json={"rid": "roundtrip-1", "input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    assert (meta["id"], meta["prompt_tokens"], meta["cached_tokens"]) == ("roundtrip-1", 5, 0)
    sample = load_sample(wait_for_dump(FolderHandOff(Path(server["dump_dir"])), "roundtrip-1", time.time(), 30.0, threading.Event(), print))
    assert sample["token_ids"].tolist() == [5, 6, 7, 8, 9]
    assert tuple(sample["hidden_states"].shape) == (5, 4, 64)  # aux [2, 4, 5] + final, hidden 64

    message = StopServerOperator(task_id="stop_server", engine=ENGINE_0).execute(context)
    assert "stopped with SIGTERM" in message
    assert not pid_alive(pid)
    assert group_members(pid) == []
    assert "reference engine stopped (signal SIGTERM); dumps flushed" in Path(server["log_path"]).read_text()
    assert not RunLayout.of(params["output_root"], RUN_ID).engine_state("engine-0").exists()


def test_killing_the_engine_during_warmup_fails_the_sensor_within_seconds(params, process_groups: list[int]) -> None:
    """Issue 3 Done-when: a killed engine fails the readiness wait within seconds, the log tail in the task log."""
    params["server_extra_args"] = ["--threads", "1", "--warmup-seconds", "600"]
    context = make_context(params)
    server = launch(params, process_groups)
    wait_for(lambda: answers(server["url"], "/model_info") == 200, 60, "the engine to listen")
    assert answers(server["url"], "/health_generate") == 503  # warming up

    sensor = ServerReadySensor(task_id="wait_server_ready", server=server, poll_interval=1.0)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context)
    os.kill(server["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    event = first_event(deferred.value.trigger, timeout=30)
    assert event["status"] == "dead"
    with structlog.testing.capture_logs() as logs, pytest.raises(AirflowException) as failed:
        sensor.execute_complete(context={}, event=event)
    assert time.monotonic() - killed_at < 5
    message = str(failed.value)
    assert message.startswith(f"the engine process died: engine process {server['pid']} has exited")
    assert "listening on http://127.0.0.1:" in message and "warmup 600s" in message  # the log tail
    assert any(entry["event"].startswith("[server] ") for entry in logs)
    # The teardown still runs and finds nothing left to stop.
    message = StopServerOperator(task_id="stop_server", engine=ENGINE_0).execute(context)
    assert "had already exited" in message
    assert group_members(server["pid"]) == []


def test_stop_kills_an_engine_that_ignores_sigterm_with_its_children(params, tmp_path: Path, process_groups: list[int]) -> None:
    layout = RunLayout.of(params["output_root"], RUN_ID)
    child_file = tmp_path / "child.pid"
    info = start_server(
        [sys.executable, "-c", ENGINE_SCRIPT, "ignore-term", str(child_file)],
        {},
        layout.engine_log("engine-0"),
        layout.engine_state("engine-0"),
        "http://127.0.0.1:9",
        layout.dump_dir,
    )
    process_groups.append(int(info.pid))
    wait_for(child_file.exists, 20, "the stand-in engine's child")
    child = int(child_file.read_text())
    started = time.monotonic()
    # The teardown finds the engine through the run's state file, whatever launch pushed.
    message = StopServerOperator(task_id="stop_server", engine=ENGINE_0, grace_seconds=1).execute(make_context(params))
    assert "did not stop within 1s; killed it" in message
    assert 1 <= time.monotonic() - started < 10
    assert not pid_alive(int(info.pid)) and not pid_alive(child)
    assert group_members(int(info.pid)) == []
    assert not layout.engine_state("engine-0").exists()


def test_stop_with_nothing_started_or_an_engine_elsewhere(params) -> None:
    context = make_context(params)
    assert StopServerOperator(task_id="stop_server", engine=ENGINE_0).execute(context) == "nothing to stop"
    elsewhere = ServerInfo(url="http://127.0.0.1:30000", pid=4242, host="gpu-node", log_path="", dump_dir="")
    state = RunLayout.of(params["output_root"], RUN_ID).engine_state("engine-0")
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps(elsewhere.as_dict()))
    with pytest.raises(AirflowException, match="runs on gpu-node, not here"):
        StopServerOperator(task_id="stop_server", engine=ENGINE_0).execute(context)


# ---- EagleflowStepOperator ---------------------------------------------------------------------


def test_step_result_line_is_returned_as_a_dict(tmp_path: Path) -> None:
    op = EagleflowStepOperator(task_id="check_disk", step="check-disk", arguments=["--folder", str(tmp_path / "hs"), "--needed-bytes", "0"])
    result = op.execute(make_context({}))
    assert result["folder"] == str(tmp_path / "hs")
    assert result["required_bytes"] == 0 and result["free_bytes"] > 0


def test_a_failing_step_raises_step_failed_with_its_tail(tmp_path: Path) -> None:
    op = EagleflowStepOperator(
        task_id="check_disk", step="check-disk", arguments=["--folder", str(tmp_path / "hs"), "--needed-bytes", str(10**18)]
    )
    with pytest.raises(StepFailed) as failed:
        op.execute(make_context({}))
    assert failed.value.returncode == 2
    assert "error: not enough disk for the hidden states" in failed.value.tail
    assert "free" in failed.value.tail  # the table printed before the error is in the tail too
    assert "exited with code 2" in str(failed.value)


@pytest.fixture()
def stand_in_python(step_interpreter: Callable[[str], Path]) -> Path:
    """An executable that ``EAGLEFLOW_PYTHON`` points the steps at: the stand-in engine script."""
    return step_interpreter(ENGINE_SCRIPT)


def run_in_thread(op: EagleflowStepOperator) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = op.execute(make_context({}))
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("mode", ["obey-term", "ignore-term", "child-ignores-term"])
def test_on_kill_stops_the_steps_whole_process_group(
    mode: str, stand_in_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, process_groups: list[int]
) -> None:
    monkeypatch.setattr("operators.step.KILL_GRACE_SECONDS", 1)
    child_file = tmp_path / f"child-{mode}.pid"
    op = EagleflowStepOperator(task_id="step", step="extract", arguments=[mode, str(child_file)])
    thread, outcome = run_in_thread(op)
    wait_for(child_file.exists, 20, "the step's child process")
    leader, child = op._process.pid, int(child_file.read_text())  # type: ignore[union-attr]
    process_groups.append(leader)
    started = time.monotonic()
    op.on_kill()
    thread.join(timeout=15)
    assert not thread.is_alive(), "the operator still waits on the step's output"
    assert time.monotonic() - started < 10
    # Signals land asynchronously: the child may need a moment on a loaded machine.
    wait_for(lambda: not pid_alive(leader) and not pid_alive(child), 5, "the step and its child to die")
    assert group_members(leader) == []
    assert isinstance(outcome.get("error"), StepFailed)
    assert "stand-in engine up" in outcome["error"].tail
