"""Fixtures for the UI plugin tests: a run folder shaped like a real one, and real Airflow logins."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ui_run_folders import FIXTURES, write_dflash_metrics

# A 1x1 PNG: the routes serve chart files, they do not look inside them.
TINY_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f80f00000101000518d84e0000000049454e44ae426082"
)


def write_manifest(shards: Path, **fields: Any) -> None:
    """A shard manifest in the extractor's format (docs/design.md §3.5 plus per-row failures)."""
    data = {"state": "success", "done": 0, "skipped": 0, "failed": [], "tokens": 0, "bytes": 0, "seconds": 0.0,
            "updated": time.time() - 60, **fields}
    (shards / f"{data['name']}.json").write_text(json.dumps(data))


@pytest.fixture()
def record_dflash_metrics() -> Any:
    """``record(metrics)``: the real DFlash training's metric dicts (``fixtures/metrics/dflash``) through the
    training step's recorder into ``metrics``, as speculators logs them; returns the records written."""
    return write_dflash_metrics


@pytest.fixture()
def output_root(tmp_path: Path) -> Path:
    """``<root>/demo``: three shard manifests, metrics from the real fixture run, two charts; plus
    a file outside the run and one outside the output root, for traversal attempts."""
    return fill_output_root(tmp_path / "runs")


@pytest.fixture(scope="session", name="fill_output_root")
def fill_output_root_fixture() -> Callable[[Path], Path]:
    """``fill(root)``: :func:`fill_output_root`, for fixtures of a wider scope than :func:`output_root`'s."""
    return fill_output_root


def fill_output_root(root: Path) -> Path:
    """The :func:`output_root` fixture's run folder ``demo`` and the files around it, written under ``root``."""
    run = root / "demo"
    shards = run / "shards"
    shards.mkdir(parents=True)
    # A resumed shard: its last attempt extracted 38 rows (8,664 tokens) and skipped 2 done before;
    # the totals count all 40. The other two were written before manifests had totals.
    write_manifest(shards, name="rows_0-40", start=0, end=40, done=38, skipped=2, tokens=8664, bytes=8664 * 4 * 64 * 2,
                   total_tokens=9120, total_bytes=9120 * 4 * 64 * 2, seconds=12.0, engine="engine-1 at http://127.0.0.1:30001")
    write_manifest(shards, name="rows_40-80", start=40, end=80, state="failed", done=39, tokens=9001,
                   bytes=9001 * 512, seconds=11.5,
                   failed=[{"row": 57, "reason": "engine answered 400: <script>alert(1)</script>"}])
    write_manifest(shards, name="rows_80-120", start=80, end=120, state="running", done=7, tokens=1500,
                   bytes=1500 * 512, seconds=3.0)
    (run / "train").mkdir()
    shutil.copyfile(FIXTURES / "metrics.jsonl", run / "train" / "metrics.jsonl")
    (run / "train" / "train.log").write_text("step 0 epoch 0 loss 9.1\n")
    (run / "train-progress").mkdir()
    for name in ("loss", "acc"):
        (run / "train-progress" / f"{name}.png").write_bytes(TINY_PNG)
        (run / "train-progress" / f"{name}.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    (run / "dataset" / "hidden_states").mkdir(parents=True)
    (run / "dataset" / "hidden_states" / "hs_0.safetensors").write_bytes(b"\0" * 16)
    (root / "other-run").mkdir()
    (root / "other-run" / "secret.json").write_text('{"secret": "other run"}')
    (root.parent / "outside.json").write_text('{"secret": "outside the output root"}')
    return root


@dataclass
class AirflowLogin:
    """The API server's auth manager and a valid JWT for a user it knows."""

    auth_manager: Any
    token: str

    def new_token(self) -> str:
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

        return self.auth_manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))


@pytest.fixture(scope="session")
def airflow_login(airflow_db: Path) -> AirflowLogin:
    """Airflow's configured auth manager (SimpleAuthManager here), initialised as the API server
    does, and a token it signed. Token checks read the metadata DB (revoked tokens), hence airflow_db."""
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    auth_manager = init_auth_manager()
    token = auth_manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    return AirflowLogin(auth_manager, token)


@pytest.fixture()
def client(output_root: Path, airflow_login: AirflowLogin) -> Any:
    """A browser that logged in to Airflow: it carries the UI's ``_token`` cookie."""
    from fastapi.testclient import TestClient

    from plugins.eagleflow_ui import create_app

    test_client = TestClient(create_app(output_root))
    test_client.cookies.set("_token", airflow_login.token)
    return test_client


