"""TEST ONLY fault switches of the reference engine: faults injected for real, once across restarts.

``--fail-row N`` answers the first request for row N with a 500; ``--nan-row N`` puts a NaN into
the states of row N's first dump the writer accepts. A marker ``<dump_dir>/.{fail,nan}-row-N.injected``
records that a fault happened, so a restarted engine (a retry) serves the row normally.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from eagleflow.engine.reference.config import ReferenceEngineConfig
from eagleflow.engine.reference.protocol import RequestError
from eagleflow.files import atomic_write_text
from sglang_patch.request_ids import row_of_request_id

if TYPE_CHECKING:
    import torch


def fault_marker(dump_dir: str | os.PathLike[str], fault: str, row: int) -> Path:
    """The marker recording that ``--{fault}-row row`` injected its one fault (``fault``: fail, nan)."""
    return Path(dump_dir) / f".{fault}-row-{row}.injected"


class FaultSwitches:
    """The rows still to fail in this process (a marker left by an earlier process means done)."""

    def __init__(self, config: ReferenceEngineConfig) -> None:
        self.dump_dir = config.dump_dir
        self.fail_rows = {r for r in config.fail_row if not self._injected("fail", r)}
        self.nan_rows = {r for r in config.nan_row if not self._injected("nan", r)}

    def fail_request(self, rid: str) -> None:
        """Raise the injected 500 for a request of a ``--fail-row`` row."""
        row = row_of_request_id(rid)
        if row is None or row not in self.fail_rows:
            return
        self._record("fail", row, rid)
        raise RequestError(500, f"injected failure for row {row} (--fail-row)")

    def poison(self, rid: str, states: torch.Tensor) -> int | None:
        """Put a NaN into a ``--nan-row`` row's states; return that row (None when nothing was done)."""
        row = row_of_request_id(rid)
        if row is None or row not in self.nan_rows:
            return None
        states[0, 0, 0] = float("nan")
        return row

    def poison_taken(self, row: int, rid: str) -> None:
        """The writer accepted the poisoned dump (not "writer behind"): the fault has happened."""
        self.nan_rows.discard(row)
        self._record("nan", row, rid)
        print(f"TEST fault injection: NaN in the states of {rid} (--nan-row)", flush=True)

    def _injected(self, fault: str, row: int) -> bool:
        return self.dump_dir is not None and fault_marker(self.dump_dir, fault, row).exists()

    def _record(self, fault: str, row: int, rid: str) -> None:
        if self.dump_dir is not None and not fault_marker(self.dump_dir, fault, row).exists():
            atomic_write_text(fault_marker(self.dump_dir, fault, row), f"{rid}\n")
