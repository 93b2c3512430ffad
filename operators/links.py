"""Operator extra link "eagleflow run": opens the run's page of the eagleflow UI plugin.

How it works in Airflow 3.3.2: when a task instance finishes (success or failure) the task
runner calls :meth:`EagleflowRunLink.get_link` in the worker and stores the URL as the XCom
``_link_EagleflowRunLink``; the UI's button reads that XCom. The link needs the run's folder
name, which an operator records under :data:`RUN_NAME_XCOM_KEY` with :func:`push_run_name`
as the first thing its ``execute`` does (so the link exists even when the step then fails).
Without that XCom, the link falls back to the DAG run's ``run_name`` Param, else the name
derived from the run id, the same rule as :meth:`eagleflow.run.pipeline.PipelineConfig.from_params`.

Usage on an operator::

    class TrainOperator(EagleflowStepOperator):
        operator_extra_links = (EagleflowRunLink(),)

        def execute(self, context):
            push_run_name(context, pipeline_config(context).run_name)
            ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context
    from airflow.sdk.types import TaskInstanceKey

# The XCom key under which an operator records its run folder name; the link reads it.
RUN_NAME_XCOM_KEY = "eagleflow_run_name"


def run_page_url(run_name: str, base_url: str | None = None) -> str:
    """URL of ``run_name``'s page: ``[api] base_url`` (may be empty) + ``/eagleflow/runs/<name>``."""
    from eagleflow.deploy import run_page_path

    if base_url is None:
        from airflow.sdk import conf

        base_url = conf.get("api", "base_url", fallback="") or ""
    return f"{base_url.rstrip('/')}{run_page_path(run_name)}"


def push_run_name(context: Context, run_name: str) -> None:
    """Record the run folder name for :class:`EagleflowRunLink` (call it early in ``execute``)."""
    context["ti"].xcom_push(key=RUN_NAME_XCOM_KEY, value=run_name)


def _run_name_from_context(ti: Any) -> str | None:
    """The DAG run's ``run_name`` Param, else the name eagleflow derives from the run id.

    In Airflow 3.3.2 the ``ti_key`` the task runner hands to ``get_link`` is the running task
    instance itself, which can build its template context; a bare key cannot, and gets None.
    """
    get_context = getattr(ti, "get_template_context", None)
    if get_context is None:
        return None
    from eagleflow.layout import run_name_of

    context = get_context()
    return run_name_of(context.get("params") or {}, str(context.get("run_id") or ti.run_id))


class EagleflowRunLink(BaseOperatorLink):
    """The "eagleflow run" button: shard table, charts and metrics of this task's run."""

    name = "eagleflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        run_name = XCom.get_value(ti_key=ti_key, key=RUN_NAME_XCOM_KEY) or _run_name_from_context(ti_key)
        return run_page_url(str(run_name)) if run_name else ""
