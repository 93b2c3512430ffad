"""Atomic publication of files and folders (write beside the target, then rename over it),
:class:`FolderLock`, one worker per folder, and :func:`open_under`, reading confined to a folder."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

from eagleflow.errors import UserError
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

    A reader sees the old folder or the complete new one, never a mix (:func:`replace_folder`);
    on error the staging folder is removed and ``target`` is left as it was. Staging folders of
    earlier processes that died mid-way (their pid gone) are removed first.
    """
    target = Path(target)
    remove_dead_siblings(target)
    staging = target.parent / f".{target.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_dead_siblings(target: Path) -> None:
    """Remove ``.<name>.staging-<pid>`` / ``.<name>.old-<pid>`` folders beside ``target`` whose process is gone."""
    if not target.parent.is_dir():
        return
    for sibling in target.parent.glob(f".{glob_escape(target.name)}.*-*"):
        kind, _, pid = sibling.name[len(target.name) + 2:].rpartition("-")
        if kind in ("staging", "old") and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (the owner of a staging folder or a lock, an engine)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's: it exists
        return True


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters taken literally."""
    import glob

    return glob.escape(name)


def replace_folder(staging: Path, target: Path) -> None:
    """Put the complete folder ``staging`` at ``target`` in one step, then delete what was there.

    On Linux the two are swapped by one ``renameat2(RENAME_EXCHANGE)``, so ``target`` is never
    missing; elsewhere (or on a filesystem without it) the old folder is renamed aside first,
    which leaves ``target`` absent for an instant but never mixed.
    """
    if not target.is_dir() or target.is_symlink():
        os.replace(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging)  # the old folder now lives under the staging name
        return
    aside = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(target, aside)
    os.replace(staging, target)
    shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically; False where the system offers no such call."""
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def atomic_write_text(target: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``target`` atomically and return the target path."""
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)


def atomic_write_json(target: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON to ``target`` atomically."""
    return atomic_write_text(target, json.dumps(data, indent=2, sort_keys=True) + "\n")


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Make a file's data (or a folder's entries) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurabilityBarrier:
    """Makes published files durable in a background thread; :meth:`wait` is the barrier.

    Files are published by rename without an fsync each (that halved extraction's speed);
    instead they are handed here as they land and fsynced while the next ones are written, and
    a step reports success only after :meth:`wait` returned.
    """

    def __init__(self) -> None:
        import queue
        import threading

        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._folders: set[Path] = set()
        self._errors: list[OSError] = []
        self._thread = threading.Thread(target=self._run, name="fsync", daemon=True)
        self._thread.start()

    def add(self, path: str | os.PathLike[str]) -> None:
        """Queue a published file (its folder's entry is synced at the barrier)."""
        path = Path(path)
        self._folders.add(path.parent)
        self._queue.put(path)

    def wait(self, extra: list[Path] | None = None) -> None:
        """Block until every queued file, each of ``extra`` and their folders are on disk; raise the first failure."""
        for path in extra or []:
            self.add(path)
        self._queue.join()
        for folder in sorted(self._folders):
            fsync_path(folder)
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        """Stop the thread (queued files are still synced first)."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                fsync_path(path)
            except OSError as exc:
                self._errors.append(exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()


class FolderLock:
    """One worker per folder (or per shard of one): an ``flock`` on the lock file ``path``, which names its holder.

    Two processes on the same work (an Airflow retry while a killed attempt still exits, a second
    run by hand) would overwrite or delete each other's files. The lock is taken before the work is
    touched; a second comer waits ``wait_seconds`` (a killed holder needs seconds to exit), then
    refuses with a :class:`UserError` naming the holder. It goes when the holder's last descriptor
    closes, however it ends (a child that inherits the descriptor keeps it held). Training
    (:class:`eagleflow.train.lock.TrainFolderLock`) and extraction (a lock per shard) use it.

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


# ---------------------------------------------------------------------------------------
# reading confined to a folder: what a reader for people (the run pages) may open

_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


class RefusedFile(Exception):
    """A file a confined reader does not open: ``reason`` says why, for people (never what lies outside)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def resolve_under(path: str | os.PathLike[str], root: Path) -> Path:
    """``path`` with every symlink followed, or RefusedFile when that lands outside ``root`` (a resolved folder).

    A link out, of the path or of any folder above it, is caught here and nothing beyond it is looked at.
    """
    try:
        real = Path(path).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise RefusedFile(Path(path), f"cannot be resolved ({exc})") from exc
    if not real.is_relative_to(root):
        raise RefusedFile(Path(path), f"resolves outside {root} (a symbolic link out of it)")
    return real


def stat_under(path: str | os.PathLike[str], root: Path, max_bytes: int | None = None) -> os.stat_result:
    """The status of the regular file ``path`` names, if it lies under ``root`` and holds at most ``max_bytes``.

    FileNotFoundError when nothing is there; RefusedFile when it resolves outside ``root``, is not a
    regular file (a device such as ``/dev/zero``, a FIFO, a socket or a folder: judged on its status, so
    it is never opened, which could block or never end) or is larger than ``max_bytes`` (its size said).
    """
    return _checked(path, root, max_bytes)[1]


def open_under(path: str | os.PathLike[str], root: Path, max_bytes: int | None = None) -> BinaryIO:
    """``path`` opened for reading after :func:`stat_under`'s checks, made again on the opened file.

    The resolved path is opened without following a link there and without blocking, and the open file
    must be the one checked: one swapped in between (a link, a FIFO) is refused, never read.
    """
    real, info = _checked(path, root, max_bytes)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino) or not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        raise RefusedFile(Path(path), "changed while it was being opened")
    return os.fdopen(fd, "rb")


def read_under(path: str | os.PathLike[str], root: Path, max_bytes: int, *, tail: bool = False) -> tuple[bytes, int]:
    """At most ``max_bytes`` of ``path`` (:func:`open_under`) and the file's size: all of it, or with ``tail``
    the last ``max_bytes`` of a larger file (a larger file without ``tail`` is RefusedFile)."""
    with open_under(path, root, None if tail else max_bytes) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            handle.seek(size - max_bytes)
        return handle.read(max_bytes), size


def _checked(path: str | os.PathLike[str], root: Path, max_bytes: int | None) -> tuple[Path, os.stat_result]:
    real = resolve_under(path, root)
    info = os.stat(real)
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _NOT_REGULAR if test(info.st_mode)), "something else")
        raise RefusedFile(Path(path), f"is {kind}, not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise RefusedFile(Path(path), f"is {size_text(info.st_size)}, over the bound of {size_text(max_bytes)}")
    return real, info


def size_text(num_bytes: int) -> str:
    """``209.7 MB``: a file size for people (decimal units)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} bytes"


def path_problem(path: Path, kind: Literal["file", "folder"]) -> str | None:
    """What is wrong with ``path`` as the ``kind`` a Param or flag names, in plain words; None when nothing is."""
    if not path.exists():
        return "does not exist"
    if kind == "file" and not path.is_file():
        return "is not a file"
    if kind == "folder" and not path.is_dir():
        return "is not a folder"
    return None
