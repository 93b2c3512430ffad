"""Atomic publication of files and folders: write beside the target, then rename over it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sglang_patch.file_mode import published_file_mode


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path in ``target``'s folder; on success fsync it and rename it to ``target``.

    The temporary name starts with ``.`` and ends with ``.tmp`` so no reader globbing for the
    final name ever sees a half-written file; on error the temporary file is removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(published_file_mode())  # mkstemp makes 0600; a published file is for every reader
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging folder beside ``target``; on success it replaces ``target`` whole.

    A reader sees the old folder or the complete new one, never a mix; on error the staging
    folder is removed and ``target`` is left as it was.
    """
    target = Path(target)
    staging = target.parent / f".{target.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``target`` atomically and return the target path."""
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)


def atomic_write_json(target: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON to ``target`` atomically."""
    return atomic_write_text(target, json.dumps(data, indent=2, sort_keys=True) + "\n")
