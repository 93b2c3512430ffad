"""The per-shard manifest ``<run>/shards/rows_X-Y.json``: the one definition of its fields.

Written by the extractor (atomically, while it runs and when it ends); read by the UI plugin
and the demo summary. Light on purpose (no torch), so the API server can import it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json

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
        """Load a manifest; unknown keys (from a newer writer) are ignored."""
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
