"""Why the speculators child failed, for the step's last line (what the task summary shows).

The child's exit status says only that it failed; the cause is in what it printed or, online, in
what the feed recorded (``failed.json``: the engines gone past ``engine_wait``, a row they cannot
give, a full disk). :func:`failure_cause` finds it: the feed's record of this attempt, else the
child's own ``error: …`` line or the exception line of its last traceback, whichever came last
(torchrun's ``ChildFailedError`` only wraps a rank's, so it is passed over).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from eagleflow.errors import excerpt
from eagleflow.layout import FeedLayout, TrainLayout

TAIL_BYTES = 256 * 1024  # of this attempt's log: a traceback and what follows it fit many times over
CAUSE_CHARS = 600
ERROR_PREFIX = "error: "  # how eagleflow's steps, the child entry among them, say why they stop
_TRACEBACK = "Traceback (most recent call last):"  # also "Original Traceback …" of a data-loader worker
_RANK_PREFIX = re.compile(r"^\[(?:default)?(?:rank)?\d+\]:\s?")  # torchrun's per-rank prefix
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?::\s|:$|$)")  # ``ValueError: …``, or a bare ``KeyboardInterrupt``
_WRAPPERS = ("ChildFailedError",)


def log_lines(path: Path, start: int) -> list[str]:
    """The lines ``path`` got from byte ``start`` on (this attempt's), at most its last :data:`TAIL_BYTES`."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            begin = max(start, size - TAIL_BYTES)
            handle.seek(begin)
            data = handle.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if begin > start else lines  # cut mid-file: the first is a piece of a line


def last_error_line(lines: Iterable[str]) -> str | None:
    """The last ``error: …`` line, or exception line ending a traceback, of ``lines`` (None: neither)."""
    found: str | None = None
    in_traceback = False
    for raw in lines:
        line = _RANK_PREFIX.sub("", raw.rstrip())
        if line.endswith(_TRACEBACK):
            in_traceback = True
        elif in_traceback:
            if not line or line[0].isspace():
                continue  # its frames, their source lines and carets
            in_traceback = False
            if _EXCEPTION.match(line) and not line.split(":", 1)[0].endswith(_WRAPPERS):
                found = line
        elif line.startswith(ERROR_PREFIX):
            found = line[len(ERROR_PREFIX):]
    return excerpt(found, CAUSE_CHARS) if found else None


def feed_failure(folder: Path, since: float) -> str | None:
    """The online feed's recorded reason for stopping, when it stopped after ``since`` (``time.time()``)."""
    records = [FeedLayout(folder).failure, *sorted(FeedLayout(rank).failure for rank in folder.glob("rank-*"))]
    for path in records:  # one feed per rank under torchrun, each in its own folder
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("error") and float(record.get("time") or 0) >= since:
            return f"online feed stopped: {excerpt(record['error'], CAUSE_CHARS)}; a retry resumes from the last checkpoint"
    return None


def failure_cause(paths: TrainLayout, log_start: int, since: float, online: bool) -> str | None:
    """Why this attempt's child failed, in one line; None when nothing it left says.

    :param log_start: where this attempt's lines begin in ``train.log`` (earlier attempts' come before).
    :param since: when this attempt began: an older ``failed.json`` is an earlier attempt's.
    """
    return (feed_failure(paths.online, since) if online else None) or last_error_line(log_lines(paths.log, log_start))
