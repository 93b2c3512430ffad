"""The online feed's journal of requests in flight, and settling what a stopped trainer left in it.

Light (no torch): the training step settles the journal after its child exits, however it exited.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from eagleflow.engine import EngineClient
from eagleflow.files import atomic_write_json
from eagleflow.layout import FeedLayout
from sglang_patch.handoff import read_writer_statuses
from sglang_patch.request_ids import row_request_glob

SETTLE_WAIT_S = 30.0  # how long a left-over request's dump is awaited before it is removed anyway


def settle_journal(layout: FeedLayout, say: Callable[[str], None] = print, wait: float = SETTLE_WAIT_S) -> int:
    """Abort the requests an earlier trainer left in its journal and remove their dumps; return how many.

    A dump the engine's writer still holds is awaited (up to ``wait`` seconds) so it is removed
    once written, not left behind; a gone engine's requests are simply forgotten.
    """
    try:
        journal = json.loads(layout.journal.read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(journal, dict) or not journal:
        return 0
    clients: dict[str, EngineClient] = {}
    for entry in journal.values():
        client = clients.setdefault(entry["url"], EngineClient(entry["url"], request_timeout=10.0))
        client.abort(entry["rid"])
    deadline = time.monotonic() + wait
    for row, entry in journal.items():
        dump_dir, prefix = Path(entry["dump_dir"]), row_request_glob(int(row))[:-1]
        # Every attempt at the row (a retry's earlier rid too): wait while a live writer holds one, then remove them.
        while time.monotonic() < deadline and any(
            s.fresh and any(rid.startswith(prefix) for rid in s.pending) for s in read_writer_statuses(dump_dir)
        ):
            time.sleep(0.1)
        for leftover in dump_dir.glob(row_request_glob(int(row))):
            leftover.unlink(missing_ok=True)
    atomic_write_json(layout.journal, {})
    say(f"online feed: settled {len(journal)} request(s) an earlier trainer left (aborted, dumps removed)")
    return len(journal)
