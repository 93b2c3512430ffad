"""The engine process seen from outside: start it, tell whether it is ready, stop it.

Shared by the Airflow operators (launch, readiness sensor and its trigger, teardown) and the
extractor, so "ready", "dead" and "stopped" mean one thing everywhere. No Airflow import.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from eagleflow.engine.server_log import START_MARKER, engine_error_line
from eagleflow.files import atomic_write_json, pid_alive

READY_PATH = "/health_generate"


def engine_label(name: str, url: str) -> str:
    """How logs and manifests name an engine: ``engine-1 at http://127.0.0.1:30001`` (the URL alone without a name)."""
    return f"{name} at {url}" if name else url


@dataclass(frozen=True)
class ServerInfo:
    """XCom payload of docs/design.md §3.5: which engine, where it answers and how to find its process."""

    url: str
    pid: int | None
    host: str
    log_path: str
    dump_dir: str
    name: str = "engine-0"
    sample_store: dict[str, Any] | None = None  # the run's Mooncake Store, when samples go through one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def store_json(self) -> str | None:
        """The sample store's address as the steps' ``--sample-store`` flag takes it (None: the dump folder)."""
        return json.dumps(self.sample_store, sort_keys=True) if self.sample_store else None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerInfo:
        return cls(**{f.name: data.get(f.name, None if f.default is MISSING else f.default) for f in fields(cls)})

    def describe(self) -> str:
        """``engine-1 at http://127.0.0.1:30001``: how logs and manifests name the engine."""
        return engine_label(self.name, self.url)

    @classmethod
    def at(cls, url: str, pid: int | None = None) -> ServerInfo:
        """An engine known by its URL, and by its process id when it runs on this machine."""
        return cls(url=url, pid=pid, host=socket.gethostname() if pid is not None else "", log_path="", dump_dir="")

    @property
    def is_local(self) -> bool:
        """Whether ``pid`` names a process on this machine (the triggerer may run elsewhere)."""
        return self.pid is not None and self.host == socket.gethostname()


class Readiness(str, enum.Enum):
    READY = "ready"
    STARTING = "starting"
    DEAD = "dead"


@dataclass(frozen=True)
class ReadinessCheck:
    state: Readiness
    message: str


