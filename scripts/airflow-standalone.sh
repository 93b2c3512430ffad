#!/usr/bin/env bash
# `make airflow`: the Airflow UI on 127.0.0.1:8080 with eagleflow's dags/ and plugins/, SQLite,
# LocalExecutor, ready to trigger the CPU demo from the DAG's Params form.
#
# First builds the demo inputs if missing (the trained tiny verifier and 120 synthetic
# conversations under .cache/demo/, cached), and exports EAGLEFLOW_DEMO_DIR so the form's
# defaults are the demo's (eagleflow/demo.py). Then scripts/airflow_env.py migrates the
# database and runs scheduler, dag-processor, triggerer and api-server together (what
# `airflow standalone` does, minus its log servers on 0.0.0.0) and prints how to log in.
#
# Environment: AIRFLOW_HOME (default <repo>/.airflow), EAGLEFLOW_DEMO_DIR (default
# <repo>/.cache/demo), EAGLEFLOW_AIRFLOW_PORT (default 8080). Extra arguments go to
# scripts/airflow_env.py (e.g. --parallelism 2). Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-$repo/.venv/bin/python}

export AIRFLOW_HOME=${AIRFLOW_HOME:-$repo/.airflow}
export EAGLEFLOW_DEMO_DIR=${EAGLEFLOW_DEMO_DIR:-$repo/.cache/demo}
# The eagleflow pages serve only this folder: the demo form's output root (eagleflow/demo.py).
export EAGLEFLOW_OUTPUT_ROOT=${EAGLEFLOW_OUTPUT_ROOT:-$EAGLEFLOW_DEMO_DIR/runs}
# Caches stay inside the repo and nothing reaches for a model hub (as the Makefile sets them).
export HF_HOME=${HF_HOME:-$repo/.cache/hf}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$repo/.cache/hf/datasets}
export MPLCONFIGDIR=${MPLCONFIGDIR:-$repo/.cache/matplotlib}
export HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1

echo "[airflow] demo inputs in $EAGLEFLOW_DEMO_DIR (built once: tiny verifier, 120 conversations)"
"$py" -c 'import sys; from eagleflow.demo import make_demo_inputs; print(make_demo_inputs(sys.argv[1]))' "$EAGLEFLOW_DEMO_DIR"

exec "$py" scripts/airflow_env.py --home "$AIRFLOW_HOME" --port "${EAGLEFLOW_AIRFLOW_PORT:-8080}" "$@"
