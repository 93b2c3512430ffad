"""Fixtures for the real-scheduler tests: a whole Airflow (scheduler, dag-processor, triggerer,
api-server) started as subprocesses, exactly as ``make airflow`` starts it, and a small REST client;
and the same with CeleryExecutor as ``docker/`` deploys it (PostgreSQL, Redis, two Celery workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from eagleflow.deploy import NODE_ADDRESS_ENV
from eagleflow.engine.process import free_port
from eagleflow.engine.reference.faults import FAULTS_ENV, faults_env
from eagleflow.files import atomic_write_text
from metadata_db import migrated_sqlite_db
from reference_engines import ENGINE_COMPUTE_FLAGS

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "eagleflow"
TERMINAL_RUN_STATES = ("success", "failed")
# Test-only Airflow timeouts, shorter than a deployment's (docker/airflow.env, Airflow's defaults) so
# the fault tests wait less for what they provoke: a scheduler presumed dead (its orphaned tasks
# reset by the next one) and a task whose worker vanished (no heartbeat). And one that is longer:
# the DAG file never changes under a test, so the dag-processor parses it once or twice per stack instead of
# every 30 s (a parse is a process of ~1.7 CPU-seconds; Airflow's default cost ~60 per suite).
SCHEDULER_HEALTH_CHECK_THRESHOLD = 15
TASK_HEARTBEAT_TIMEOUT = 30
DAG_FILE_REPARSE_INTERVAL = 600
TEST_TIMEOUTS = {
    "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": str(SCHEDULER_HEALTH_CHECK_THRESHOLD),
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(TASK_HEARTBEAT_TIMEOUT),
    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": str(DAG_FILE_REPARSE_INTERVAL),
}


@dataclass
class RunInputs:
    """A small run's inputs: the untrained tiny verifier, ``rows`` synthetic conversations, and Params sized for 2 cores."""

    model: Path
    conversations: Path
    rows: int
    max_len: int = 256

    def conf(self, output_root: Path, run_name: str, **overrides: Any) -> dict[str, Any]:
        """Params of a run of the reference engine (short warmup, float32 on one thread), a 1-epoch drafter, a 2-prompt evaluation."""
        return {
            "engine": "reference",
            "model_path": str(self.model),
            "dataset_input": str(self.conversations),
            "output_root": str(output_root),
            "run_name": run_name,
            "max_len": self.max_len,
            "concurrency": 4,
            "server_port": 0,
            "server_extra_args": ["--warmup-seconds", "3", *ENGINE_COMPUTE_FLAGS],
            "eval_server_extra_args": ["--warmup-seconds", "3", *ENGINE_COMPUTE_FLAGS],
            "warmup_timeout": 300.0,
            "epochs": 1,
            "total_seq_len": 512,
            "num_workers": 0,
            "draft_vocab_size": 256,
            "device": "cpu",
            "eval_rows": 2,
            "eval_max_new_tokens": 8,
            "eval_concurrency": 1,
            "eval_sets": ["heldout"],
            "eval_rounds": 1,
            **overrides,
        }

    def check_every_row(self, dataset: Path, captured: list[int] | None = None) -> None:
        """Every row's file passes ``validate_dataset`` and speculators' own reader loads it with the row's tokens.

        :param captured: the layer ids the run captured (several drafters: their union), else the default ones.
        """
        from datasets import load_from_disk
        from speculators.train.data import ArrowDataset

        from eagleflow.verifier.config import config_int, resolve_aux_layer_ids
        from eagleflow.extract.sample_store import validate_dataset

        hidden = config_int(str(self.model), "hidden_size")
        slots = len(captured or resolve_aux_layer_ids(self.model, None)) + 1
        rows = load_from_disk(str(dataset))
        assert len(rows) == self.rows
        assert validate_dataset(dataset, slots, hidden) == []
        reader = ArrowDataset(max_len=self.max_len, datapath=str(dataset), on_missing="raise")
        assert len(reader) == self.rows
        for row in range(self.rows):
            item = reader[row]
            assert item["input_ids"].tolist() == [int(t) for t in rows[row]["input_ids"]]
            assert item["hidden_states"].shape[-1] == hidden * (slots - 1), item["hidden_states"].shape


@pytest.fixture(scope="module")
def run_inputs(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], RunInputs]:
    """``run_inputs(rows)``: :class:`RunInputs` with that many conversations (made once per size and module)."""
    made: dict[int, RunInputs] = {}

    def make(rows: int) -> RunInputs:
        if rows not in made:
            out = tmp_path_factory.mktemp("inputs") / f"conversations-{rows}.jsonl"
            subprocess.run(
                [sys.executable, "-m", "eagleflow", "make-dataset", "--verifier", str(random_tiny_model), "--out", str(out),
                 "--rows", str(rows)],
                check=True, capture_output=True, text=True,
            )
            made[rows] = RunInputs(model=random_tiny_model, conversations=out, rows=rows)
        return made[rows]

    return make


def shard_in_flight(run_folder: Path, min_rows: int, engine: str = "", leaving_out: Collection[str] = ()) -> dict[str, Any] | None:
    """The manifest of a shard that is extracting (of ``engine``, when given; none named in ``leaving_out``) with at
    least ``min_rows`` rows written.

    Rows are counted by their files: the manifest's own counts move only at progress lines.
    """
    from eagleflow.extract.sample_store import sample_path
    from eagleflow.layout import RunLayout

    layout = RunLayout(run_folder)
    for path in sorted(layout.shards.glob("rows_*.json")):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):  # published atomically, but may vanish under the listing
            continue
        if manifest["state"] != "running" or not manifest["engine"].startswith(engine) or manifest["name"] in leaving_out:
            continue
        written = [row for row in range(manifest["start"], manifest["end"]) if sample_path(layout.hidden_states, row).exists()]
        if len(written) >= min_rows:
            return manifest
    return None


