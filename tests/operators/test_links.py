"""The "eagleflow run" extra link, computed by Airflow's own task runner and read back as the UI does.

A real ``dag.test()`` runs in a child process with its own AIRFLOW_HOME (a DAG must live in a
bundle folder to be run, and the child keeps this session's Airflow state untouched). Its tasks
carry :class:`operators.links.EagleflowRunLink`; the child prints what the UI's extra-links
endpoint would return for each task instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from operators.links import RUN_NAME_XCOM_KEY, EagleflowRunLink, run_page_url
from metadata_db import migrated_sqlite_db

REPO = Path(__file__).resolve().parents[2]

DAG_FILE = textwrap.dedent(
    """
    from airflow.sdk import DAG, BaseOperator, Param
    from operators.links import EagleflowRunLink, push_run_name


    class PushingOperator(BaseOperator):
        operator_extra_links = (EagleflowRunLink(),)

        def execute(self, context):
            push_run_name(context, "pushed/run 1")


    class SilentOperator(BaseOperator):
        operator_extra_links = (EagleflowRunLink(),)

        def execute(self, context):
            return None


    class FailingOperator(BaseOperator):
        operator_extra_links = (EagleflowRunLink(),)

        def execute(self, context):
            push_run_name(context, "failed-run")
            raise RuntimeError("the step failed")


    with DAG("links_test", schedule=None, params={"run_name": Param("", type="string")}) as dag:
        PushingOperator(task_id="pushing")
        SilentOperator(task_id="silent")
        PushingOperator.partial(task_id="mapped").expand(doc=["a", "b"])
        FailingOperator(task_id="failing")
    """
)

RUNNER = textwrap.dedent(
    """
    import json, sys
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    dag = DagBag(dag_folder=sys.argv[1]).get_dag("links_test")
    conf = json.loads(sys.argv[2])
    run = dag.test(run_conf=conf or None)
    # What the UI's extra-links endpoint does: the serialized task's link, for each TI.
    served = SerializedDagModel.get_dag("links_test")
    links = {}
    with create_session() as session:
        for ti in session.query(TaskInstance).filter(TaskInstance.run_id == run.run_id):
            task = served.get_task(ti.task_id)
            links[f"{ti.task_id}[{ti.map_index}]"] = [ti.state, task.get_extra_links(ti, "eagleflow run")]
    print("LINKS " + json.dumps(links, sort_keys=True))
    """
)


def run_links_dag(tmp_path: Path, conf: dict[str, str], base_url: str = "") -> dict[str, list]:
    home = tmp_path / "airflow"
    dags = home / "dags"
    dags.mkdir(parents=True)
    (dags / "links_test.py").write_text(DAG_FILE)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
        "AIRFLOW__API__BASE_URL": base_url,
        "PYTHONPATH": str(REPO),
    }
    migrated_sqlite_db(home)
    result = subprocess.run([sys.executable, "-c", RUNNER, str(dags), json.dumps(conf)], env=env, capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in result.stdout.splitlines() if line.startswith("LINKS ")]
    assert lines, (result.stdout + result.stderr)[-4000:]
    return json.loads(lines[-1][len("LINKS "):])


def test_links_through_a_real_dag_run(tmp_path: Path) -> None:
    links = run_links_dag(tmp_path, {"run_name": "from-params"}, base_url="http://airflow.example:8080/")
    base = "http://airflow.example:8080/eagleflow/runs/"
    assert links == {
        # Pushed by the operator (quoted: a name reaches the URL as one path segment).
        "pushing[-1]": ["success", base + "pushed%2Frun%201"],
        "mapped[0]": ["success", base + "pushed%2Frun%201"],
        "mapped[1]": ["success", base + "pushed%2Frun%201"],
        # A task that failed after recording its run still gets its link.
        "failing[-1]": ["failed", base + "failed-run"],
        # No XCom: the run's run_name Param.
        "silent[-1]": ["success", base + "from-params"],
    }


def test_run_page_url() -> None:
    assert run_page_url("demo", base_url="") == "/eagleflow/runs/demo"
    assert run_page_url("a b", base_url="https://af.example/prefix/") == "https://af.example/prefix/eagleflow/runs/a%20b"
    assert EagleflowRunLink().name == "eagleflow run" and RUN_NAME_XCOM_KEY == "eagleflow_run_name"
    assert EagleflowRunLink().xcom_key == "_link_EagleflowRunLink"


@pytest.mark.parametrize("run_id", ["manual__2026-11-30T16:00:00+00:00"])
def test_fallback_without_params_uses_the_run_id_rule(run_id: str) -> None:
    from eagleflow.run.pipeline import run_name_from_run_id
    from operators.links import _run_name_from_context

    class FakeRuntimeTI:  # the one attribute the fallback needs from Airflow's RuntimeTaskInstance
        def __init__(self) -> None:
            self.run_id = run_id

        def get_template_context(self) -> dict:
            return {"params": {"run_name": ""}, "run_id": run_id}

    assert _run_name_from_context(FakeRuntimeTI()) == run_name_from_run_id(run_id)
    assert _run_name_from_context(object()) is None
