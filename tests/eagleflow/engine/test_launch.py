"""An engine's life without Airflow: ``launch_engine`` / ``stop_engine`` and ``python -m eagleflow launch|stop``.

A real reference engine on the tiny model each time: launched, reused while it runs (same pid, one
start in its log), stopped by pid and port, and launched afresh after the stop. Every process group a
test starts is killed by the ``process_groups`` fixture, whatever the test's outcome.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eagleflow.engine import ServerInfo
from eagleflow.files import pid_alive
from eagleflow.run import EngineElsewhere, launch_engine, stop_engine
from eagleflow.layout import RunLayout
from eagleflow.run.pipeline import PipelineConfig
from eagleflow.results import find_result

REPO = Path(__file__).resolve().parents[3]
RUN_ID = "launch-test"


def port_of(info: ServerInfo) -> int:
    return int(info.url.rsplit(":", 1)[1])


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_launch_reuses_the_running_engine_and_stop_ends_it_by_pid_and_port(params: dict[str, Any], process_groups: list[int]) -> None:
    cfg = PipelineConfig.from_params(params, RUN_ID).check_model()
    said: list[str] = []
    first = launch_engine(cfg, "engine-0", say=said.append)
    process_groups.append(int(first.pid))  # type: ignore[arg-type]
    layout = RunLayout.of(params["output_root"], RUN_ID)
    assert first.log_path == str(layout.engine_log("engine-0")) and layout.engine_state("engine-0").exists()
    again = launch_engine(cfg, "engine-0", say=said.append)
    assert again == first  # the warming-up engine is reused: same pid, same port
    assert Path(first.log_path).read_text().count("starting: ") == 1
    assert any(line.startswith("Reusing engine-0") for line in said)

    # A short grace: the engine may still be importing torch, which it finishes before obeying SIGTERM.
    message = stop_engine(cfg, "engine-0", grace=1.0)
    assert "engine process group" in message
    assert not pid_alive(int(first.pid)) and port_free(port_of(first))  # type: ignore[arg-type]
    assert not layout.engine_state("engine-0").exists()
    assert stop_engine(cfg, "engine-0") == "nothing to stop"

    fresh = launch_engine(cfg, "engine-0", say=said.append)
    process_groups.append(int(fresh.pid))  # type: ignore[arg-type]
    assert fresh.pid != first.pid and pid_alive(int(fresh.pid))  # type: ignore[arg-type]
    assert Path(fresh.log_path).read_text().count("starting: ") == 2  # the same log, appended
    stop_engine(cfg, "engine-0", grace=1.0)
    assert not pid_alive(int(fresh.pid))  # type: ignore[arg-type]


def test_an_engine_recorded_by_another_machine_is_not_stopped_here(params: dict[str, Any]) -> None:
    cfg = PipelineConfig.from_params(params, RUN_ID)
    state = cfg.layout.engine_state("engine-0")
    state.parent.mkdir(parents=True)
    elsewhere = ServerInfo(url="http://gpu-node:30000", pid=1, host="gpu-node", log_path="", dump_dir="")
    state.write_text(json.dumps(elsewhere.as_dict()))
    with pytest.raises(EngineElsewhere, match="runs on gpu-node, not here") as caught:
        stop_engine(cfg, "engine-0")
    assert caught.value.host == "gpu-node" and state.exists()  # its record is kept for the machine that can stop it


def test_remote_engines_are_neither_started_nor_stopped(params: dict[str, Any], tmp_path: Path) -> None:
    cfg = PipelineConfig.from_params(
        {**params, "server_urls": ["http://10.0.0.5:30000"], "server_dump_dir": str(tmp_path / "dumps")}, RUN_ID
    )
    info = launch_engine(cfg, "engine-0", say=lambda _: None)
    assert (info.url, info.pid, info.dump_dir) == ("http://10.0.0.5:30000", None, str(tmp_path / "dumps"))
    assert stop_engine(cfg, "engine-0") == "remote engine left running"
    with pytest.raises(Exception, match="no engine 'engine-3'"):
        launch_engine(cfg, "engine-3")


def test_the_launch_and_stop_commands_start_reuse_and_stop_an_engine(
    params: dict[str, Any], tmp_path: Path, process_groups: list[int]
) -> None:
    params_file = tmp_path / "run.json"
    params_file.write_text(json.dumps(params))

    def command(step: str) -> dict[str, Any]:
        argv = [sys.executable, "-m", "eagleflow", step, "--params", str(params_file), "--run-id", RUN_ID, "--grace-seconds", "1"]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        result = find_result(done.stdout.splitlines())
        assert result is not None, done.stdout
        return result

    launched = command("launch")
    process_groups.append(int(launched["pid"]))
    assert launched["name"] == "engine-0" and pid_alive(launched["pid"])
    assert command("launch") == launched  # reused
    assert "engine process group" in command("stop")["stopped"]
    assert not pid_alive(launched["pid"]) and port_free(int(launched["url"].rsplit(":", 1)[1]))

    params_file.write_text("[not a mapping]")
    done = subprocess.run(
        [sys.executable, "-m", "eagleflow", "stop", "--params", str(params_file)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 2 and "expected a mapping of Param names" in done.stderr
