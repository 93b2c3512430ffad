"""The DAG runs behind each run folder, read from Airflow's metadata database, and the Airflow pages they link to:
each run's drafter plan, the first task that failed and why, and the row of a folder no task has written yet.

Part of the eagleflow UI plugin (:mod:`eagleflow_ui` renders what this module reads). Airflow imports every
``.py`` file of its plugins folder as a top-level module; this one defines no plugin, so that is harmless.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from eagleflow.deploy import DAG_ID, PLAN_DRAFTERS_TASK_ID, REFUSAL_XCOM
from eagleflow.errors import UserError
from eagleflow.layout import RunLayout
from eagleflow.report import RunFiles

# The line Airflow's task runner logs when a task raises (airflow/sdk/execution_time/task_runner.py, 3.3:
# ``log.exception("Task failed with exception")``); its ``error_detail`` holds the exception's type and message.
FAILED_EVENT = "Task failed with exception"
REASON_CHARS = 600  # a reason longer than this is cut: the list shows one sentence, the task's log the rest
REASONS_KEPT = 1024  # failed tries whose reason is kept in memory (each read of a log is read once)
UNFINISHED_DAG_RUN_STATES = ("queued", "running")  # a page reloads while its DAG run is in one


def airflow_url(path: str) -> str:
    """``path`` (``dags/…``) in Airflow's UI, under ``[api] base_url`` as Airflow's own helpers build it."""
    from urllib.parse import urljoin

    from airflow.configuration import conf

    base = conf.get("api", "base_url", fallback="/") or "/"
    return urljoin(base.rstrip("/") + "/", path)


def dag_run_url(run_id: str) -> str:
    """The DAG run's page in Airflow's UI (``/dags/<dag_id>/runs/<run_id>``, under ``[api] base_url``)."""
    from airflow.utils.helpers import build_airflow_dagrun_url

    return build_airflow_dagrun_url(DAG_ID, quote(run_id, safe=""))


def dag_runs_list_url() -> str:
    """Airflow's list of the DAG's runs (``/dags/<dag_id>/runs``)."""
    return airflow_url(f"dags/{DAG_ID}/runs")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def first_task_starts(session: Any) -> dict[str, datetime]:
    """Per run id of the DAG, the earliest start of any try of any of its tasks.

    This, not the DAG run's ``start_date``, is when a run first started: Airflow's clear
    (``airflow.models.taskinstance.clear_task_instances``) sets a finished run's ``start_date`` to None
    and its ``queued_at`` to the time of the clear, so after a clear both tell when the run started
    *again*; ``run_after`` is when it was triggered, which can be long before it starts (it waits in
    the queue). Every try keeps its own ``start_date``: the current one in ``task_instance``, each
    cleared or retried one in ``task_instance_history``.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from sqlalchemy import func, select

    starts: dict[str, datetime] = {}
    for table in (TaskInstance, TaskInstanceHistory):
        query = (
            select(table.run_id, func.min(table.start_date))
            .where(table.dag_id == DAG_ID, table.start_date.is_not(None))
            .group_by(table.run_id)
        )
        for run_id, start in session.execute(query).all():
            if start is not None and (run_id not in starts or start < starts[run_id]):
                starts[run_id] = start
    return starts


def planned_drafters(session: Any) -> dict[str, list[str]]:
    """Per run id of the DAG, the folders of the drafters its ``plan_drafters`` task listed (its XCom, the drafter plan
    ``[{name, folder, settings}]``): [] for a run of one drafter (kept in the run folder), none for a run not planned yet.

    The plan, not the ``drafters/`` folders, counts a running run's drafters: a drafter writes its folder only when
    its first task reaches it.
    """
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    query = select(XComModel).where(
        XComModel.dag_id == DAG_ID, XComModel.task_id == PLAN_DRAFTERS_TASK_ID, XComModel.key == "return_value",
        XComModel.map_index == -1,
    )
    plans: dict[str, list[str]] = {}
    for row in session.scalars(query):
        plan = XComModel.deserialize_value(row)
        if isinstance(plan, list):
            plans[row.run_id] = [str(d["folder"]) for d in plan if isinstance(d, dict) and d.get("folder")]
    return plans


