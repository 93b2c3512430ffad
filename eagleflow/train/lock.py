"""One trainer per training folder: a :class:`~eagleflow.files.FolderLock` on ``<out>/.train.lock``.

Two trainers on one ``checkpoints/`` folder (an Airflow retry while a killed attempt's
speculators still runs, or a second run by hand) would overwrite each other's checkpoints and
metrics. The step takes the lock before it touches the folder; the speculators child inherits
the lock's file descriptor, so the lock stays held until the *whole* trainer is gone, even if
the step itself was killed first. A second trainer waits a little (a killed one needs seconds
to exit), then refuses, naming the process that holds the folder and its speculators child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagleflow.files import pid_alive
from eagleflow.files import FolderLock


class TrainFolderLock(FolderLock):
    """The lock of one training folder; :meth:`acquire` it, hand :attr:`fd` to the child, :meth:`release` it.

    :param path: the lock file (:attr:`eagleflow.layout.TrainLayout.lock`).
    :param wait_seconds: how long to wait for another holder before refusing.
    """

    def __init__(self, path: Path, wait_seconds: float) -> None:
        super().__init__(
            path, wait_seconds, holder="trainer", guarded=str(path.parent),
            why="Two trainers on one checkpoints/ folder would overwrite each other",
        )
        self.trainer_pid: int | None = None

    def record_trainer(self, pid: int) -> None:
        """Name the speculators child too: it may outlive this process, and it holds the lock then."""
        self.trainer_pid = pid
        self._record(keep_since=True)

    def holder_fields(self) -> dict[str, Any]:
        return {"trainer_pid": self.trainer_pid}

    def holder_text(self) -> str:
        text = super().holder_text()
        info = self.holder()
        if info.get("trainer_pid"):
            alive = "running" if pid_alive(int(info["trainer_pid"])) else "gone"
            text += f", its speculators process {info['trainer_pid']} ({alive})"
        return text
