# syntax=docker/dockerfile:1
# eagleflow on the official Airflow image. Two targets, built from the repository root:
#
#   control     api-server, scheduler, dag-processor, triggerer: Airflow + the DAG, the operators,
#               the UI plugin and eagleflow's light dependencies (docker/requirements-control.txt).
#               No torch: these only parse the DAG, defer, and read run folders.
#   cpu-worker  the Celery worker for the default queue: control + the project's full pinned
#               dependencies with torch's CPU build, for the CPU steps (dataset stats, disk check,
#               dataset preparation, draft vocabulary, charts).
#
#   docker build -f docker/airflow.Dockerfile --target control    -t eagleflow-airflow .
#   docker build -f docker/airflow.Dockerfile --target cpu-worker -t eagleflow-airflow-cpu-worker .
#
# The GPU steps (SGLang, extraction, training) run in docker/sglang.Dockerfile instead.

ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11

FROM ${AIRFLOW_IMAGE} AS control

# Passed to every pip call so that nothing we add can move Airflow itself (the image's own rule).
ARG AIRFLOW_VERSION=3.3.2

# The image's own user (uid 50000, gid 0), by number so the host can resolve it.
USER 50000:0

COPY --chown=airflow:0 docker/requirements-control.txt /opt/eagleflow/requirements-control.txt
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" -r /opt/eagleflow/requirements-control.txt

# The project itself without its dependencies: the control plane imports eagleflow lazily and never
# reaches torch, transformers or speculators.
COPY --chown=airflow:0 pyproject.toml README.md /opt/eagleflow/src/
COPY --chown=airflow:0 eagleflow /opt/eagleflow/src/eagleflow
COPY --chown=airflow:0 operators /opt/eagleflow/src/operators
COPY --chown=airflow:0 sglang_patch /opt/eagleflow/src/sglang_patch
COPY --chown=airflow:0 plugins /opt/eagleflow/src/plugins
RUN pip install --no-cache-dir --no-deps /opt/eagleflow/src

# The DAG and the UI plugin go where Airflow looks by default; baked in so that every machine runs
# the same DAG as the operators installed next to it.
COPY --chown=airflow:0 dags /opt/airflow/dags
COPY --chown=airflow:0 plugins /opt/airflow/plugins
COPY --chown=airflow:0 docker/pools.json /opt/eagleflow/deploy/pools.json

ENV EAGLEFLOW_OUTPUT_ROOT=/opt/eagleflow/runs \
    PYTHONUNBUFFERED=1

# Fail the build, not the first DAG run, when an import is missing: import the packages and
# run every DAG file the way the dag-processor will.
RUN python -c "import airflow.sdk, eagleflow, eagleflow.deploy, operators, plugins, pydantic, yaml" \
 && python -c "import glob, runpy; [runpy.run_path(path) for path in glob.glob('/opt/airflow/dags/*.py')]"


FROM control AS cpu-worker

ARG AIRFLOW_VERSION=3.3.2
# Must equal pyproject.toml's torch pin (tests/docker/test_compose.py checks it).
ARG TORCH_VERSION=2.13.0

# torch first, from PyTorch's CPU index: PyPI's Linux wheel is the CUDA build (gigabytes of
# CUDA libraries a CPU worker never uses). The project's install below then finds it satisfied.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" /opt/eagleflow/src \
 && python -c "import torch, transformers, datasets, matplotlib, pandas, eagleflow.data.prepare"