def dag_runs_by_folder(output_root: Path) -> dict[str, list[dict[str, Any]]] | None:
    """The DAG's runs that write under ``output_root``, by run folder, newest first; None when Airflow's
    metadata database cannot be read.

    Each is ``{run_id, state, first_start, start_date, end_date, run_after, clear_number, url, drafters}``: ``first_start``
    is when the run first started (:func:`first_task_starts`, or its own ``start_date`` when earlier or no
    task started yet), ``start_date`` when its latest attempt did (a clear moves it); ``drafters`` the folders of
    its drafter plan (:func:`planned_drafters`; None before it is planned). A DAG run writes the
    folder its ``run_name`` Param names, else the one derived from its run id
    (:func:`eagleflow.layout.run_name_of`, the rule the tasks follow); a run whose ``output_root`` Param is
    another folder is left out. A run that failed before any task wrote its folder is listed all the same.
    """
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select
    from sqlalchemy.exc import SQLAlchemyError

    from eagleflow.layout import run_name_of

    query = (
        select(DagRun.run_id, DagRun.state, DagRun.conf, DagRun.start_date, DagRun.end_date, DagRun.run_after,
               DagRun.clear_number)
        .where(DagRun.dag_id == DAG_ID)
        .order_by(DagRun.run_after.desc())
    )
    try:
        with create_session() as session:
            rows = session.execute(query).all()
            starts = first_task_starts(session)
            plans = planned_drafters(session)
    except SQLAlchemyError:
        return None
    runs: dict[str, list[dict[str, Any]]] = {}
    for run_id, state, conf, start_date, end_date, run_after, clear_number in rows:
        conf = conf if isinstance(conf, dict) else {}
        if conf.get("output_root") and Path(str(conf["output_root"])).resolve() != output_root:
            continue
        first = min((t for t in (starts.get(run_id), start_date) if t is not None), default=None)
        runs.setdefault(run_name_of(conf, run_id), []).append({
            "run_id": run_id, "state": str(state.value if hasattr(state, "value") else state),
            "first_start": _iso(first), "start_date": _iso(start_date), "end_date": _iso(end_date),
            "run_after": _iso(run_after), "clear_number": clear_number or 0, "url": dag_run_url(run_id),
            "drafters": plans.get(run_id),
        })
    return runs


