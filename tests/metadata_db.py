"""One migrated Airflow metadata database for the whole suite, copied into each Airflow home a test makes."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"


def migrated_sqlite_db(home: Path) -> Path:
    """``home/airflow.db``: a copy of one SQLite metadata DB migrated once per Airflow release, with
    the deployment's pools imported (the DAG's GPU tasks run in pool ``gpu``).

    ``airflow db migrate`` costs tens of seconds of CPU; the suite needs a fresh database for every
    Airflow home it makes, so it copies one (built by the first worker to ask, the others wait).
    """
    import importlib.metadata
    import shutil
    import subprocess
    import sys

    from eagleflow.demo.tiny_model import build_lock

    pools = REPO / "docker" / "pools.json"
    template = CACHE / "airflow-db" / f"airflow-{importlib.metadata.version('apache-airflow')}-{pools.stat().st_mtime_ns}"
    if not (template / "done").exists():
        with build_lock(template):
            if not (template / "done").exists():
                shutil.rmtree(template, ignore_errors=True)
                template.mkdir(parents=True)
                env = {**os.environ, "AIRFLOW_HOME": str(template),
                       "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{template / 'airflow.db'}"}
                for args in (("db", "migrate"), ("pools", "import", str(pools))):
                    subprocess.run([sys.executable, "-m", "airflow", *args], env=env, check=True, capture_output=True, timeout=600)
                (template / "done").write_text("ok\n")
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template / "airflow.db", home / "airflow.db.tmp")
    os.replace(home / "airflow.db.tmp", home / "airflow.db")
    return home / "airflow.db"
