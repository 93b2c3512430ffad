"""The engine process seen from outside (``eagleflow.engine.process``), with real processes and real HTTP.

The "engines" here are small real processes (``sleep``, a Python script that ignores SIGTERM)
and a tiny in-process HTTP server whose ``/health_generate`` status the test sets; the reference
engine itself is exercised end to end in ``tests/operators/test_server.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from eagleflow.engine.process import (
    group_members,
    READY_PATH,
    Readiness,
    ServerInfo,
    check_ready,
    free_port,
    pid_alive,
    running_server,
    start_server,
    stop_server,
)
from eagleflow.engine.server_log import LOG_TAIL_LINES, log_tail, read_log_from

HOST = socket.gethostname()

# An "engine" that starts a `sleep` in its own process group, records both pids, and optionally
# ignores SIGTERM (the ignore is inherited by the sleep across exec, so the whole group does).
ENGINE_SCRIPT = r"""
import signal, subprocess, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "300"])
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(child.pid))
import os; os.replace(sys.argv[2] + ".tmp", sys.argv[2])
print("engine up, child", child.pid, flush=True)
if sys.argv[1] == "leader-dies":
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(1)
"""




def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)




def exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def start_engine(tmp_path: Path, mode: str, process_groups: list[int]) -> tuple[ServerInfo, int]:
    """Start ``ENGINE_SCRIPT`` through :func:`start_server`; returns its info and its child's pid."""
    child_file = tmp_path / f"child-{mode}.pid"
    info = start_server(
        [sys.executable, "-c", ENGINE_SCRIPT, mode, str(child_file)],
        {},
        tmp_path / "server" / "server.log",
        tmp_path / "server" / "state.json",
        "http://127.0.0.1:9",
        tmp_path / "dumps",
    )
    process_groups.append(int(info.pid))
    wait_for(child_file.exists, 20, "the engine script's child")
    return info, int(child_file.read_text())


# ---- pid_alive ---------------------------------------------------------------------------------


def test_pid_alive_for_live_exited_and_zombie_processes() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(exited_pid())
    zombie = subprocess.Popen(["true"])
    wait_for(lambda: not pid_alive(zombie.pid), 10, "the child to become a zombie")
    # Not reaped yet: kill(pid, 0) still succeeds, but a zombie is not a running engine.
    os.kill(zombie.pid, 0)
    zombie.wait()


# ---- check_ready -------------------------------------------------------------------------------


def test_check_ready_follows_health_generate(health) -> None:
    info = ServerInfo(url=health.url + "/", pid=os.getpid(), host=HOST, log_path="", dump_dir="")
    health.status = 503
    check = check_ready(info)
    assert check.state is Readiness.STARTING and "503" in check.message
    health.status = 200
    assert check_ready(info).state is Readiness.READY
    assert health.requests == [READY_PATH, READY_PATH]  # the trailing "/" of the url is not doubled


def test_check_ready_refused_connection_is_not_ready_yet() -> None:
    info = ServerInfo(url=f"http://127.0.0.1:{free_port()}", pid=os.getpid(), host=HOST, log_path="", dump_dir="")
    check = check_ready(info)
    assert check.state is Readiness.STARTING
    assert "not accepting connections" in check.message


def test_check_ready_slow_answer_is_not_ready_yet(health) -> None:
    health.status, health.delay = 200, 2.0
    info = ServerInfo(url=health.url, pid=None, host="", log_path="", dump_dir="")
    check = check_ready(info, timeout=0.3)
    assert check.state is Readiness.STARTING
    assert "did not answer" in check.message


def test_check_ready_dead_local_pid_is_dead_without_asking_http(health) -> None:
    health.status = 200
    pid = exited_pid()
    check = check_ready(ServerInfo(url=health.url, pid=pid, host=HOST, log_path="", dump_dir=""))
    assert check.state is Readiness.DEAD
    assert str(pid) in check.message
    assert health.requests == []
    # A pid on another machine cannot be checked here: only HTTP counts.
    remote = ServerInfo(url=health.url, pid=pid, host="gpu-node-elsewhere", log_path="", dump_dir="")
    assert not remote.is_local
    assert check_ready(remote).state is Readiness.READY


# ---- logs --------------------------------------------------------------------------------------


def test_log_tail_returns_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert log_tail(log) == ""
    log.write_text("".join(f"line {i}\n" for i in range(200)))
    tail = log_tail(log)
    assert tail.splitlines() == [f"line {i}" for i in range(200 - LOG_TAIL_LINES, 200)]
    assert log_tail(log, 3) == "line 197\nline 198\nline 199\n"


