# syntax=docker/dockerfile:1
# The GPU machine: SGLang with eagleflow's capture hook, plus the Airflow Celery worker (queue
# "gpu") that launches the server, extracts hidden states and trains the drafter.
#
#   docker build -f docker/sglang.Dockerfile -t eagleflow-gpu-worker .
#
# Two Python environments live here, because SGLang and eagleflow pin different libraries:
# sglang 0.5.23 pins transformers==5.19.0 (and openai==2.8.0, torch==2.14.1), while eagleflow pins
# the transformers==5.16.1 it was tested with alongside speculators 0.9.0 (docs/design.md §8). Installing
# one set over the other would run the server or the trainer on versions nobody tested. The
# worker reuses the image's torch 2.14.1, the newest speculators 0.9.0 allows.
#
#   image Python ($EAGLEFLOW_SGLANG_PYTHON)  SGLang as the image ships it, plus sglang_patch (the
#                                           --forward-hooks factory) added by a .pth file.
#                                           Nothing of the image is upgraded or replaced.
#   /opt/eagleflow/venv                     Airflow's Celery worker and triggerer, eagleflow and
#                                           speculators with their own transformers. It sees the
#                                           image's site-packages, so it reuses the image's CUDA
#                                           torch; a constraint file pins torch, torchvision and
#                                           torchaudio to the image's builds so pip never
#                                           replaces them.
#
# The worker starts `python -m eagleflow ...` steps with its own interpreter (the venv) and the
# SGLang server with $EAGLEFLOW_SGLANG_PYTHON.

# Must carry the SGLang version of pyproject.toml's `sglang` extra and lie in the hook's supported
# range (sglang_patch/hook_spec.py); tests/docker/test_compose.py checks the first. The CUDA 13.0 build
# needs an NVIDIA driver >= 580 on the GPU node.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130

FROM ${SGLANG_IMAGE}

ARG SGLANG_VERSION=0.5.23
ARG AIRFLOW_VERSION=3.3.2
# Same uid as the Airflow images, group 0: files in the shared run folder stay writable by all.
ARG EAGLEFLOW_UID=50000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV EAGLEFLOW_SGLANG_PYTHON=/usr/bin/python3 \
    EAGLEFLOW_VENV=/opt/eagleflow/venv \
    EAGLEFLOW_OUTPUT_ROOT=/opt/eagleflow/runs \
    AIRFLOW_HOME=/opt/airflow \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# Mooncake's store client (Param sample_transport mooncake; the CUDA 13 build the requirement list
# pins) loads libibverbs and its mlx5 provider (even over TCP), libnuma and libcurl. SGLang's images
# ship them for their own Mooncake; installed here so that this image does not depend on it. No
# version pins: they follow the base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*

# 1. The worker side: a venv over the image's Python, torch family pinned to the image's builds.
# --without-pip: ensurepip may be missing from the image; the venv runs the image's pip module,
# which installs into the venv because that is the running interpreter's prefix.
RUN "${EAGLEFLOW_SGLANG_PYTHON}" -m venv --system-site-packages --without-pip "${EAGLEFLOW_VENV}" \
 && "${EAGLEFLOW_SGLANG_PYTHON}" -c "from importlib.metadata import version; print('\n'.join(f'{n}=={version(n)}' for n in ('torch', 'torchvision', 'torchaudio')))" > /opt/eagleflow/image-torch.txt \
 && cat /opt/eagleflow/image-torch.txt

# 2. The server side. The image must hold the SGLang version the hook supports; say so, not later.
COPY sglang_patch /opt/eagleflow/server/sglang_patch
RUN "${EAGLEFLOW_SGLANG_PYTHON}" -c "import sglang, sys; v = sglang.__version__; sys.exit(None if v == '${SGLANG_VERSION}' else f'base image has sglang {v}, this Dockerfile expects ${SGLANG_VERSION}: change SGLANG_IMAGE and SGLANG_VERSION together')" \
 && site_dir="$("${EAGLEFLOW_SGLANG_PYTHON}" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
 && echo /opt/eagleflow/server > "${site_dir}/eagleflow_sglang_patch.pth" \
 && "${EAGLEFLOW_SGLANG_PYTHON}" -c "import sglang_patch, sglang_patch.dump_writer"

