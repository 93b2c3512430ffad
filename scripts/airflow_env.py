"""A local Airflow for eagleflow: its settings, and its four components under one supervisor.

``make airflow`` (``scripts/airflow-standalone.sh``) and the real-scheduler test
(``tests/dags/test_scheduler.py``) both run Airflow through this module, so the test exercises
exactly what a user starts: our ``dags/`` and ``plugins/``, SQLite, LocalExecutor, the
api-server on 127.0.0.1.

It does what ``airflow standalone`` does (migrate the database; start scheduler, dag-processor,
triggerer and api-server; stop them together) with one difference: ``standalone`` starts the
scheduler and triggerer with their log servers, which in Airflow 3.3.2 bind every interface
(0.0.0.0:8793 / 8794, no host setting). With LocalExecutor the api-server reads task logs from
the local log folder, so here both run with ``--skip-serve-logs`` and nothing listens beyond
127.0.0.1.

Every process it starts, and everything those start (task processes, the engine a run
launches), carries ``EAGLEFLOW_AIRFLOW_SESSION=<id>`` in its environment; :meth:`stop` ends
exactly those process groups, by pid.

With :class:`CeleryBackends` (PostgreSQL and Redis, e.g. from ``scripts/backing_services.py``)
it runs the Celery deployment instead: the settings of ``docker/airflow.env``, the file the
compose files load, and the compose file's two workers (:func:`celery_components`): one on the
default queue, one on the GPU queue. ``tests/dags/test_celery.py`` runs it.

Run it: ``python scripts/airflow_env.py --home .airflow --port 8080`` (Ctrl-C stops all).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagleflow.deploy import GPU_QUEUE  # noqa: E402  (after the repo is on sys.path)
from eagleflow.engine.process import group_alive, pid_alive, process_tree  # noqa: E402

# The Airflow settings the Celery deployment shares on every machine (docker-compose.yaml loads it too).
DEPLOYMENT_SETTINGS = REPO / "docker" / "airflow.env"
SESSION_VAR = "EAGLEFLOW_AIRFLOW_SESSION"
ADMIN_USER = "admin"

# name -> airflow sub-command; log servers off (see the module docstring).
COMPONENTS: dict[str, list[str]] = {
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
    "api-server": ["api-server"],
}
STOP_GRACE_SECONDS = 20.0
LOG_TAIL_LINES = 40
# Task slots of each Celery worker here (the compose file's GPU worker: EAGLEFLOW_GPU_WORKER_CONCURRENCY).
CELERY_WORKER_CONCURRENCY = 2


@dataclass(frozen=True)
class CeleryBackends:
    """Where a Celery deployment keeps its metadata and sends its tasks.

    :param database_url: SQLAlchemy URL of the metadata database (PostgreSQL).
    :param result_backend: Celery's result backend (``db+postgresql://…``, the same database).
    :param broker_url: Celery broker (``redis://:password@host:port/0``).
    """

    database_url: str
    result_backend: str
    broker_url: str


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines of a Compose env file (``#`` comments, blank lines); refuses what Compose would rewrite."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.replace("_", "").isalnum() or any(c in value for c in "$\"'"):
            raise ValueError(f"{path}:{number}: expected a plain NAME=value line (no quotes, no $), got {raw!r}")
        values[name] = value
    return values


def celery_components(settings: dict[str, str]) -> dict[str, list[str]]:
    """The Celery deployment's components on one machine, as ``docker-compose.yaml`` starts them.

    One triggerer takes both queues: the compose file's second triggerer exists only to share
    the GPU worker's network and process namespaces, which one machine shares anyway. Celery
    workers get node names (two on one host) and no log server (the api-server reads the
    shared log folder), so nothing listens beyond 127.0.0.1.
    """
    default_queue = settings["AIRFLOW__OPERATORS__DEFAULT_QUEUE"]
    worker = ["celery", "worker", "--skip-serve-logs", "--concurrency", str(CELERY_WORKER_CONCURRENCY)]
    return {
        "scheduler": COMPONENTS["scheduler"],
        "dag-processor": COMPONENTS["dag-processor"],
        "triggerer": [*COMPONENTS["triggerer"], "--queues", f"{default_queue},{GPU_QUEUE}"],
        "api-server": COMPONENTS["api-server"],
        "worker": [*worker, "--queues", default_queue, "--celery-hostname", f"{default_queue}@%h"],
        "worker-gpu": [*worker, "--queues", GPU_QUEUE, "--celery-hostname", f"{GPU_QUEUE}@%h"],
    }


def airflow_env(
    home: Path,
    *,
    port: int = 8080,
    parallelism: int = 4,
    all_admins: bool = False,
    inherit_airflow_settings: bool = True,
    celery: CeleryBackends | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment every Airflow component (and so every task) runs with.

    :param home: AIRFLOW_HOME; holds the SQLite database, logs and the generated admin password.
    :param port: api-server port on 127.0.0.1 (tasks reach the execution API there too).
    :param parallelism: task slots of the LocalExecutor; small, as the machine has few cores.
    :param all_admins: no login, everyone is admin (tests and screenshots only).
    :param inherit_airflow_settings: keep ``AIRFLOW__*`` variables of the calling environment
        (a user's own overrides); tests turn this off so nothing of the test process leaks in.
    :param celery: run the Celery deployment's settings (``docker/airflow.env``) with these
        backends instead of LocalExecutor and SQLite.
    :param extra: more variables, applied last.
    """
    home = home.absolute()
    url = f"http://127.0.0.1:{port}"
    settings = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__PARALLELISM": str(parallelism),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": str(all_admins),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        # Tokens signed by the scheduler must verify in the api-server: one secret for all
        # components of this launch (a fresh one each launch; nothing outlives it).
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
        "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        "PYTHONUNBUFFERED": "1",
        SESSION_VAR: uuid.uuid4().hex,
    }
    if celery is None:
        settings.update(
            {
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                # The DAG has schedule=None, so unpaused only means "a triggered run starts".
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            }
        )
    else:
        settings.update(read_env_file(DEPLOYMENT_SETTINGS))
        settings.update(
            {
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": celery.database_url,
                "AIRFLOW__CELERY__RESULT_BACKEND": celery.result_backend,
                "AIRFLOW__CELERY__BROKER_URL": celery.broker_url,
            }
        )
    # The repo's caches, never the home folder (as the Makefile sets them).
    cache = REPO / ".cache"
    for name, value in {
        "HF_HOME": cache / "hf",
        "HF_DATASETS_CACHE": cache / "hf" / "datasets",
        "MPLCONFIGDIR": cache / "matplotlib",
        "HF_HUB_OFFLINE": "1",
    }.items():
        settings.setdefault(name, os.environ.get(name, str(value)))
    base = {
        k: v for k, v in os.environ.items() if inherit_airflow_settings or not k.startswith(("AIRFLOW__", "AIRFLOW_CONFIG"))
    }
    return {**base, **settings, **(extra or {})}


