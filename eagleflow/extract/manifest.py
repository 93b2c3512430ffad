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
    """What happened to one shard: docs/design.md §3.5's shard result plus per-row failures.

    ``state`` is one of :data:`STATES`; ``failed`` lists ``{"row", "reason"}``; ``error`` says why
    the shard is not ``success`` (rows failed, the engine went away, the disk is full, SIGTERM);
    ``engine`` names the engine of the latest attempt (``engine-1 at http://…``).

    ``done``, ``tokens``, ``bytes`` and ``seconds`` are the latest attempt's (what it extracted, how
    fast); ``skipped`` counts the rows it found complete. The shard's totals over every attempt
    are ``total_rows`` (= done + skipped), ``total_tokens`` and ``total_bytes``: this attempt's rows
    plus the skipped ones, whose token count and file size come from the headers the extractor
    validates before it skips a row. A reader that shows a shard's size uses the totals: after a
    resume or a cleared shard the attempt's own figures may be 0.
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
    total_tokens: int = 0
    total_bytes: int = 0

    @property
    def total_rows(self) -> int:
        """Rows of the shard complete on disk, over every attempt."""
        return self.done + self.skipped

    def count_complete(self, tokens: int, num_bytes: int, extracted: bool) -> None:
        """One more complete row: extracted by this attempt, or found complete (skipped)."""
        if extracted:
            self.done += 1
            self.tokens += tokens
            self.bytes += num_bytes
        else:
            self.skipped += 1
        self.total_tokens += tokens
        self.total_bytes += num_bytes

    def result(self, manifest_path: Path) -> dict[str, Any]:
        """The extract step's XCom (docs/design.md §3.5's shard result) plus the shard's totals."""
        return {
            "name": self.name, "done": self.done, "skipped": self.skipped, "failed": len(self.failed),
            "tokens": self.tokens, "bytes": self.bytes, "seconds": self.seconds, "manifest": str(manifest_path),
            "total_rows": self.total_rows, "total_tokens": self.total_tokens, "total_bytes": self.total_bytes,
        }

    def write(self, path: Path) -> None:
        """Publish atomically, stamped with the time of writing (``total_rows`` written for readers)."""
        self.updated = time.time()
        atomic_write_json(path, {**asdict(self), "total_rows": self.total_rows})

    @classmethod
    def read(cls, path: Path) -> ShardManifest:
        """Load a manifest; unknown keys (from a newer writer, or the derived ``total_rows``) are ignored.

        :raises ValueError: torn JSON, or JSON of another shape (naming the first field of a wrong type).
        """
        return cls.from_text(Path(path).read_text())

    @classmethod
    def from_text(cls, text: str) -> ShardManifest:
        """:meth:`read`'s parse and checks on a manifest's text (the run pages read it through their own guard)."""
        data = json.loads(text)
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
        if "total_tokens" not in values:  # written before totals were recorded: the best it knows is its attempt's
            values = {**values, "total_tokens": values.get("tokens", 0), "total_bytes": values.get("bytes", 0)}
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
