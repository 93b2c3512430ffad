"""What the training step says when its folder's disk filled up: "no space", the folder, the bytes.

speculators does not say it itself: a full disk during ``torch.save`` of the optimizer state is
``RuntimeError: basic_ios::clear: iostream error``, and the step then only saw "speculators exited
with status 1" (or, when ``train.log`` itself could no longer be written, an ``OSError`` traceback
of its own). The disk is therefore judged from what is left on it: the next checkpoint does not
fit, or the log says so in the words the system uses.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections import deque
from pathlib import Path

from eagleflow.layout import TrainLayout
from eagleflow.train.resume import checkpoint_complete, epoch_dirs

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How the system, Python, Rust (safetensors) and torch say it, in the child's output.
_NO_SPACE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|StorageFull|\[Errno (?:28|122)\]")
LOG_TAIL_LINES = 200


def checkpoint_bytes(paths: TrainLayout) -> int:
    """Bytes of the newest finished checkpoint (0 before the first): what the next one needs about."""
    done = [path for epoch, path in sorted(epoch_dirs(paths.checkpoints).items()) if checkpoint_complete(path)]
    return sum(p.stat().st_size for p in done[-1].rglob("*") if p.is_file()) if done else 0


def said_no_space(log: Path) -> bool:
    """Whether the last lines of ``log`` say the disk is full."""
    try:
        with open(log, encoding="utf-8", errors="replace") as handle:
            return any(_NO_SPACE_TEXT.search(line) for line in deque(handle, maxlen=LOG_TAIL_LINES))
    except OSError:
        return False


def no_space_reason(paths: TrainLayout, force: bool = False) -> str | None:
    """"no space …" naming the folder and the bytes, when its disk is full (or ``force``: an ENOSPC was seen); else None."""
    folder = paths.checkpoints if paths.checkpoints.is_dir() else paths.root
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    needed = checkpoint_bytes(paths)
    if not (force or (needed and free < needed) or said_no_space(paths.log)):
        return None
    about = f", a checkpoint takes about {needed} bytes" if needed else ""
    return (
        f"no space left on the device of {folder}: {free} bytes free{about}. The checkpoints of finished epochs are "
        "kept; free space (or give --out a bigger disk) and rerun the step to resume"
    )


def child_failed_message(returncode: int, paths: TrainLayout, nodes: int = 1, cause: str | None = None) -> str:
    """The step's error when the speculators child exited with ``returncode``: the cause first (a full disk,
    else ``cause``: :func:`~eagleflow.train.failure.failure_cause`), the exit status after it."""
    said = f"speculators exited with status {returncode}; see {paths.log}"
    if nodes > 1:  # a peer that stopped makes the ranks here fail at their next collective
        said += f" and the other nodes' logs in {paths.node_log('node-1').parent}; a retry resumes from the last checkpoint"
    reason = no_space_reason(paths) or cause
    return f"{reason} ({said})" if reason else said
