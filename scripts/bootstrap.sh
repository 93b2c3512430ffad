#!/usr/bin/env bash
# Create .venv and install eagleflow's CPU environment (docs/design.md §8). Idempotent: a stamp
# file keyed on pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$PWD/.cache/pip}
export PIP_DISABLE_PIP_VERSION_CHECK=1

stamp="$VENV/.eagleflow-installed-$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"eagleflow needs Python 3.11, found {sys.version}"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

# uv installs in parallel (a third of pip's time here). Bytecode is left to the first import of
# each module (the import check below writes most of it): compiling all of site-packages up front
# cost 36 CPU-seconds, 12 s of a fresh clone's wall time, for files no process ever imports.
# Without uv (no index serves it), pip does it all; uv reads only PyPI, so where it cannot reach
# it (pip's configured mirrors can) pip takes over the step uv failed.
export UV_CACHE_DIR=${UV_CACHE_DIR:-$PWD/.cache/uv}
links=()
if pip install --quiet "uv==0.13.9" 2>/dev/null; then
  install() {
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" "$@" \
      || { echo "[bootstrap] uv could not install this step; pip tries it"; pip install --quiet "$@"; }
  }
  # uv does not read pip's configuration; the folders of wheels it names (a CPU torch's) are passed on.
  while read -r folder; do links+=(--find-links "$folder"); done < <(
    pip config list | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u)
else
  echo "[bootstrap] uv is not installable here; pip installs everything"
  install() { pip install --quiet "$@"; }
fi
echo "[bootstrap] installing torch 2.13.0 (CPU) first so nothing pulls a CUDA build"
install "${links[@]}" "torch==2.13.0"
echo "[bootstrap] installing eagleflow and its pinned dependencies"
install -e ".[dev]"
# speculators' metadata requires torchvision/torchaudio; PyPI's are CUDA builds that break
# `import transformers` on CPU. Its other requirements are in pyproject.toml, so --no-deps.
spec_pin=$(grep -o '"speculators==[^"]*"' pyproject.toml | tr -d '"')
echo "[bootstrap] installing $spec_pin without its torchvision/torchaudio requirements"
install --no-deps "$spec_pin"
for bad in torchvision torchaudio; do
  if "$VENV/bin/python" -m pip show --quiet "$bad" >/dev/null 2>&1; then
    echo "[bootstrap] removing $bad (CUDA wheel; breaks transformers on CPU)"
    pip uninstall --yes --quiet "$bad"
  fi
done
# Bytecode written even where PYTHONDONTWRITEBYTECODE is set, so later processes need not compile.
# Two imports at once, one per core (compiling is most of a fresh bootstrap's time): the training
# stack, and Airflow's servers, executors and task runner, which the suite's first minute would
# otherwise compile in several processes at once. Airflow's home is a throw-away folder: importing
# Airflow creates <home>/logs, by default ~/airflow/logs.
mkdir -p .cache
airflow_home=.cache/airflow-import-check
env -u PYTHONDONTWRITEBYTECODE AIRFLOW_HOME="$PWD/$airflow_home" "$VENV/bin/python" -c '
import airflow.sdk, airflow.cli.cli_parser, airflow.api_fastapi.app, airflow.dag_processing.manager
import airflow.jobs.scheduler_job_runner, airflow.jobs.triggerer_job_runner, airflow.executors.local_executor
import airflow.providers.celery.executors.celery_executor, airflow.sdk.execution_time.supervisor
import airflow.sdk.execution_time.task_runner' > "$airflow_home.log" 2>&1 &
airflow_check=$!
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c 'import speculators, speculators.train.trainer, transformers' \
  || { kill "$airflow_check" 2>/dev/null; echo "[bootstrap] the environment does not import; see above" >&2; exit 1; }
wait "$airflow_check" \
  || { cat "$airflow_home.log" >&2; echo "[bootstrap] Airflow does not import; see above" >&2; exit 1; }
rm -f "$VENV"/.eagleflow-installed-*
touch "$stamp"
echo "[bootstrap] environment ready in $VENV"
