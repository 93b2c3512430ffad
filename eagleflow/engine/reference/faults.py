"""TEST ONLY faults of the reference engine, injected for real: never among its flags or in its ``--help``.

A test gives the engine process the environment variable ``EAGLEFLOW_TEST_FAULTS`` (:data:`FAULTS_ENV`):
a JSON object of :class:`EngineFaults`, or the path of a file holding one (an Airflow deployment under
test sets the path once; each test writes the file). Unset, or a path with no file, means no fault.
This module is the only reader. :func:`faults_env` builds the variable.

``fail_row`` answers the first request for each of its rows with a 500; ``nan_row`` puts a NaN into
the states of the row's first dump the writer accepts. A marker ``<dump_dir>/.{fail,nan}-row-N.injected``
records that a fault happened, so a restarted engine (a retry) serves the row normally.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagleflow.engine.reference.capture_faults import CaptureFault
from eagleflow.engine.reference.protocol import RequestError
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_text
from sglang_patch.request_ids import row_of_request_id

if TYPE_CHECKING:
    import torch

FAULTS_ENV = "EAGLEFLOW_TEST_FAULTS"


class EngineFaults(BaseModel):
    """What a test makes the reference engine get wrong (all off by default)."""

    model_config = ConfigDict(extra="forbid")

    fail_row: list[int] = Field(default_factory=list, description="rows whose first request (rid row{N}-…) answers 500")
    nan_row: list[int] = Field(default_factory=list, description="rows whose first accepted dump gets a NaN")
    write_delay: float = Field(0.0, ge=0, description="each dump write first sleeps this many seconds (a slow disk)")
    min_request_seconds: float = Field(
        0.0, ge=0, description="every captured /generate takes at least this long (a big model's prefill), so a test can act meanwhile"
    )
    forward_seconds: float = Field(
        0.0, ge=0, description="every captured forward holds the engine at least this long before its dump goes to the "
        "writer (a big model's prefill under way), so a test can abort a request mid-forward"
    )
    capture_fault: CaptureFault | None = Field(
        None, description="capture wrongly on purpose (capture_faults), so verify-capture can be shown catching it"
    )

    def announce(self) -> list[str]:
        """The log lines an engine prints at start for the faults it was given."""
        said = [f"TEST fault injection: {name} {value}" for name, value in self.model_dump(exclude_defaults=True).items()]
        return said


def faults_from_env(environ: Mapping[str, str] = os.environ) -> EngineFaults:
    """The faults ``EAGLEFLOW_TEST_FAULTS`` asks for (none when unset).

    :raises UserError: the value (or the file it names) is not a valid :class:`EngineFaults` object.
    """
    value = environ.get(FAULTS_ENV, "").strip()
    if not value:
        return EngineFaults()
    if not value.startswith("{"):
        path = Path(value)
        if not path.is_file():
            return EngineFaults()
        value = path.read_text(encoding="utf-8")
    try:
        return EngineFaults.model_validate(json.loads(value))
    except (ValueError, ValidationError) as exc:
        raise UserError(f"{FAULTS_ENV}: not a valid fault object ({exc})") from exc


def faults_env(**faults: Any) -> dict[str, str]:
    """``{EAGLEFLOW_TEST_FAULTS: ...}`` for an engine process's environment (checked here, so a typo fails the test)."""
    return {FAULTS_ENV: EngineFaults(**faults).model_dump_json(exclude_defaults=True)}


def fault_marker(dump_dir: str | os.PathLike[str], fault: str, row: int) -> Path:
    """The marker recording that ``{fault}_row`` injected its one fault at ``row`` (``fault``: fail, nan)."""
    return Path(dump_dir) / f".{fault}-row-{row}.injected"


class FaultSwitches:
    """The rows still to fail in this process (a marker left by an earlier process means done)."""

    def __init__(self, faults: EngineFaults, dump_dir: Path | None) -> None:
        self.settings, self.dump_dir = faults, dump_dir
        if faults.capture_fault and dump_dir is None:
            raise UserError(f"{FAULTS_ENV}: capture_fault needs capture (--dump-dir and --aux-layers)")
        self.fail_rows = {r for r in faults.fail_row if not self._injected("fail", r)}
        self.nan_rows = {r for r in faults.nan_row if not self._injected("nan", r)}

    def forward_capture_fault(self) -> CaptureFault | None:
        """At a captured forward's start: hold it ``forward_seconds``; the capture fault to apply, if any."""
        time.sleep(self.settings.forward_seconds)
        return self.settings.capture_fault

    def fail_request(self, rid: str) -> None:
        """Raise the injected 500 for a request of a ``fail_row`` row."""
        row = row_of_request_id(rid)
        if row is None or row not in self.fail_rows:
            return
        self._record("fail", row, rid)
        raise RequestError(500, f"injected failure for row {row} (fail_row)")

    def poison(self, rid: str, states: torch.Tensor) -> int | None:
        """Put a NaN into a ``nan_row`` row's states; return that row (None when nothing was done)."""
        row = row_of_request_id(rid)
        if row is None or row not in self.nan_rows:
            return None
        states[0, 0, 0] = float("nan")
        return row

    def poison_taken(self, row: int, rid: str) -> None:
        """The writer accepted the poisoned dump (not "writer behind"): the fault has happened."""
        self.nan_rows.discard(row)
        self._record("nan", row, rid)
        print(f"TEST fault injection: NaN in the states of {rid} (nan_row)", flush=True)

    def _injected(self, fault: str, row: int) -> bool:
        return self.dump_dir is not None and fault_marker(self.dump_dir, fault, row).exists()

    def _record(self, fault: str, row: int, rid: str) -> None:
        if self.dump_dir is not None and not fault_marker(self.dump_dir, fault, row).exists():
            atomic_write_text(fault_marker(self.dump_dir, fault, row), f"{rid}\n")
