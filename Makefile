# eagleflow: `make test` and `make demo` are all a fresh machine with Python 3.11 needs.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Workers for the suite: most tests wait on engines, Airflow and subprocesses, so three keep 2 cores busy.
PYTEST_WORKERS ?= 3
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

# Keep every cache inside the repo's ignored folders, never in the home folder.
export HF_HOME := $(CURDIR)/.cache/hf
export HF_DATASETS_CACHE := $(CURDIR)/.cache/hf/datasets
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip
export MPLCONFIGDIR := $(CURDIR)/.cache/matplotlib
export HF_HUB_OFFLINE := 1
export PYTHONUNBUFFERED := 1
# The venv has no bytecode until first import (scripts/bootstrap.sh): let that import write it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv test test-fast demo airflow bench gpu-check clean

venv:
	@scripts/bootstrap.sh

## the whole suite (CI runs this through .ci/run)
test: venv
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

## the suite without the real-scheduler, Celery and end-to-end (mostly fault) tests
test-fast: venv
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not scheduler and not celery and not e2e" $(PYTEST_ARGS)

## the main job on CPU: tiny verifier, synthetic data, the whole DAG through Airflow
demo: venv
	$(PY) scripts/demo.py --compare

## Airflow UI on 127.0.0.1:8080 with our DAG and plugin
airflow: venv
	scripts/airflow-standalone.sh

## every benchmark, one table of figures, goals and pass/fail (about five minutes on 2 cores)
bench: venv
	$(PY) benchmarks/bench.py

## the figures only a CUDA GPU gives, in the same table; needs only PyTorch there (no venv, no network), says why it skips elsewhere
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) benchmarks/gpu_check.py

clean:
	rm -rf .cache .airflow .airflow-demo runs
