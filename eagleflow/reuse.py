"""A finished step whose inputs did not change finishes at once: its result is reused, and it says so.

Export, evaluation and the charts are minutes to hours of work that a clear in Airflow (a
complete shard cleared with its downstream tasks, or the other drafters' instances when one
drafter's training is cleared) would redo for nothing. Each of those steps records, beside its
result, what it was made from (:class:`MadeFrom`): its settings and the identity of each input
file (path, size, modification time; a prepared dataset's rows by their content,
``eagleflow.data.dataset_files.dataset_fingerprint``), and the files the result consists of. The
next run of the step with the same record reuses the result in one log line, once it has checked
that those files are all there as they were written; a changed checkpoint, drafter, dataset or
setting redoes the work, and so does ``--redo-finished`` (Param ``redo_finished``), and a result
file gone, cut short or rewritten is made again, the line saying which.

Input files are identified by size and modification time, not a content hash: hashing a checkpoint
or hidden states costs as much as reading them, and every writer here replaces files (atomic
rename), which gives them a new modification time. A result's files up to :data:`HASHED_UP_TO`
bytes (JSON, vocabularies, charts) are recorded with a SHA-256 of their content, so one copied or
touched still counts as the same; larger ones (weights) by size and modification time, for the
same reason as the inputs: a deletion or a truncation changes the size, a rewrite the time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json

RECORD = ".made-from.json"
# A result file up to this size is recorded by content: milliseconds to hash. Above it (drafter
# weights, GBs) by size and modification time: hashing would cost a read of every byte per rerun.
HASHED_UP_TO = 16 << 20


def file_identities(paths: Iterable[Path], skip: Iterable[str] = ()) -> list[list[Any]]:
    """``[[path, size, mtime_ns], …]`` of each file in ``paths`` (folders walked, in order; ``skip``: sub-folder names)."""
    skipped = set(skip)
    found: list[list[Any]] = []
    for path in paths:
        path = Path(path).absolute()
        if path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in skipped)
                found += [_identity(Path(root) / name) for name in sorted(files) if name != RECORD]
        else:
            found.append(_identity(path))
    return found


def _identity(path: Path) -> list[Any]:
    try:
        stat = path.stat()
    except OSError:
        return [str(path), None, None]  # missing: differs from any file once there is one
    return [str(path), stat.st_size, stat.st_mtime_ns]


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@dataclass(frozen=True)
class MadeFrom:
    """What the result in ``folder`` is made from: ``inputs`` (settings and file identities), JSON-able."""

    step: str
    folder: Path
    inputs: Mapping[str, Any]
    record_name: str = RECORD  # several records in one folder (the dataset's vocabularies) each have their own

    @property
    def record(self) -> Path:
        return self.folder / self.record_name

    def _stored(self) -> dict[str, Any] | None:
        try:
            stored = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        return stored if isinstance(stored, dict) else None

    def stored_inputs(self) -> dict[str, Any] | None:
        """What the folder's result (finished or under way) was made from, as recorded; None without a record."""
        stored = self._stored() or {}
        return stored.get("inputs") if isinstance(stored.get("inputs"), dict) else None

    def recorded_inputs(self) -> dict[str, Any]:
        """:attr:`inputs` as the record stores them (JSON: tuples become lists, paths strings)."""
        return json.loads(json.dumps(self.inputs, default=str))

    def changed(self, key: str) -> bool:
        """Whether input ``key`` differs from what the folder's recorded result was made from (no record: False)."""
        stored = self.stored_inputs()
        return stored is not None and stored.get(key) != self.recorded_inputs().get(key)

    def reuse_or_none(self, redo: bool, redo_with: str = "Param redo_finished, flag --redo-finished") -> dict[str, Any] | None:
        """The result to reuse (saying so in one line, with ``redo_with``: what makes it again), or None when the step
        must do its work: no finished result, other inputs, ``redo``, or a file of the result that is not as recorded
        (said in one line)."""
        if redo:
            self.record.unlink(missing_ok=True)
            return None
        stored = self._stored()
        if stored is None or stored.get("inputs") != self.recorded_inputs() or not isinstance(stored.get("result"), dict):
            return None
        damage = self._damage(stored.get("outputs"))
        if damage:
            print(f"{self.step}: the finished result in {self.folder} is not as it was made: {damage}; making it again", flush=True)
            return None
        print(
            f"{self.step}: reusing the finished result in {self.folder}: made from the same inputs and settings, "
            f"its files as written ({redo_with}, makes it again)",
            flush=True,
        )
        return stored["result"]

    def save(self, result: Mapping[str, Any] | None, outputs: Iterable[Path] = ()) -> None:
        """Record that ``result`` was made from :attr:`inputs` (after the result itself is written), and what its
        ``outputs`` (the files and folders the result consists of) are, to be checked before it is reused; None: work
        under way on these inputs (a long step records them when it starts, so a later run knows what its partial work
        was made from)."""
        record: dict[str, Any] = {"step": self.step, "inputs": self.recorded_inputs(),
                                  "result": dict(result) if result is not None else None}
        if result is not None:
            record["outputs"] = [self._entry(path) for path in self._files(outputs)]
        atomic_write_json(self.record, record)

    def _files(self, outputs: Iterable[Path]) -> list[Path]:
        """Each file of ``outputs``, folders walked in order (the records beside them left out)."""
        files: list[Path] = []
        for path in map(Path, outputs):
            if path.is_dir():
                for root, dirs, names in os.walk(path):
                    dirs.sort()
                    files += [Path(root) / name for name in sorted(names) if not name.startswith(".made-from")]
            else:
                files.append(path)  # one missing is recorded as such: never reused, and said so
        return files

    def _name(self, path: Path) -> str:
        path, folder = path.absolute(), Path(self.folder).absolute()
        return str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)

    def _entry(self, path: Path) -> dict[str, Any]:
        try:
            stat = path.stat()
        except OSError:
            return {"path": self._name(path), "size": None}
        if stat.st_size <= HASHED_UP_TO:
            return {"path": self._name(path), "size": stat.st_size, "sha256": _sha256(path)}
        return {"path": self._name(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def _damage(self, recorded: Any) -> str | None:
        """How the result's files differ from the record, in words (the first difference, and how many more); None:
        all there as written."""
        if not isinstance(recorded, list) or not all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in recorded):
            return "its record does not list the result's files (written by an earlier eagleflow)"
        found = [why for why in map(self._differs, recorded) if why]
        if not found:
            return None
        more = f" (and {len(found) - 1} more of its {len(recorded)} files differ)" if len(found) > 1 else ""
        return found[0] + more

    def _differs(self, entry: dict[str, Any]) -> str | None:
        name = entry["path"]
        path = self.folder / name  # an absolute name stays itself
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if entry.get("size") is None:
            return f"{name} was missing when the result was made"
        if stat.st_size != entry["size"]:
            return f"{name} has {stat.st_size} bytes, {entry['size']} when it was made"
        if "sha256" in entry:
            return None if _sha256(path) == entry["sha256"] else f"{name} has other content than when it was made"
        if stat.st_mtime_ns != entry.get("mtime_ns"):
            return f"{name} was rewritten since it was made (modification time changed)"
        return None


def settings_of(config: Any, *leave_out: str) -> dict[str, Any]:
    """A step config's settings as JSON, less ``leave_out`` (the output folder, the redo switch)."""
    return {k: v for k, v in json.loads(config.model_dump_json()).items() if k not in leave_out}
