"""Names that the DAG, the UI plugin and the multi-machine deployment (``docker/``) must agree on.

The DAG puts the server, readiness, extraction and training tasks on Celery queue
:data:`GPU_QUEUE` and in pool :data:`GPU_POOL`. ``docker/docker-compose.yaml`` starts a Celery
worker and a triggerer that consume :data:`GPU_QUEUE`, and its ``airflow-init`` creates
:data:`GPU_POOL` from ``docker/pools.json``; ``tests/docker/test_compose.py`` checks both sides.
A name changed here without the deployment fails that test instead of leaving tasks queued forever.
"""

from __future__ import annotations

# Celery queue of the machine with the GPUs (worker: `airflow celery worker --queues gpu`).
GPU_QUEUE = "gpu"

# Airflow pool of the GPU tasks; one slot, so one GPU task runs on the node at a time.
GPU_POOL = "gpu"

# Training on several nodes: the address the other GPU nodes reach this one at (its rendezvous
# store, when it is node-0); unset, the host's name.
NODE_ADDRESS_ENV = "EAGLEFLOW_NODE_ADDRESS"

# Where every container of the deployment sees the shared run folders (docs/design.md §3.6).
OUTPUT_ROOT_ENV = "EAGLEFLOW_OUTPUT_ROOT"

# In the GPU image the SGLang server needs its own interpreter (the image's Python, whose
# transformers SGLang pins), not the worker's, whose transformers speculators needs.
SGLANG_PYTHON_ENV = "EAGLEFLOW_SGLANG_PYTHON"

# The DAG's id: the UI plugin finds the DAG runs of a run folder under it.
DAG_ID = "eagleflow"

# The task that lists a run's drafters (its XCom: the drafter plan); the UI plugin counts a running run's drafters by it.
PLAN_DRAFTERS_TASK_ID = "plan_drafters"

# The XCom key under which the first task keeps its refusal of the run's Params, in its one sentence: the run's last
# task leads its message with it, and the UI plugin's list of runs shows it for a run that failed before its folder.
REFUSAL_XCOM = "eagleflow_refused"

# Where the UI plugin's pages live under the Airflow API server; the operators' "eagleflow run"
# button links there.
UI_PREFIX = "/eagleflow"


def run_page_path(run_name: str) -> str:
    """Path of a run's page under the API server: ``/eagleflow/runs/<name>`` (the name quoted)."""
    from urllib.parse import quote

    return f"{UI_PREFIX}/runs/{quote(run_name, safe='')}"
