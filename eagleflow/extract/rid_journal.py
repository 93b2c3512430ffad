"""Which dumps in a shared dump folder are one shard's own: the rids it sent, journaled before each is sent.

A dump folder is the engine's, and the engine may serve several consumers at once: the shards of
this run, an online trainer or the extraction of another run (Param ``server_dump_dir`` may name
one folder for several runs). A dump's name is its rid, ``row{N}-{12 hex}``
(:mod:`sglang_patch.request_ids`), which says the row but not whose request it was: the same row
numbers recur in every run. So the clean-up of what a killed or stopped attempt left behind goes by
this journal, never by row: only the rids the shard itself sent are removed.

The journal is ``shards/.rows_S-E.rids`` beside the shard's manifest (one extraction of a shard runs
at a time, under its lock): one rid a line, appended and flushed before the request goes out, so
a SIGKILL cannot lose one the engine may still answer. At the start the files of every journaled
rid are removed; at the end those of every rid not collected, and the journal keeps this attempt's
(an aborted forward may still deliver its dump after the shard ended: the next start removes it),
or is deleted when every dump was collected.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TextIO

from eagleflow.engine import RowFailed
from eagleflow.extract.handoff_reader import HandOff
from eagleflow.files import atomic_write_text
from sglang_patch.request_ids import rid_problem


class RidJournal:
    """The rids one shard sent through ``handoff`` (its dump folder or the run's store), kept in ``path``; see the module docstring."""

    def __init__(self, path: Path, handoff: HandOff) -> None:
        self.path, self.handoff = Path(path), handoff
        self._lock = threading.Lock()
        self._left: list[str] = []  # an earlier attempt's rids: removed at the start, and again at the end
        self._uncollected: set[str] = set()  # this attempt's rids whose dump was not collected
        self._handle: TextIO | None = None

    def open(self) -> int:
        """Remove the dump and error files of the rids an earlier attempt left; start journaling. Returns how many."""
        self._left = self._read()
        self._remove(self._left)
        # Kept in the file until the end: a forward of the killed attempt still under way may yet deliver.
        atomic_write_text(self.path, "".join(f"{rid}\n" for rid in self._left))
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        return len(self._left)

    def sent(self, rid: str) -> None:
        """``rid`` is about to be sent: journaled first.

        :raises RowFailed: the journal is closed (the shard stopped): the request must not go out.
        """
        with self._lock:
            if self._handle is None:
                raise RowFailed("stopped")
            self._uncollected.add(rid)
            self._handle.write(f"{rid}\n")
            self._handle.flush()  # in the kernel's hands: a SIGKILL of this process does not lose it

    def collected(self, rid: str) -> None:
        """``rid``'s dump was taken (published) and its files are gone."""
        with self._lock:
            self._uncollected.discard(rid)

    def close(self) -> None:
        """Remove the files of every rid not collected; the journal keeps this attempt's for the next start."""
        with self._lock:
            if self._handle is None:
                return  # never opened: the journal stays as the earlier attempt left it
            self._handle.close()
            self._handle = None
            left = sorted(self._uncollected)
        self._remove(self._left + left)
        if left:
            atomic_write_text(self.path, "".join(f"{rid}\n" for rid in left))
        else:
            self.path.unlink(missing_ok=True)

    def _read(self) -> list[str]:
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        # A torn last line (killed mid-write) names no file of ours; anything that is not a plain name is skipped.
        return sorted({line for line in lines if line and rid_problem(line) is None})

    def _remove(self, rids: list[str]) -> None:
        for rid in rids:
            self.handoff.discard(rid)