def airflow_command(*args: str) -> list[str]:
    """argv of ``airflow <args>`` in this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "airflow", *args]


def migrate_db(env: dict[str, str], timeout: float = 600.0) -> None:
    """``airflow db migrate``, then the deployment's pools (the DAG's GPU tasks run in pool ``gpu``).

    Raises with the failing command's last lines.
    """
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    for args in (("db", "migrate"), ("pools", "import", str(REPO / "docker" / "pools.json"))):
        done = subprocess.run(airflow_command(*args), env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-LOG_TAIL_LINES:])
            raise RuntimeError(f"airflow {' '.join(args)} failed (exit {done.returncode}):\n{tail}")


def session_processes(session: str) -> list[int]:
    """Pids of live processes whose environment carries ``EAGLEFLOW_AIRFLOW_SESSION=session``."""
    import psutil

    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(SESSION_VAR) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except psutil.Error:  # gone, or not ours to read
            continue
    return found


class AirflowProcesses:
    """Airflow's components of one AIRFLOW_HOME, as subprocesses.

    Each starts in its own session so :meth:`stop` can end it with everything it forked.
    Output goes to ``<log_dir>/<name>.log`` or, with ``echo``, also to stdout prefixed by name.

    :param env: from :func:`airflow_env`.
    :param log_dir: where each component's output is written.
    :param echo: also print every line, prefixed with the component's name.
    :param components: name -> ``airflow`` sub-command; default :data:`COMPONENTS` (LocalExecutor),
        :func:`celery_components` for the Celery deployment.
    """

    def __init__(
        self, env: dict[str, str], log_dir: Path, echo: bool = False, components: dict[str, list[str]] | None = None
    ) -> None:
        self.env = env
        self.log_dir = log_dir
        self.echo = echo
        self.components = components or COMPONENTS
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: list[int] = []
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['AIRFLOW__API__PORT']}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self) -> None:
        for name in self.components:
            self.start_component(name)

    def start_component(self, name: str) -> None:
        """Start one component (again, after :meth:`kill`); its output is appended to its log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(
            airflow_command(*self.components[name]),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.processes[name] = process
        thread = threading.Thread(target=self._copy_output, args=(name, process.stdout), daemon=True)
        thread.start()
        self._threads.append(thread)

    def kill_component(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one component and everything in its process group (a crash); return its pid."""
        process = self.processes[name]
        _signal_group(process.pid, sig)
        process.wait(timeout=60)
        return process.pid

    def kill(self, name: str, while_frozen: Callable[[], None] | None = None) -> list[int]:
        """SIGKILL a component and every process under it, as a lost machine would end them.

        Every process of the tree (a Celery worker's pool, its task processes and their step
        children, in whatever session) is stopped with SIGSTOP first, so nothing finishes or
        forks between the look and the kill; ``while_frozen`` runs at that moment (a test
        records what was finished). The component is then no longer supervised until
        :meth:`start_component`. Returns the pids killed.
        """
        process = self.processes.pop(name)
        tree: list[int] = []
        # Freeze until a pass finds nothing new: a fork in flight lands in the next pass.
        while new := [pid for pid in process_tree(process.pid) if pid not in tree]:
            for pid in new:
                _signal(pid, signal.SIGSTOP)
            tree += new
        if while_frozen is not None:
            while_frozen()
        for pid in tree:
            _signal(pid, signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.killed += tree
        return tree

    def _copy_output(self, name: str, stream: IO[bytes]) -> None:
        with open(self.log_path(name), "ab") as log:
            for line in stream:
                log.write(line)
                log.flush()
                if self.echo:
                    sys.stdout.write(f"{name:13} | {line.decode('utf-8', errors='replace')}")
                    sys.stdout.flush()

    def dead(self) -> dict[str, int]:
        """Components that exited, with their exit codes."""
        return {name: p.returncode for name, p in self.processes.items() if p.poll() is not None}

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path(name), encoding="utf-8", errors="replace") as handle:
                return "".join(deque(handle, maxlen=lines))
        except FileNotFoundError:
            return ""

    def describe_dead(self) -> str:
        return "\n".join(
            f"airflow {name} exited with code {code}; last lines of {self.log_path(name)}:\n{self.log_tail(name)}"
            for name, code in self.dead().items()
        )

    def wait_until_healthy(self, timeout: float = 240.0) -> None:
        """Wait for the api-server to answer and the scheduler, dag-processor and triggerer to heartbeat."""
        import requests

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.dead():
                raise RuntimeError(f"an Airflow component died while starting:\n{self.describe_dead()}")
            try:
                health = requests.get(f"{self.url}/api/v2/monitor/health", timeout=5).json()
                states = {k: v.get("status") for k, v in health.items() if isinstance(v, dict)}
                last = f"health: {states}"
                if states and all(s == "healthy" for s in states.values()):
                    return
            except (requests.RequestException, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(2)
        raise RuntimeError(f"Airflow at {self.url} not healthy within {timeout:.0f}s ({last})")

    def stop(self) -> list[int]:
        """End every component, then every process of this session still alive; return those pids.

        TERM first, so the scheduler can mark its tasks and the engine can exit cleanly; KILL
        whatever is still there after :data:`STOP_GRACE_SECONDS`.
        """
        pids = {p.pid for p in self.processes.values() if p.poll() is None}
        pids.update(session_processes(self.env[SESSION_VAR]))
        groups = set()
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        groups.discard(os.getpgrp())  # never our own group (the test runner's, the shell's)
        for group in groups:
            _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline:
            for process in self.processes.values():
                process.poll()
            if not any(group_alive(g) for g in groups) and not session_processes(self.env[SESSION_VAR]):
                break
            time.sleep(0.3)
        for group in groups:
            _signal_group(group, signal.SIGKILL)
        # Stragglers that were in our own group (none expected) get a KILL by pid.
        for pid in session_processes(self.env[SESSION_VAR]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.processes.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for thread in self._threads:
            thread.join(timeout=5)
        return sorted(pids)


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def password_file(home: Path) -> Path:
    """Where the simple auth manager writes the generated admin password (its default path)."""
    return home.absolute() / "simple_auth_manager_passwords.json.generated"


def login_banner(airflow: AirflowProcesses, home: Path, all_admins: bool) -> str:
    """How to reach the UI and log in."""
    lines = [f"Airflow UI: {airflow.url}  (DAG: eagleflow; Trigger opens the Params form)"]
    if all_admins:
        lines.append("No login: everyone is admin (--all-admins).")
    else:
        path = password_file(home)
        lines.append(f"Log in as '{ADMIN_USER}'; the generated password is in {path}")
        if path.exists():
            lines.append(f"  ({path.read_text().strip()})")
    lines.append(f"Components' logs: {airflow.log_dir}; Ctrl-C stops everything.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=REPO / ".airflow", help="AIRFLOW_HOME (default: <repo>/.airflow)")
    parser.add_argument("--port", type=int, default=8080, help="api-server port on 127.0.0.1")
    parser.add_argument("--parallelism", type=int, default=4, help="task slots")
    parser.add_argument("--all-admins", action="store_true", help="no login (local screenshots and tests only)")
    args = parser.parse_args(argv)

    env = airflow_env(args.home, port=args.port, parallelism=args.parallelism, all_admins=args.all_admins)
    print(f"[airflow] AIRFLOW_HOME={env['AIRFLOW_HOME']}; migrating the database", flush=True)
    migrate_db(env)
    airflow = AirflowProcesses(env, args.home.absolute() / "component-logs", echo=True)
    stopping = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    airflow.start()
    try:
        airflow.wait_until_healthy()
        print("\n" + login_banner(airflow, args.home, args.all_admins) + "\n", flush=True)
        while not stopping.wait(1.0):
            if airflow.dead():
                print(f"[airflow] a component stopped:\n{airflow.describe_dead()}", file=sys.stderr, flush=True)
                return 1
        return 0
    except RuntimeError as exc:
        print(f"[airflow] {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("[airflow] stopping all components", flush=True)
        airflow.stop()


if __name__ == "__main__":
    sys.exit(main())
