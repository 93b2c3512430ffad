"""evaluate under faults: its engine never outlives it, a broken drafter is named, bad Params are refused.

The step runs as the operator runs it (``python -m eagleflow evaluate`` in a session of its own)
on the untrained tiny verifier and a random drafter, so no training is needed. Each stop is
real: SIGTERM to the step's process group (what ``on_kill`` sends), SIGINT, SIGKILL to the step
alone, SIGKILL to the process that started it. Afterwards no engine pid is alive and no engine
port accepts a connection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from eagleflow.data.prepare import write_training_dataset
from eagleflow.engine.process import group_alive, pid_alive
from eagleflow.export.step import ExportConfig, export

from reference_engines import ENGINE_COMPUTE_FLAGS
from training_data import random_speculators_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def setup(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A drafter for the untrained tiny verifier and a dataset whose last 4 rows are held out."""
    folder = tmp_path_factory.mktemp("evaluate-faults")
    checkpoint = random_speculators_checkpoint(random_tiny_model, folder / "checkpoint", False, [2, 4, 5], 256, num_layers=1)
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=folder / "drafter"))
    ids = [[(7 * r + i) % 900 + 20 for i in range(24)] for r in range(8)]
    write_training_dataset(ids, [[0] * 12 + [1] * 12] * 8, folder / "dataset")
    return {"model": random_tiny_model, "drafter": folder / "drafter", "checkpoint": checkpoint, "dataset": folder / "dataset"}


def evaluate_argv(setup: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "eagleflow", "evaluate", "--dataset", str(setup["dataset"]), "--verifier", str(setup["model"]),
        "--drafter", str(setup["drafter"]), "--out", str(out), "--train-data-ratio", "0.5", "--eval-rows", "4",
        "--eval-concurrency", "2", "--eval-sets=heldout", "--eval-rounds", "1", "--eval-server-extra-args=" + ",".join(ENGINE_COMPUTE_FLAGS), *extra,
    ]


def drafter_engine_folder(out: Path) -> Path:
    """The engine serving the drafter's chain (named by its shape, steps-topk-draft tokens; the other is engine-baseline)."""
    found = sorted(out.glob("engine-[1-9]*"))
    return found[0] if found else out / "engine-drafter-not-started"


def engines(out: Path) -> list[tuple[int, int]]:
    """(pid, port) of every engine the step recorded."""
    found = []
    for state in sorted(out.glob("engine-*/server.json")):
        info = json.loads(state.read_text())
        found.append((int(info["pid"]), int(urlsplit(info["url"]).port)))
    return found


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_for_drafter_engine(out: Path, step_pid: int, timeout: float = 180.0) -> tuple[int, int]:
    """Block until the drafter engine answers /health_generate; its (pid, port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = drafter_engine_folder(out) / "server.json"
        assert pid_alive(step_pid), "the step ended before its engine was ready"
        if state.is_file():
            info = json.loads(state.read_text())
            pid, port = int(info["pid"]), int(urlsplit(info["url"]).port)
            try:
                if requests.get(f"http://127.0.0.1:{port}/health_generate", timeout=2).status_code == 200:
                    return pid, port
            except requests.RequestException:
                pass
        time.sleep(0.3)
    raise AssertionError(f"the drafter engine was not ready within {timeout:.0f}s")


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) or group_alive(p) for p in pids):
        time.sleep(0.2)


@pytest.mark.parametrize("stop", ["SIGTERM to the group", "SIGINT", "SIGKILL to the step", "SIGKILL to its parent"])
def test_a_stopped_evaluation_leaves_no_engine_running(setup, tmp_path: Path, stop: str, process_groups: list[int]) -> None:
    out = tmp_path / "eval"
    argv = evaluate_argv(setup, out, "--eval-max-new-tokens", "400")
    log = open(tmp_path / "step.log", "wb")
    if stop == "SIGKILL to its parent":
        # A parent that runs the step as the operator does (EAGLEFLOW_PARENT_PID, own session), then dies by SIGKILL.
        wrapper = (
            "import os, subprocess, sys, time\n"
            "env = dict(os.environ, EAGLEFLOW_PARENT_PID=str(os.getpid()))\n"
            f"step = subprocess.Popen({argv!r}, env=env, start_new_session=True, stdout=sys.stdout, stderr=sys.stdout)\n"
            f"open({str(tmp_path / 'step.pid')!r}, 'w').write(str(step.pid))\n"
            "time.sleep(600)\n"
        )
        parent = subprocess.Popen([sys.executable, "-c", wrapper], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        process_groups.append(parent.pid)
        while not (tmp_path / "step.pid").is_file() or not (tmp_path / "step.pid").read_text():
            time.sleep(0.1)
        step_pid = int((tmp_path / "step.pid").read_text())
    else:
        step = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        step_pid = step.pid
    process_groups.append(step_pid)
    engine_pid, port = wait_for_drafter_engine(out, step_pid)
    process_groups.append(engine_pid)
    if stop == "SIGTERM to the group":
        os.killpg(step_pid, signal.SIGTERM)
    elif stop == "SIGINT":
        os.kill(step_pid, signal.SIGINT)
    elif stop == "SIGKILL to the step":
        os.kill(step_pid, signal.SIGKILL)
    else:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    if stop != "SIGKILL to its parent":
        assert step.wait(timeout=60) != 0
    recorded = engines(out)
    wait_gone([step_pid] + [pid for pid, _ in recorded], timeout=45)
    for pid, engine_port in recorded:
        assert not pid_alive(pid) and not group_alive(pid), f"{stop}: engine {pid} still running"
        assert not port_open(engine_port), f"{stop}: port {engine_port} still accepts connections"
    assert not pid_alive(step_pid)
    assert not (out / "report.json").exists()
    text = (tmp_path / "step.log").read_text()
    if stop != "SIGKILL to the step":  # the step itself stopped its engine and said so
        assert "evaluate: stopped (signal SIG" in text and f"engine process group {recorded[-1][0]} stopped" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]


def test_a_broken_drafter_is_reported_by_the_file_the_engine_could_not_load_and_the_rerun_completes(
    setup, tmp_path: Path
) -> None:
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(setup["drafter"], drafter)
    weights = drafter / "sglang" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 3)
    run = {**setup, "drafter": drafter}
    proc = subprocess.run(evaluate_argv(run, tmp_path / "eval", "--eval-max-new-tokens", "8"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error[0].startswith("error: the evaluation engine died") and f"{weights}: cannot load the drafter's weights" in error[0]
    assert str(drafter_engine_folder(tmp_path / "eval") / "server.log") in error[0]  # where the whole log is
    assert all(not pid_alive(pid) for pid, _ in engines(tmp_path / "eval"))
    # Export again over the broken folder, and the rerun completes.
    export(ExportConfig(checkpoint=setup["checkpoint"], verifier=setup["model"], out=drafter))
    proc = subprocess.run(evaluate_argv(run, tmp_path / "eval", "--eval-max-new-tokens", "8"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["prompts"] == 4 and report["drafter"] == str(drafter / "sglang")
    assert all(not pid_alive(pid) and not port_open(port) for pid, port in engines(tmp_path / "eval"))
