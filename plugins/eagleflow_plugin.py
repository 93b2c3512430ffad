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
    """Mounts the eagleflow app under ``/eagleflow`` and adds "eagleflow runs" to the Browse menu."""

    name = "eagleflow"
    fastapi_apps = [{"app": create_app(), "url_prefix": UI_PREFIX, "name": "eagleflow runs"}]
    external_views = [
        {
            "name": "eagleflow runs",
            "href": f"{UI_PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "eagleflow",
        }
    ]
