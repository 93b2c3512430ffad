# syntax=docker/dockerfile:1
# The Mooncake Store's two servers for Param sample_transport=mooncake (docker/README.md, "Mooncake
# Store"): mooncake_master (which object is where, leases, space) and mooncake_http_metadata_server
# (where the store clients find each other's segments). Both come with Mooncake's CPU build: neither
# touches a GPU, and the samples stay in the segments of the engines that put them.
#
#   docker build -f docker/mooncake.Dockerfile -t eagleflow-mooncake .
#
# No default command and no EXPOSE: docker-compose.yaml gives each service its command, ports
# included, and publishes none of them.

# bookworm, not the tag's moving default: the Debian release the wheel and the libraries below are
# tested on (the CI machine's).
FROM python:3.11-slim-bookworm

# Must equal pyproject.toml's `mooncake` extra (tests/docker/test_compose.py checks it).
ARG MOONCAKE_VERSION=0.3.13.post1
# Any non-root uid; group 0 as in the other images.
ARG MOONCAKE_UID=50000

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# The master and the store client load libibverbs (even over TCP), libnuma and libcurl; the wheel
# bundles the rest. No version pins: Debian keeps only the newest build of a package in the index,
# so a pin breaks with the release's next security update.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*

# The import fails here, not at the first run, when a library above is missing.
RUN pip install --no-cache-dir "mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}" \
 && python -c "from mooncake.store import MooncakeDistributedStore" \
 && command -v mooncake_master mooncake_http_metadata_server \
 && useradd --no-log-init --uid "${MOONCAKE_UID}" --gid 0 --no-create-home mooncake

USER ${MOONCAKE_UID}:0
