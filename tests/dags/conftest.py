"""Fixtures for the real-scheduler tests: a whole Airflow (scheduler, dag-processor, triggerer,
api-server) started as subprocesses, exactly as ``make airflow`` starts it, and a small REST client.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "eagleflow"
TERMINAL_RUN_STATES = ("success", "failed")


def load_airflow_env() -> ModuleType:
    """``scripts/airflow_env.py`` (scripts/ is not a package)."""
    name = "eagleflow_scripts_airflow_env"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "airflow_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class ApiError(AssertionError):
    """A REST call answered with an unexpected status; the message holds the body."""


@dataclass
class AirflowStack:
    """A running Airflow and a client of its REST API v2 (all-admins mode: no token needed)."""

    home: Path
    processes: Any  # airflow_env.AirflowProcesses

    @property
    def url(self) -> str:
        return self.processes.url

    def request(self, method: str, path: str, expect: int = 200, **kwargs: Any) -> Any:
        import requests

        response = requests.request(method, f"{self.url}/api/v2{path}", timeout=60, **kwargs)
        if response.status_code != expect:
            raise ApiError(f"{method} {path} answered {response.status_code}, expected {expect}: {response.text[:2000]}")
        return response.json() if response.content else None

    def task_instances(self, run_id: str) -> dict[tuple[str, int], dict[str, Any]]:
        """``{(task_id, map_index): task instance}`` of one DAG run."""
        body = self.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        return {(ti["task_id"], ti["map_index"]): ti for ti in body["task_instances"]}

    def describe(self, run_id: str) -> str:
        """A table of the run's task instances, and the components' state, for failure messages."""
        try:
            rows = [
                f"  {tid}[{mi}] {ti['rendered_map_index']} {ti['state']} try {ti['try_number']}"
                for (tid, mi), ti in sorted(self.task_instances(run_id).items())
            ]
        except Exception as exc:  # the API itself may be what broke
            rows = [f"  (task instances unavailable: {exc})"]
        dead = self.processes.describe_dead()
        return "\n".join(rows) + (f"\n{dead}" if dead else "")

    def xcom(self, run_id: str, task_id: str, map_index: int = -1) -> Any:
        body = self.request(
            "GET",
            f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
            params={"map_index": map_index},
        )
        value = body["value"]
        # Stored as JSON; older rows (or other backends) may hand back the JSON text itself.
        return json.loads(value) if isinstance(value, str) else value

    def task_log(self, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        """The task's log as the UI shows it (read by the api-server from the log folder)."""
        body = self.request(
            "GET",
            f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"map_index": map_index, "full_content": True},
            headers={"Accept": "application/json"},
        )
        content = body.get("content", [])
        if isinstance(content, str):
            return content
        return "\n".join(_log_line(item) for item in content)

    def wait_for_run(self, run_id: str, timeout: float) -> str:
        """Poll the run until it is success or failed; return that state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
            if state in TERMINAL_RUN_STATES:
                return state
            if self.processes.dead():
                raise AssertionError(f"an Airflow component died during run {run_id}:\n{self.describe(run_id)}")
            time.sleep(3)
        raise AssertionError(f"run {run_id} not finished within {timeout:.0f}s:\n{self.describe(run_id)}")


@pytest.fixture(scope="module")
def airflow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowStack]:
    """A real Airflow on a free 127.0.0.1 port, SQLite and LocalExecutor, in a temporary AIRFLOW_HOME.

    Teardown stops every process the stack started, engines and task processes included, and
    checks by pid that none is left.
    """
    airflow_env = load_airflow_env()
    home = tmp_path_factory.mktemp("airflow-home")
    env = airflow_env.airflow_env(
        home, port=airflow_env.free_port(), parallelism=3, all_admins=True, inherit_airflow_settings=False
    )
    airflow_env.migrate_db(env)
    processes = airflow_env.AirflowProcesses(env, home / "component-logs")
    stack = AirflowStack(home=home, processes=processes)
    try:
        processes.start()
        processes.wait_until_healthy(timeout=300)
        _wait_for_dag(stack, timeout=180)
        yield stack
    finally:
        started = processes.stop()
        left = [pid for pid in started if _alive(pid)] + airflow_env.session_processes(env[airflow_env.SESSION_VAR])
        assert not left, f"processes of the test's Airflow still alive after stop: {sorted(set(left))}"


def _wait_for_dag(stack: AirflowStack, timeout: float) -> None:
    """Wait until the dag-processor has parsed our DAG, failing at once on an import error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        errors = stack.request("GET", "/importErrors")["import_errors"]
        if errors:
            raise AssertionError(f"DAG import errors: {errors}")
        try:
            stack.request("GET", f"/dags/{DAG_ID}")
            return
        except ApiError:
            time.sleep(2)
    raise AssertionError(f"DAG {DAG_ID} not parsed within {timeout:.0f}s; dag-processor log:\n{stack.processes.log_tail('dag-processor')}")


def _alive(pid: int) -> bool:
    from eagleflow.engine.process import pid_alive

    return pid_alive(pid)


def _log_line(item: Any) -> str:
    """One structured log record as the UI renders it: the event, then any exception it carries."""
    if not isinstance(item, dict):
        return str(item)
    line = str(item.get("event", item))
    for error in item.get("error_detail") or []:
        line += f"\n{error.get('exc_type')}: {error.get('exc_value')}"
    return line
