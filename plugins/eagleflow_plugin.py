"""Airflow plugin: the eagleflow pages (run shards, charts, metrics) inside the Airflow UI.

Airflow imports every ``.py`` file of its plugins folder as a top-level module, so this file
works both when ``[core] plugins_folder`` points at this folder and when the project is
installed (then ``plugins.eagleflow_ui`` is importable as a package module).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from eagleflow.deploy import UI_PREFIX

try:
    from plugins.eagleflow_ui import create_app
except ImportError:  # only the plugins folder is on sys.path (Airflow adds it)
    from eagleflow_ui import create_app  # type: ignore[no-redef]


class EagleflowPlugin(AirflowPlugin):
    """Mounts the eagleflow app under ``/eagleflow``, adds "eagleflow runs" to the Browse menu and an "eagleflow run"
    tab to each DAG run's page.

    The tab is Airflow 3.3's DAG-run-level external view (``destination: "dag_run"``): Airflow fills ``{DAG_ID}`` and
    ``{RUN_ID}`` into its ``href`` and shows it in its frame beside the run's task instances; the route answers with
    the run folder's page. Airflow 3.3 has no way to show a view for one DAG only, so every DAG's runs get the tab;
    another DAG's run is told it has no eagleflow run folder.
    """

    name = "eagleflow"
    fastapi_apps = [{"app": create_app(), "url_prefix": UI_PREFIX, "name": "eagleflow runs"}]
    external_views = [
        {
            "name": "eagleflow runs",
            "href": f"{UI_PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "eagleflow",
        },
        {
            "name": "eagleflow run",
            "href": f"{UI_PREFIX}/dag-runs/{{DAG_ID}}/{{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "eagleflow-run",
        },
    ]
