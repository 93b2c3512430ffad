"""The per-shard manifest ``<run>/shards/rows_X-Y.json``: the one definition of its fields.

Written by the extractor (atomically, while it runs and when it ends); read by the UI plugin
and the demo summary. Light on purpose (no torch), so the API server can import it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)

# A shard's states. SUCCESS only when every row is complete and durable; INTERRUPTED when it was
# stopped (SIGTERM, Ctrl-C) and FAILED when rows failed or the shard stopped on an error, both
# with the reason in ``error``; RUNNING while an attempt works on it (or when it died unrecorded).
RUNNING, SUCCESS, FAILED, INTERRUPTED = "running", "success", "failed", "interrupted"
STATES = (RUNNING, SUCCESS, FAILED, INTERRUPTED)


@dataclass
class ShardManifest:
    """What happened to one shard: DESIGN.md §3.5's shard result plus per-row failures.

    ``state`` is one of :data:`STATES`; ``failed`` lists ``{"row", "reason"}``; ``error`` says why
    the shard is not ``success`` (rows failed, the engine went away, the disk is full, SIGTERM);
    ``engine`` names the engine of the latest attempt (``engine-1 at http://…``).
    """

    name: str
    start: int = 0
    end: int = 0
    state: str = RUNNING
    engine: str = ""
    done: int = 0
    skipped: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    updated: float | None = None

    def write(self, path: Path) -> None:
        """Publish atomically, stamped with the time of writing."""
        self.updated = time.time()
        atomic_write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> ShardManifest:
        """Load a manifest; unknown keys (from a newer writer) are ignored.

        :raises ValueError: torn JSON, or JSON of another shape (naming the first field of a wrong type).
        """
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        types = {f.name: str(f.type) for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in types}
        for key, value in values.items():
            kind = _KINDS.get(types[key])
            if kind is not None and not kind[1](value):
                raise ValueError(f"field {key!r} is {type(value).__name__} {str(value)[:60]!r}, not {kind[0]}")
        if "name" not in values:
            raise ValueError("no 'name' field")
        return cls(**values)


# What a field of each declared type may hold (the annotations are strings: __future__ annotations):
# a reader refuses a manifest of another shape rather than computing with it.
_KINDS = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", _is_int),
    "float": ("a finite number", _is_number),
    "float | None": ("a finite number or null", lambda v: v is None or _is_number(v)),
    "list[dict[str, Any]]": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(i, dict) for i in v)),
}