@pytest.fixture(scope="session")
def in_flight() -> Callable[..., dict[str, Any] | None]:
    """:func:`shard_in_flight`, for the tests that act while a shard runs."""
    return shard_in_flight


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

    def inject_faults(self, **faults: Any) -> None:
        """The test-only faults every engine a run of this stack launches from now on injects (the stack's
        components carry ``EAGLEFLOW_TEST_FAULTS`` naming this file; the engines inherit it)."""
        atomic_write_text(faults_file(self.home), faults_env(**faults)[FAULTS_ENV])

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

    def trigger(self, run_id: str, conf: dict[str, Any]) -> None:
        """Unpause the DAG (Celery's settings create it paused) and trigger a run with ``conf``."""
        self.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
        self.request("POST", f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None, "conf": conf})

    def tries(self, run_id: str, task_id: str, map_index: int = -1) -> list[dict[str, Any]]:
        """Every try of one task instance (finished ones from the history, then the current one), oldest first."""
        body = self.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries")
        return sorted(body["task_instances"], key=lambda ti: ti["try_number"])

    def xcom(self, run_id: str, task_id: str, map_index: int = -1) -> Any:
        body = self.request(
            "GET",
            f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
            params={"map_index": map_index},
        )
        value = body["value"]
        # Stored as JSON; older rows (or other backends) may hand back the JSON text itself, and a
        # task that returned a plain string gets that string.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value

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


def faults_file(home: Path) -> Path:
    """Where a stack's test-only engine faults live (no file: none)."""
    return home / "test-faults.json"


@pytest.fixture(scope="module")
def airflow_stack(tmp_path_factory: pytest.TempPathFactory, scripts: Callable[[str], ModuleType]) -> Iterator[AirflowStack]:
    """A real Airflow on a free 127.0.0.1 port, SQLite and LocalExecutor, in a temporary AIRFLOW_HOME.

    Teardown stops every process the stack started, engines and task processes included, and
    checks by pid that none is left.
    """
    airflow_env = scripts("airflow_env")
    home = tmp_path_factory.mktemp("airflow-home")
    env = airflow_env.airflow_env(
        home, port=free_port(), parallelism=3, all_admins=True, inherit_airflow_settings=False,
        extra={FAULTS_ENV: str(faults_file(home))},
    )
    env.update(TEST_TIMEOUTS)
    migrated_sqlite_db(home)  # the SQLite file airflow_env points AIRFLOW_HOME's stack at
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


@pytest.fixture(scope="module")
def celery_stack(tmp_path_factory: pytest.TempPathFactory, scripts: Callable[[str], ModuleType]) -> Iterator[AirflowStack]:
    """Airflow with CeleryExecutor, as ``docker/docker-compose.yaml`` deploys it, on this machine.

    PostgreSQL (metadata database, run as its own system user) and Redis (Celery broker) from
    the Debian packages, on free 127.0.0.1 ports with generated passwords; the settings of
    ``docker/airflow.env`` (the compose files load the same file); scheduler, dag-processor,
    triggerer, api-server and two Celery workers, one on the default queue and one on the GPU
    queue, the GPU pool imported from ``docker/pools.json``. Teardown stops everything and
    checks by pid that no process is left and that no port is still taken.
    """
    airflow_env, services = scripts("airflow_env"), scripts("backing_services")
    try:
        postgres, redis = services.PostgresServer(), services.RedisServer()
    except services.ServiceError as missing:  # not installed: .ci/run installs both
        if os.environ.get("CI"):
            pytest.fail(f"{missing} - CI must install it")
        pytest.skip(str(missing))
    home = tmp_path_factory.mktemp("airflow-celery-home")
    processes = None
    api_port = free_port()
    try:
        postgres.start()
        redis.start()
        backends = airflow_env.CeleryBackends(postgres.url, postgres.result_backend, redis.url)
        # This machine plays every training node: they reach node-0 on the loopback (a GPU node: its own
        # address), and each CPU rank takes one core (two ranks of two threads each on two shared cores
        # spent most of their time in OpenMP's spinning waits: 15x slower epochs).
        node_address = {NODE_ADDRESS_ENV: "127.0.0.1", "OMP_NUM_THREADS": "1"}
        env = airflow_env.airflow_env(
            home, port=api_port, parallelism=4, all_admins=True, inherit_airflow_settings=False, celery=backends,
            extra={**node_address, FAULTS_ENV: str(faults_file(home))},
        )
        env.update(TEST_TIMEOUTS)
        airflow_env.migrate_db(env)
        processes = airflow_env.AirflowProcesses(env, home / "component-logs", components=airflow_env.celery_components(env))
        stack = AirflowStack(home=home, processes=processes)
        processes.start()
        processes.wait_until_healthy(timeout=300)
        _wait_for_dag(stack, timeout=180)
        yield stack
    finally:
        started = processes.stop() + processes.killed if processes else []
        session = airflow_env.session_processes(processes.env[airflow_env.SESSION_VAR]) if processes else []
        backend_pids = postgres.stop() + redis.stop()
        left = sorted({pid for pid in started + backend_pids if _alive(pid)} | set(session))
        assert not left, f"processes of the Celery deployment still alive after stop: {left}"
        taken = [port for port in (api_port, postgres.port, redis.port) if not services.port_is_free(port)]
        assert not taken, f"ports still taken after stop: {taken}"


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