def dag_run_conf(run_id: str) -> dict[str, Any] | None:
    """The conf (Params given) of the DAG's run ``run_id``: {} for none given, None when there is no such DAG run."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        found = session.execute(select(DagRun.conf).where(DagRun.dag_id == DAG_ID, DagRun.run_id == run_id)).first()
    if found is None:
        return None
    return found[0] if isinstance(found[0], dict) else {}


# (run id, task id, map index, try number) -> reason: a finished try's log no longer changes once it holds one.
_reasons: dict[tuple[str, str, int, int], str] = {}


def first_failure(run_id: str) -> dict[str, str | None] | None:
    """The first task of DAG run ``run_id`` that failed, and why: ``{task, reason}``, or None when none failed.

    The first is the failed task instance that ended first (the tasks after it are ``upstream_failed``, with no
    log). Its reason: the sentence the first task keeps when it refuses the run's Params (XCom
    :data:`~eagleflow.deploy.REFUSAL_XCOM`, in the metadata database), else the message of the exception it failed
    with, read from its log through Airflow's own log reader (``TaskLogReader``, what the UI's log view uses: local
    files, a worker's log server or remote logging alike): Airflow 3.3 keeps a task's exception nowhere else (no
    column of ``task_instance`` holds it; its note is the users'). Only the message's first line: an eagleflow task
    that refuses its input fails with one sentence (``AirflowFailException``). ``reason`` is None when neither says.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select
    from sqlalchemy.orm import joinedload

    query = (
        select(TaskInstance)
        .where(TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id, TaskInstance.state == TaskInstanceState.FAILED)
        .options(joinedload(TaskInstance.dag_run))  # the log file's name is rendered from it
        .order_by(TaskInstance.end_date.asc().nulls_last())
        .limit(1)
    )
    with create_session() as session:
        ti = session.scalar(query)
        if ti is None:
            return None
        task = ti.task_id if ti.map_index < 0 else f"{ti.task_id} {ti.rendered_map_index or ti.map_index}"
        key = (run_id, ti.task_id, ti.map_index, ti.try_number)
        refusal = session.scalars(select(XComModel).where(
            XComModel.dag_id == DAG_ID, XComModel.run_id == run_id, XComModel.task_id == ti.task_id,
            XComModel.map_index == ti.map_index, XComModel.key == REFUSAL_XCOM,
        )).first()
        said = XComModel.deserialize_value(refusal) if refusal is not None else None
        reason = _first_line(said) if isinstance(said, str) and said.strip() else _reasons.get(key) or _failure_reason(ti)
    if reason is not None:  # none yet: the log may still be arriving (a worker's log reaches its reader after the state)
        if len(_reasons) >= REASONS_KEPT:
            _reasons.clear()
        _reasons[key] = reason
    return {"task": task, "reason": reason}


def _failure_reason(ti: Any) -> str | None:
    """The first line of the exception ``ti``'s log says it failed with (:data:`FAILED_EVENT`), or None."""
    from airflow.utils.log.log_reader import TaskLogReader

    try:
        reader = TaskLogReader()
        if not reader.supports_read:
            return None
        messages, _ = reader.read_log_chunks(ti, ti.try_number, {})
        for message in messages:
            if getattr(message, "event", None) != FAILED_EVENT:
                continue
            details = getattr(message, "error_detail", None) or []
            raised = next((d for d in details if isinstance(d, dict) and not d.get("is_cause")), None)
            text = str((raised or {}).get("exc_value") or "").strip()
            if text:
                return _first_line(text)
    except Exception:  # noqa: BLE001  (a log that cannot be read leaves the page its link to the log)
        return None
    return None


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0]
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 1] + "…"


def newest_plan(dag_runs: list[dict[str, Any]] | None) -> list[str] | None:
    """The drafter plan's folders of a run folder's newest DAG run that has one (:func:`planned_drafters`), or None."""
    return next((found["drafters"] for found in dag_runs or [] if found.get("drafters") is not None), None)


def without_folder(root: Path, name: str, dag_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row of the list for a folder that DAG runs write but that holds no run (yet): its newest DAG run,
    when it last changed, why there is nothing to show (``no_folder``) and, once a task of it failed, which and
    the reason it gave (``failure``, :func:`first_failure`)."""
    latest = dag_runs[0]
    try:
        layout = RunLayout.of(root, name)
    except UserError:  # a run_name Param no run may use: the DAG run failed on it, before any folder
        layout = None
    exists = layout is not None and RunFiles(layout).folder(layout.root)
    state = latest["state"]
    if exists:
        why = "its folder holds no shards, training or drafters yet"
    elif state in UNFINISHED_DAG_RUN_STATES:
        why = "no run folder yet: no task of the DAG run has written it"
    elif state == "failed":
        why = "no run folder was written: the DAG run failed before its first task wrote it"
    else:
        why = "no run folder: the DAG run wrote none here, or it was moved or deleted since"
    when = next((latest[k] for k in ("end_date", "start_date", "first_start", "run_after") if latest.get(k)), None)
    failure = first_failure(latest["run_id"]) if state in ("failed", "running") else None
    return {"name": name, "linked": layout is not None, "dag_run": latest, "headline": None, "no_folder": why,
            "failure": failure, "modified": _timestamp(when)}


def _timestamp(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


__all__ = [
    "UNFINISHED_DAG_RUN_STATES", "airflow_url", "dag_run_conf", "dag_run_url", "dag_runs_by_folder", "dag_runs_list_url",
    "first_failure", "first_task_starts", "newest_plan", "planned_drafters", "without_folder",
]