def check_ready(server: ServerInfo, timeout: float = 5.0) -> ReadinessCheck:
    """One readiness probe: the process (when local) and ``GET /health_generate``.

    A refused connection or a 503 means "not yet" (warmup); a vanished process means dead.
    """
    import requests

    if server.is_local and not pid_alive(int(server.pid)):  # type: ignore[arg-type]
        return ReadinessCheck(Readiness.DEAD, f"engine process {server.pid} has exited")
    try:
        response = requests.get(server.url.rstrip("/") + READY_PATH, timeout=timeout)
    except requests.ConnectionError:
        return ReadinessCheck(Readiness.STARTING, "not accepting connections yet")
    except requests.Timeout:
        return ReadinessCheck(Readiness.STARTING, f"{READY_PATH} did not answer within {timeout:.0f}s")
    if response.status_code == 200:
        return ReadinessCheck(Readiness.READY, f"{READY_PATH} answered 200")
    return ReadinessCheck(Readiness.STARTING, f"{READY_PATH} answered {response.status_code}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_held(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server cannot listen on ``host:port``: ``port N on HOST is held by another process (pid P, name X)``,
    as far as psutil can tell who; None when the port is free."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closed one's TIME_WAIT is no hold
        try:
            sock.bind((host, port))
            return None
        except OSError:
            pass
    import psutil

    try:
        holders = [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid]
    except psutil.Error:
        holders = []
    holders.sort(key=lambda c: c.status != psutil.CONN_LISTEN)
    who = "psutil cannot tell which"
    if holders:
        who = f"pid {holders[0].pid}"
        with contextlib.suppress(psutil.Error):
            who += f", name {psutil.Process(holders[0].pid).name()}"
    return f"port {port} on {host} is held by another process ({who})"


def start_server(
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    state_path: Path,
    url: str,
    dump_dir: Path,
    name: str = "engine-0",
    *,
    owned: bool = False,
    sample_store: dict[str, Any] | None = None,
) -> ServerInfo:
    """Start engine ``name`` in its own session, its output appended to ``log_path``.

    Its own session: a killed Airflow task takes its process group down with it, and the
    server must outlive the launch task. The state file lets a later task (or a retry)
    find and reuse or stop it.

    :param owned: the engine is the calling step's own (evaluation's): the kernel sends it SIGTERM when this
        process dies, even by SIGKILL. Call from the main thread: the signal is tied to the starting thread.
    :param sample_store: the Mooncake Store the engine hands samples to (recorded with it).
    """
    parent = os.getpid()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    dump_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n{START_MARKER}{time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,
            close_fds=True,
            preexec_fn=(lambda: die_with_parent(signal.SIGTERM, parent)) if owned else None,
        )
    info = ServerInfo(
        url=url, pid=process.pid, host=socket.gethostname(), log_path=str(log_path), dump_dir=str(dump_dir), name=name,
        sample_store=sample_store,
    )
    atomic_write_json(state_path, info.as_dict())
    return info


@contextlib.contextmanager
def launch_lock(folder: Path) -> Iterator[None]:
    """One engine launch at a time per run folder (``.launch.lock`` in it): launches that run at
    once see each other's engines before choosing GPUs."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".launch.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def recorded_server(state_path: Path) -> ServerInfo | None:
    """The engine :func:`start_server` recorded in ``state_path`` (None: no record, or not a readable one)."""
    try:
        return ServerInfo.from_dict(json.loads(state_path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def running_server(state_path: Path) -> ServerInfo | None:
    """The engine recorded in ``state_path`` if it is still alive here and answering or warming up."""
    info = recorded_server(state_path)
    if info is None or not info.is_local or check_ready(info).state is Readiness.DEAD:
        return None
    return info


def stop_server(pid: int, grace: float = 30.0) -> str:
    """Stop the engine's whole process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if pid_alive(pid):
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            pgid = pid
        if pgid != pid:
            # Not a session leader, so not the engine start_server made: its pid was reused by
            # an unrelated process after the engine exited. Signalling its group could hit the
            # worker itself.
            return f"process {pid} is not the engine (pid reused; its group is {pgid}); nothing stopped"
    else:
        _reap(pid)
        # start_server made the engine a session leader, so its group id is its pid. The group
        # outlives a leader killed from outside (OOM killer, kill -9): its workers would keep
        # the GPUs. Linux does not reuse a pid while a group of that id exists.
        pgid = pid
        if not group_alive(pgid):
            return f"engine process {pid} had already exited"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid) and not group_alive(pgid):
            return f"engine process group {pgid} stopped with SIGTERM"
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: wait until the group is really gone, so the caller
    # (teardown, then a relaunch on the same GPUs/port) never races the dying processes.
    gone_by = time.monotonic() + 10.0
    while time.monotonic() < gone_by:
        _reap(pid)
        if not pid_alive(pid) and not group_alive(pgid):
            break
        time.sleep(0.05)
    return f"engine process group {pgid} did not stop within {grace:.0f}s; killed it"


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``."""
    import psutil

    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):  # gone meanwhile
            continue
    return members


def process_tree(root: int) -> list[int]:
    """``root`` (while alive) and every live process descended from it, whatever its session."""
    import psutil

    try:
        descendants = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    tree = [root] if pid_alive(root) else []
    return tree + [child.pid for child in descendants if pid_alive(child.pid)]


def die_with_parent(signum: int, parent_pid: int | None = None) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    A step runs in its own session, so a killed task's process group does not reach it; this
    does. When the parent is already gone (``parent_pid`` given and no longer our parent), the
    signal is sent at once. A no-op off Linux.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signum))  # 1 = PR_SET_PDEATHSIG
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)  # it died before the prctl took effect


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process of group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))  # zombies keep a group "alive" for kill()


def _reap(pid: int) -> None:
    """Collect the exit status when the engine is our own child (in-process test runs)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


class EngineGone(Exception):
    """The engine died or was not ready in time (``reason``); ``error``: its own last error line, if any."""

    def __init__(self, reason: str, error: str | None, log_path: str) -> None:
        self.reason, self.error, self.log_path = reason, error, log_path
        super().__init__(f"{reason}{f': {error}' if error else ''}" + (f" (whole log: {log_path})" if log_path else ""))


def wait_until_ready(server: ServerInfo, timeout: float, poll: float = 1.0) -> None:
    """Block until ``server`` is ready; raise :class:`EngineGone` if it dies or times out. For steps that need
    the engine themselves (evaluation, regeneration); the DAG's sensor polls with the same :func:`check_ready`."""
    deadline = time.monotonic() + timeout
    while True:
        check = check_ready(server)
        if check.state is Readiness.READY:
            return
        if check.state is Readiness.DEAD or time.monotonic() > deadline:
            why = "died" if check.state is Readiness.DEAD else f"was not ready within {timeout:.0f}s"
            error = engine_error_line(server.log_path) if server.log_path else None
            raise EngineGone(f"{why} ({check.message})", error, server.log_path)
        time.sleep(poll)


@contextlib.contextmanager
def interrupted_by_signals(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[list[int]]:
    """Inside, the first of ``signums`` (``on_kill`` sends SIGTERM) raises :class:`KeyboardInterrupt`, so ``finally``
    blocks (stopping an engine) run; later ones are only recorded, not cutting that short. Yields those received."""
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = {signum: signal.signal(signum, on_signal) for signum in signums}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
