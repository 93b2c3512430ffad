"""A finished step whose inputs did not change finishes at once: its result is reused, and it says so.

Export, evaluation and the charts are minutes to hours of work that a clear in Airflow (a
complete shard cleared with its downstream tasks, or the other drafters' instances when one
drafter's training is cleared) would redo for nothing. Each of those steps records, beside its
result, what it was made from (:class:`MadeFrom`): its settings and the identity of each input
file (path, size, modification time). The next run of the step with the same record reuses the
result in one log line; a changed checkpoint, drafter, dataset or setting redoes the work, and
so does ``--redo-finished`` (Param ``redo_finished``).

Identity by size and modification time, not a content hash: hashing a checkpoint or a dataset
costs as much as reading it, and every writer here replaces files (atomic rename), which gives
them a new modification time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json

RECORD = ".made-from.json"


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

    def stored_inputs(self) -> dict[str, Any] | None:
        """What the folder's result (finished or under way) was made from, as recorded; None without a record."""
        try:
            stored = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        return stored.get("inputs") if isinstance(stored, dict) and isinstance(stored.get("inputs"), dict) else None

    def recorded_inputs(self) -> dict[str, Any]:
        """:attr:`inputs` as the record stores them (JSON: tuples become lists, paths strings)."""
        return json.loads(json.dumps(self.inputs, default=str))

    def changed(self, key: str) -> bool:
        """Whether input ``key`` differs from what the folder's recorded result was made from (no record: False)."""
        stored = self.stored_inputs()
        return stored is not None and stored.get(key) != self.recorded_inputs().get(key)

    def reusable(self, outputs: Iterable[Path]) -> dict[str, Any] | None:
        """The recorded result when it was made from these same inputs and its ``outputs`` are all there, else None."""
        try:
            stored = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("inputs") != self.recorded_inputs():
            return None
        if not all(Path(p).exists() for p in outputs):
            return None
        result = stored.get("result")
        return result if isinstance(result, dict) else None

    def reuse_or_none(self, outputs: Iterable[Path], redo: bool,
                      redo_with: str = "Param redo_finished, flag --redo-finished") -> dict[str, Any] | None:
        """The result to reuse (saying so in one line, with ``redo_with``: what makes it again), or None when the step
        must do its work."""
        if redo:
            self.record.unlink(missing_ok=True)
            return None
        result = self.reusable(outputs)
        if result is not None:
            print(
                f"{self.step}: reusing the finished result in {self.folder}: made from the same inputs and settings "
                f"({redo_with}, makes it again)",
                flush=True,
            )
        return result

    def save(self, result: Mapping[str, Any] | None) -> None:
        """Record that ``result`` was made from :attr:`inputs` (after the result itself is written); None: work under way
        on these inputs (a long step records them when it starts, so a later run knows what its partial work was made from)."""
        record = {"step": self.step, "inputs": self.recorded_inputs(), "result": dict(result) if result is not None else None}
        atomic_write_json(self.record, record)


def settings_of(config: Any, *leave_out: str) -> dict[str, Any]:
    """A step config's settings as JSON, less ``leave_out`` (the output folder, the redo switch)."""
    return {k: v for k, v in json.loads(config.model_dump_json()).items() if k not in leave_out}