@pytest.fixture()
def dag_runs(airflow_login: AirflowLogin, output_root: Path) -> Iterator[Callable[..., None]]:
    """``add(run_id, state, conf, minutes_ago, *, started_minutes_ago=…, cleared=0, tries=(), failed=(), plan=None,
    refusals={})``: a DAG run of the eagleflow DAG in the test's metadata DB (removed after), triggered ``minutes_ago``.

    Its ``start_date`` is ``started_minutes_ago`` (default: when triggered; None: not started). ``tries`` are
    ``(task_id, minutes_ago)`` starts of task tries: the last of a task is its current try (``task_instance``),
    the earlier ones are in ``task_instance_history``, as Airflow keeps a cleared or retried try; a task named in
    ``failed`` failed its current try (else it succeeded), ending a minute after it started.
    ``cleared``: the DAG run's ``clear_number``. A finished one ended when it started. ``plan``: the drafter plan
    ``plan_drafters`` returned (its XCom), when it ran; ``refusals``: per task, the sentence it kept refusing the run's
    Params (XCom ``REFUSAL_XCOM``, as the first task keeps it).
    """
    import pendulum
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunType
    from sqlalchemy import delete, insert

    from eagleflow.deploy import DAG_ID, PLAN_DRAFTERS_TASK_ID, REFUSAL_XCOM

    added: list[str] = []
    unset = object()

    def ago(minutes: float | None) -> Any:
        return None if minutes is None else pendulum.now("UTC").subtract(minutes=minutes)

    def add(run_id: str, state: str, conf: dict[str, Any], minutes_ago: float, *, started_minutes_ago: Any = unset,
            cleared: int = 0, tries: tuple[tuple[str, float], ...] = (), failed: tuple[str, ...] = (),
            plan: list[dict[str, Any]] | None = None, refusals: dict[str, str] | None = None) -> None:
        start = ago(minutes_ago if started_minutes_ago is unset else started_minutes_ago)
        with create_session() as session:
            session.add(DagRun(dag_id=DAG_ID, run_id=run_id, run_type=DagRunType.MANUAL, state=state, conf=conf,
                               run_after=ago(minutes_ago), start_date=start))
            session.flush()
            session.execute(
                DagRun.__table__.update().where(DagRun.run_id == run_id, DagRun.dag_id == DAG_ID)
                .values(clear_number=cleared, end_date=(start or ago(minutes_ago)) if state in ("success", "failed") else None)
            )  # (the state setter sets a finished run's end_date to now)
            by_task: dict[str, list[float]] = {}
            for task_id, minutes in tries:
                by_task.setdefault(task_id, []).append(minutes)
            for task_id, starts in by_task.items():
                *earlier, current = starts
                key = {"dag_id": DAG_ID, "run_id": run_id, "task_id": task_id, "map_index": -1, "pool": "default_pool"}
                ti = TaskInstance.__table__
                session.execute(insert(ti).values(**key, id=uuid.uuid4(), try_number=len(starts), start_date=ago(current),
                                                  end_date=ago(current - 1), state="failed" if task_id in failed else "success"))
                for number, minutes in enumerate(earlier, start=1):
                    session.execute(insert(TaskInstanceHistory.__table__).values(
                        **key, task_instance_id=uuid.uuid4(), try_number=number, start_date=ago(minutes), state="failed"))
            if plan is not None:
                XComModel.set("return_value", plan, dag_id=DAG_ID, task_id=PLAN_DRAFTERS_TASK_ID, run_id=run_id, session=session)
            for task_id, sentence in (refusals or {}).items():
                XComModel.set(REFUSAL_XCOM, sentence, dag_id=DAG_ID, task_id=task_id, run_id=run_id, session=session)
        added.append(run_id)

    yield add
    with create_session() as session:
        for table in (XComModel, TaskInstanceHistory, TaskInstance, DagRun):
            session.execute(delete(table).where(table.dag_id == DAG_ID, table.run_id.in_(added)))


@pytest.fixture()
def task_logs(airflow_db: Path) -> Iterator[Callable[..., Path]]:
    """``write(run_id, task_id, *lines)``: the log of a task's first try where Airflow's log reader finds it (the
    configured log folder and file name template), one JSON line per dict; removed after."""
    from airflow.configuration import conf
    from jinja2 import Template

    from eagleflow.deploy import DAG_ID

    folder, written = Path(conf.get("logging", "base_log_folder")), []

    def write(run_id: str, task_id: str, *lines: dict[str, Any]) -> Path:
        ti = {"dag_id": DAG_ID, "run_id": run_id, "task_id": task_id, "map_index": -1}
        path = folder / Template(conf.get("logging", "log_filename_template")).render(ti=ti, try_number=1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        written.append(path)
        return path

    yield write
    for path in written:
        shutil.rmtree(path.parents[1], ignore_errors=True)  # .../run_id=<run>/task_id=<task>/attempt=1.log
