"""The DAG runs behind each run folder, read from Airflow's metadata database, and the Airflow pages they link to.

Part of the eagleflow UI plugin (:mod:`eagleflow_ui` renders what this module reads). Airflow imports every
``.py`` file of its plugins folder as a top-level module; this one defines no plugin, so that is harmless.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from eagleflow.deploy import DAG_ID


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


def dag_runs_by_folder(output_root: Path) -> dict[str, list[dict[str, Any]]] | None:
    """The DAG's runs that write under ``output_root``, by run folder, newest first; None when Airflow's
    metadata database cannot be read.

    Each is ``{run_id, state, first_start, start_date, end_date, run_after, clear_number, url}``: ``first_start``
    is when the run first started (:func:`first_task_starts`, or its own ``start_date`` when earlier or no
    task started yet), ``start_date`` when its latest attempt did (a clear moves it). A DAG run writes the
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
        })
    return runs


__all__ = ["airflow_url", "dag_run_url", "dag_runs_by_folder", "dag_runs_list_url", "first_task_starts"]
