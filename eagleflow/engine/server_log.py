"""An engine's log, read from outside: its tail, what is new since an offset, its newest start and last error.

``start_server`` (:mod:`eagleflow.engine.process`) appends each engine's output to one log, each start
behind :data:`START_MARKER` and its local time; the readiness sensor shows the new lines as it waits.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque

LOG_TAIL_LINES = 50
START_MARKER = "===== "  # start_server writes it before each engine's output


def log_tail(path: str | os.PathLike[str], lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except FileNotFoundError:
        return ""


def read_log_from(path: str | os.PathLike[str], offset: int, limit: int = 256_000) -> tuple[str, int]:
    """New text of a log since byte ``offset`` (at most ``limit`` bytes) and the next offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(limit)
    except FileNotFoundError:
        return "", offset
    # A full chunk ends at its last line end; one with no "\n" at all (a progress bar redrawn
    # with "\r") is taken whole, or the offset would never move past it.
    cut = (data.rfind(b"\n") + 1 or len(data)) if len(data) == limit else len(data)
    return data[:cut].decode("utf-8", errors="replace"), offset + cut


def last_start_offset(path: str | os.PathLike[str], window: int = 1 << 20) -> int:
    """Byte offset of the newest engine start in a log that several starts appended to.

    The readiness sensor shows the log from there, not the previous engine's lines. Only the
    last ``window`` bytes are searched; an older start shows from the window's beginning.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            start = max(size - window, 0)
            handle.seek(start)
            data = handle.read()
    except FileNotFoundError:
        return 0
    marker = data.rfind(START_MARKER.encode())
    return start + marker if marker >= 0 else start


def last_start_time(path: str | os.PathLike[str]) -> float | None:
    """When the newest engine start in the log began (epoch seconds, from its start line), None when unknown."""
    offset = last_start_offset(path)
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            line = handle.readline().decode("utf-8", errors="replace")
    except OSError:
        return None
    if not line.startswith(START_MARKER):
        return None
    try:  # start_server writes the local time, on this machine, as "%Y-%m-%d %H:%M:%S"
        return time.mktime(time.strptime(line[len(START_MARKER):len(START_MARKER) + 19], "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return None


# A traceback's last line (``safetensors_rust.SafetensorError: …``), ``error: …`` lines, SGLang's ``ERROR`` lines.
_ERROR_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b|.*\berror: |.*\bERROR\b)")


def engine_error_line(log_path: str | os.PathLike[str], limit: int = 500) -> str | None:
    """The engine's own last error line since its newest start in ``log_path`` (at most ``limit``
    characters), or None when it printed none: what a user needs first, instead of the whole traceback."""
    try:
        end = os.path.getsize(log_path)
    except OSError:
        return None
    text, _ = read_log_from(log_path, max(last_start_offset(log_path), end - 256_000))  # the end of a long log
    for line in reversed(text.splitlines()):
        if _ERROR_LINE.match(line):
            return line.strip() if len(line.strip()) <= limit else line.strip()[:limit] + "…"
    return None