# The capture hook puts samples into the Mooncake Store (sample_transport mooncake) from the server's
# Python: a Mooncake the image already has there stays (nothing of the image is replaced), an image
# without one gets the worker's pinned build, named once, in the requirement list.
COPY docker/requirements-gpu-worker.txt /opt/eagleflow/requirements-gpu-worker.txt
RUN "${EAGLEFLOW_VENV}/bin/python" -m pip install --no-cache-dir --constraint /opt/eagleflow/image-torch.txt \
      "apache-airflow[celery,postgres,fab]==${AIRFLOW_VERSION}" \
      --requirement /opt/eagleflow/requirements-gpu-worker.txt \
 && if ! "${EAGLEFLOW_SGLANG_PYTHON}" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mooncake') is None)"; then \
      "${EAGLEFLOW_SGLANG_PYTHON}" -m pip install --no-cache-dir "$(grep '^mooncake-transfer-engine' /opt/eagleflow/requirements-gpu-worker.txt)"; \
    fi

COPY pyproject.toml README.md /opt/eagleflow/src/
COPY eagleflow /opt/eagleflow/src/eagleflow
COPY operators /opt/eagleflow/src/operators
COPY sglang_patch /opt/eagleflow/src/sglang_patch
COPY plugins /opt/eagleflow/src/plugins
# --no-deps: they are all above, minus pyproject's torch pin (the CPU build's), which the image's
# CUDA torch replaces. --ignore-requires-python: the project is pinned to the 3.11 of the CPU
# environment; the image's Python may be newer and the code does not depend on the difference.
RUN "${EAGLEFLOW_VENV}/bin/python" -m pip install --no-cache-dir --no-deps --ignore-requires-python /opt/eagleflow/src \
 && ln -s "${EAGLEFLOW_VENV}/bin/airflow" /usr/local/bin/airflow \
 && ln -s "${EAGLEFLOW_VENV}/bin/eagleflow" /usr/local/bin/eagleflow

# Both sides import, and the server side still has the transformers SGLang was released with.
RUN "${EAGLEFLOW_VENV}/bin/python" -c "import torch, transformers, speculators, airflow.sdk, eagleflow, operators, sglang_patch; print('worker: torch', torch.__version__, 'transformers', transformers.__version__)" \
 && "${EAGLEFLOW_SGLANG_PYTHON}" -c "import sglang, transformers, sglang_patch; print('server: sglang', sglang.__version__, 'transformers', transformers.__version__)"

# 3. Airflow layout, a non-root user and a writable HOME (Triton and FlashInfer cache kernels there).
COPY dags /opt/airflow/dags
RUN useradd --uid "${EAGLEFLOW_UID}" --gid 0 --create-home --home-dir /home/eagleflow eagleflow \
 && mkdir -p /opt/airflow/logs /opt/eagleflow/runs /opt/eagleflow/models \
 && chown -R "${EAGLEFLOW_UID}:0" /opt/airflow /opt/eagleflow/runs /home/eagleflow \
 && chmod -R g+rwX /opt/airflow /opt/eagleflow/runs /home/eagleflow

ENV HOME=/home/eagleflow
WORKDIR /home/eagleflow
USER ${EAGLEFLOW_UID}:0
# Workers load the DAG file to run its tasks: it must import here too.
RUN "${EAGLEFLOW_VENV}/bin/python" -c "import glob, runpy; [runpy.run_path(path) for path in glob.glob('/opt/airflow/dags/*.py')]"

CMD ["airflow", "celery", "worker", "--queues", "gpu"]