def test_read_log_from_returns_new_text_and_the_next_offset(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert read_log_from(log, 7) == ("", 7)
    log.write_text("one\ntwo\n")
    text, offset = read_log_from(log, 0)
    assert (text, offset) == ("one\ntwo\n", 8)
    assert read_log_from(log, offset) == ("", 8)
    with open(log, "a") as handle:
        handle.write("three\n")
    assert read_log_from(log, offset) == ("three\n", 14)


def test_read_log_from_cuts_a_full_chunk_at_a_line_end(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("aaaa\nbbbb\ncccc\n")
    text, offset = read_log_from(log, 0, limit=12)
    assert (text, offset) == ("aaaa\nbbbb\n", 10)
    assert read_log_from(log, offset, limit=12) == ("cccc\n", 15)


def test_read_log_from_moves_past_a_line_longer_than_the_limit(tmp_path: Path) -> None:
    # Progress bars redraw with "\r" and no "\n": a weight-loading bar can be one huge "line".
    log = tmp_path / "server.log"
    log.write_text("\r".join(f"{i}%" for i in range(100)) + "\ndone\n")
    offset, pieces = 0, []
    for _ in range(200):
        text, offset = read_log_from(log, offset, limit=16)
        if not text:
            break
        pieces.append(text)
    assert "".join(pieces) == log.read_bytes().decode()


def test_free_port_is_bindable() -> None:
    port = free_port()
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", port))


# ---- start_server / running_server -------------------------------------------------------------


def test_start_server_own_session_log_and_state(tmp_path: Path, process_groups: list[int]) -> None:
    log, state = tmp_path / "server" / "server.log", tmp_path / "server" / "state.json"
    argv = [sys.executable, "-c", "import os; print('hello from', os.environ['ENGINE_FLAG']); import time; time.sleep(60)"]
    info = start_server(argv, {"ENGINE_FLAG": "x42"}, log, state, "http://127.0.0.1:1", tmp_path / "dumps")
    process_groups.append(int(info.pid))
    assert (tmp_path / "dumps").is_dir()
    assert info.host == HOST and info.is_local and info.log_path == str(log)
    # Its own session and group, so a killed Airflow task does not take the engine down.
    assert os.getsid(info.pid) == info.pid and os.getpgid(info.pid) == info.pid
    assert json.loads(state.read_text()) == info.as_dict()
    assert ServerInfo.from_dict(info.as_dict()) == info
    wait_for(lambda: "hello from x42" in log.read_text(), 20, "the engine's output in its log")
    assert "starting: " + " ".join(argv[:2]) in log.read_text()
    # running_server finds it (alive, not answering yet = warming up).
    assert running_server(state) == info
    stop_server(int(info.pid), grace=5)
    assert running_server(state) is None  # dead
    # A restart appends to the same log instead of losing the first run's lines.
    again = start_server(["true"], {}, log, state, "http://127.0.0.1:1", tmp_path / "dumps")
    process_groups.append(int(again.pid))
    assert log.read_text().count("starting: ") == 2


def test_running_server_ignores_missing_bad_and_foreign_state(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    assert running_server(state) is None
    state.write_text("{not json")
    assert running_server(state) is None
    state.write_text(json.dumps({"url": "http://x:1", "pid": os.getpid(), "host": "another-machine", "log_path": "", "dump_dir": ""}))
    assert running_server(state) is None  # its pid means nothing on this machine


# ---- stop_server -------------------------------------------------------------------------------


def test_stop_server_sigterm_stops_the_group(tmp_path: Path, process_groups: list[int]) -> None:
    info, child = start_engine(tmp_path, "obey-term", process_groups)
    started = time.monotonic()
    message = stop_server(int(info.pid), grace=20)
    assert "stopped with SIGTERM" in message
    assert time.monotonic() - started < 10
    assert not pid_alive(int(info.pid)) and not pid_alive(child)
    assert group_members(int(info.pid)) == []


def test_stop_server_kills_a_group_that_ignores_sigterm_after_the_grace(tmp_path: Path, process_groups: list[int]) -> None:
    info, child = start_engine(tmp_path, "ignore-term", process_groups)
    started = time.monotonic()
    message = stop_server(int(info.pid), grace=1.0)
    elapsed = time.monotonic() - started
    assert "did not stop within 1s; killed it" in message
    assert 1.0 <= elapsed < 8
    assert not pid_alive(int(info.pid)) and not pid_alive(child)
    assert group_members(int(info.pid)) == []


def test_stop_server_cleans_up_the_group_of_a_leader_that_already_died(tmp_path: Path, process_groups: list[int]) -> None:
    # An engine whose main process was killed (OOM killer, kill -9) can leave its workers
    # running in its group, still holding the GPUs: stopping must not stop at "already exited".
    info, child = start_engine(tmp_path, "leader-dies", process_groups)
    wait_for(lambda: not pid_alive(int(info.pid)), 20, "the leader to die")
    assert pid_alive(child)
    message = stop_server(int(info.pid), grace=5)
    assert not pid_alive(child), message
    assert group_members(int(info.pid)) == []


def test_stop_server_on_an_exited_engine_says_so() -> None:
    pid = exited_pid()
    assert stop_server(pid, grace=1) == f"engine process {pid} had already exited"


# A parent with two children, one in a session of its own (as a step starts its child); it
# prints the three pids and waits.
TREE_SCRIPT = r"""
import subprocess, sys, time
same = subprocess.Popen(["sleep", "60"])
own = subprocess.Popen(["sleep", "60"], start_new_session=True)
print(same.pid, own.pid, flush=True)
time.sleep(60)
"""


def test_process_tree_follows_children_into_their_own_sessions(process_groups: list[int]) -> None:
    from eagleflow.engine.process import process_tree

    parent = subprocess.Popen([sys.executable, "-c", TREE_SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    process_groups.append(parent.pid)
    assert parent.stdout is not None
    same, own = map(int, parent.stdout.readline().split())
    process_groups.append(own)
    assert sorted(process_tree(parent.pid)) == sorted([parent.pid, same, own])
    assert set(group_members(parent.pid)) == {parent.pid, same}  # the group alone misses the other session
    parent.kill()
    parent.wait()
    # The orphans are now init's: no longer under the (gone) parent.
    assert process_tree(parent.pid) == []
