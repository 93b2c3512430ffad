"""PostgreSQL and Redis for a local CeleryExecutor Airflow, from the Debian packages.

The Celery deployment (``docker/docker-compose.yaml``) keeps Airflow's metadata in PostgreSQL
and sends tasks through Redis. ``tests/dags/test_celery.py`` runs the same on one machine:
this module starts a throw-away PostgreSQL cluster and a Redis server on free 127.0.0.1 ports,
each with a generated password, and stops them, reporting every pid they had so a caller can
check that none is left.

PostgreSQL refuses to run as root: as root, the cluster belongs to the ``postgres`` system user
(created by the Debian package) and every PostgreSQL program runs as that user; as anyone else,
as the caller. Install both with ``apt-get install postgresql redis-server`` (``.ci/run`` does).
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagleflow.engine.process import free_port, pid_alive, process_tree  # noqa: E402  (after the repo is on sys.path)

STOP_GRACE_SECONDS = 20.0
LOG_TAIL_LINES = 30


class ServiceError(RuntimeError):
    """A backing service could not be installed, started or reached; the message says which and why."""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on ``host:port``: a bind succeeds (closed connections' TIME_WAIT allowed)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class _Service:
    """One server process in its own session, its output in ``<folder>/<name>.log``."""

    name = "service"

    def __init__(self, port: int | None = None) -> None:
        self.folder = Path("/nonexistent")  # made by _make_folder when starting
        self.port = port or free_port()
        self.password = secrets.token_hex(16)  # letters and digits: it sits inside URLs
        self.process: subprocess.Popen[bytes] | None = None
        self.pids: set[int] = set()

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.name}.log"

    def _make_folder(self, owner: str | None = None) -> None:
        # Not under pytest's tmp folders: those are private to root, and the server's user must reach it.
        self.folder = Path(tempfile.mkdtemp(prefix=f"eagleflow-{self.name}-"))
        if owner:
            shutil.chown(self.folder, owner, owner)

    def _spawn(self, argv: list[str], user: str | None = None) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, user=user, env=_plain_env(),
            )
        self.pids.add(self.process.pid)

    def _fail(self, what: str) -> ServiceError:
        return ServiceError(f"{self.name} {what}; last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def _wait(self, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise self._fail(f"exited with code {self.process.returncode} while starting")
            if ready():
                self.pids.update(process_tree(self.process.pid))
                return
            time.sleep(0.2)
        raise self._fail(f"not ready on 127.0.0.1:{self.port} within {timeout:.0f}s")

    def stop(self, stop_signal: int = signal.SIGTERM) -> list[int]:
        """Stop the server and everything it forked (its signal, then SIGKILL); return every pid it had."""
        if self.process is None:
            return sorted(self.pids)
        self.pids.update(process_tree(self.process.pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, stop_signal)
        try:
            self.process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        # The session (= process group) holds whatever the server forked.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return sorted(self.pids)


class PostgresServer(_Service):
    """A PostgreSQL cluster in a temporary folder, with database ``airflow`` owned by user ``airflow``.

    :param port: TCP port on 127.0.0.1 (default: a free one).
    """

    name = "postgres"
    user_name = "airflow"
    database = "airflow"

    def __init__(self, port: int | None = None) -> None:
        self.bin = postgres_bin_dir()
        super().__init__(port)
        self.system_user = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``airflow`` database (psycopg2 driver, as the compose file uses)."""
        return f"postgresql+psycopg2://{self.user_name}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    @property
    def result_backend(self) -> str:
        """The same database as Celery's result backend."""
        return f"db+postgresql://{self.user_name}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, user=self.system_user, env={**_plain_env(), "PGPASSWORD": self.password},
            timeout=120, check=False,
        )
        if done.returncode != 0:
            raise ServiceError(f"{' '.join(argv[:2])} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")

    def start(self, timeout: float = 60.0) -> PostgresServer:
        """initdb, start the server on 127.0.0.1 only (no Unix socket), create the database."""
        self._make_folder(self.system_user)
        data = self.folder / "data"
        password_file = self.folder / "password"
        password_file.write_text(self.password + "\n")
        if self.system_user:
            shutil.chown(password_file, self.system_user, self.system_user)
        self._run(
            str(self.bin / "initdb"), "-D", str(data), "-U", self.user_name, "--pwfile", str(password_file),
            "--auth", "scram-sha-256", "--encoding", "UTF8", "--no-locale",
        )
        password_file.unlink()
        # A throw-away cluster: durability settings off, so migrations do not wait on fsync.
        self._spawn(
            [
                str(self.bin / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(self.port),
                "-c", "unix_socket_directories=", "-c", "fsync=off", "-c", "synchronous_commit=off",
                "-c", "full_page_writes=off", "-c", "max_connections=200",
            ],
            user=self.system_user,
        )
        self._wait(self._accepts_connections, timeout)
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user_name, self.database)
        return self

    def _accepts_connections(self) -> bool:
        done = subprocess.run(
            [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"], check=False, env=_plain_env()
        )
        return done.returncode == 0

    def stop(self, stop_signal: int = signal.SIGINT) -> list[int]:
        """Fast shutdown (SIGINT: disconnect clients, write nothing more), then remove the cluster."""
        try:
            return super().stop(stop_signal)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


class RedisServer(_Service):
    """A Redis server on 127.0.0.1 with a password and no persistence.

    :param port: TCP port on 127.0.0.1 (default: a free one).
    """

    name = "redis"

    def __init__(self, port: int | None = None) -> None:
        found = shutil.which("redis-server")
        if not found:
            raise ServiceError("redis-server not found: apt-get install redis-server (.ci/run installs it)")
        self.binary = found
        super().__init__(port)

    @property
    def url(self) -> str:
        """Celery broker URL (database 0), as the compose file writes it."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> RedisServer:
        """Start the server on 127.0.0.1 with a password, no snapshots, no append-only file."""
        self._make_folder()
        self._spawn(
            [
                self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--requirepass", self.password,
                "--save", "", "--appendonly", "no", "--dir", str(self.folder), "--daemonize", "no",
            ]
        )
        self._wait(self._answers_ping, timeout)
        return self

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                sock.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                answer = b""
                while answer.count(b"\r\n") < 2:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    answer += chunk
        except OSError:
            return False
        return answer == b"+OK\r\n+PONG\r\n"

    def stop(self, stop_signal: int = signal.SIGTERM) -> list[int]:
        try:
            return super().stop(stop_signal)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def postgres_bin_dir() -> Path:
    """The newest installed PostgreSQL's program folder (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise ServiceError("PostgreSQL not found: apt-get install postgresql (.ci/run installs it)")


def _plain_env() -> dict[str, str]:
    """A small environment for the servers: nothing of the caller's (Airflow settings, secrets) leaks in."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/"}
