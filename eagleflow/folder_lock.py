"""One worker per folder (or per shard of one): an ``flock`` on a lock file that names its holder.

Two processes on the same work (an Airflow retry while a killed attempt still exits, a second run
by hand) would overwrite or delete each other's files. The lock is taken before the work is
touched; a second comer waits a little (a killed holder needs seconds to exit), then refuses with
a :class:`~eagleflow.errors.UserError` naming the process that holds it. The lock is the open
file's ``flock``: it goes when the holder's last file descriptor closes, however it ends (a child
that inherits the descriptor keeps it held). Training (:class:`eagleflow.train.lock.TrainFolderLock`)
and extraction (one lock per shard) use it.
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

from eagleflow.errors import UserError


class FolderLock:
    """The lock in ``path``; :meth:`acquire` it, :meth:`release` it (or let the process end).

    :param path: the lock file.
    :param wait_seconds: how long to wait for another holder before refusing.
    :param holder: what a holder is, for the messages: ``"trainer"``, ``"extraction"``.
    :param guarded: what the lock guards, for the messages (a folder, ``shard rows_0-2000 of …``).
    :param why: what two holders at once would do, for the refusal.
    """

    def __init__(self, path: Path, wait_seconds: float, *, holder: str, guarded: str, why: str) -> None:
        self.path, self.wait_seconds = path, wait_seconds
        self.holder_name, self.guarded, self.why = holder, guarded, why
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
                        f"another {self.holder_name} holds {self.guarded}: {self.holder_text()}; waited "
                        f"{self.wait_seconds:.0f}s. {self.why}: let it finish or stop it"
                    ) from None
                if not said:
                    print(f"waiting for the {self.holder_name} that holds {self.guarded} ({self.holder_text()})", flush=True)
                    said = True
                time.sleep(0.5)
        self.fd = fd
        self._record()

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # a child's inherited copy keeps the lock while it runs
            self.fd = -1

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def holder(self) -> dict[str, Any]:
        """What the holder wrote into the lock file (empty if unreadable)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def holder_text(self) -> str:
        """``pid N on HOST since … (its command line)``."""
        info = self.holder()
        if not info:
            return "a process that did not say which"
        return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')} ({info.get('command', '?')})"

    def holder_fields(self) -> dict[str, Any]:
        """Extra facts a subclass records about the holder."""
        return {}

    def _record(self, keep_since: bool = False) -> None:
        """Write who holds the lock into the lock file (through the locked descriptor)."""
        info = {
            "pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:300], **self.holder_fields(),
        }
        if keep_since:
            info["since"] = self.holder().get("since", info["since"])
        data = json.dumps(info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
