"""One trainer per training folder: an ``flock`` on ``<out>/.train.lock`` that names its holder.

Two trainers on one ``checkpoints/`` folder (an Airflow retry while a killed attempt's
speculators still runs, or a second run by hand) would overwrite each other's checkpoints and
metrics. The step takes the lock before it touches the folder; the speculators child inherits
the lock's file descriptor, so the lock stays held until the *whole* trainer is gone, even if
the step itself was killed first. A second trainer waits a little (a killed one needs seconds
to exit), then refuses, naming the process that holds the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from eagleflow.engine.process import pid_alive
from eagleflow.errors import UserError


class TrainFolderLock:
    """The lock of one training folder; :meth:`acquire` it, hand :attr:`fd` to the child, :meth:`release` it.

    :param path: the lock file (:attr:`eagleflow.layout.TrainLayout.lock`).
    :param wait_seconds: how long to wait for another holder before refusing.
    """

    def __init__(self, path: Path, wait_seconds: float) -> None:
        self.path, self.wait_seconds = path, wait_seconds
        self.fd = -1

    def acquire(self) -> None:
        """Take the lock or raise :class:`UserError` naming the holder after ``wait_seconds``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_seconds
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise UserError(
                        f"another trainer holds {self.path.parent}: {self.holder_text()}; waited {self.wait_seconds:.0f}s. "
                        "Two trainers on one checkpoints/ folder would overwrite each other: let it finish or stop it"
                    ) from None
                if not said:
                    print(f"waiting for the trainer that holds {self.path.parent} ({self.holder_text()})", flush=True)
                    said = True
                time.sleep(0.5)
        self.fd = fd
        self._record(trainer_pid=None)

    def record_trainer(self, pid: int) -> None:
        """Name the speculators child too: it may outlive this process, and it holds the lock then."""
        self._record(trainer_pid=pid)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the child's inherited copy keeps the lock while it runs
            self.fd = -1

    def holder(self) -> dict[str, Any]:
        """What the holder wrote into the lock file (empty if unreadable)."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}

    def holder_text(self) -> str:
        info = self.holder()
        if not info:
            return "a process that did not say which"
        parts = [f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')} ({info.get('command', '?')})"]
        if info.get("trainer_pid"):
            alive = "running" if pid_alive(int(info["trainer_pid"])) else "gone"
            parts.append(f"its speculators process {info['trainer_pid']} ({alive})")
        return ", ".join(parts)

    def _record(self, trainer_pid: int | None) -> None:
        info = {
            "pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:300], "trainer_pid": trainer_pid,
        }
        if trainer_pid is not None:
            info["since"] = self.holder().get("since", info["since"])
        data = json.dumps(info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
