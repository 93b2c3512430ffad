"""The online feed's journal of requests in flight, and settling what a stopped trainer left in it.

Light (no torch): the training step settles the journal after its child exits, however it exited.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from eagleflow.engine import HUNG_PROBE_SECONDS, EngineClient, ServerInfo, check_ready
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
    # An abort drops a request still waiting; one whose forward is under way runs on and hands its dump
    # to the writer only at the forward's end, after the abort. One generation through each engine
    # (/health_generate) waits such a forward out: the engine finishes a running forward before a later
    # one. From then on the writer's status, once rewritten, lists every dump still to come.
    for url in clients:
        check_ready(ServerInfo.at(url), timeout=min(wait, HUNG_PROBE_SECONDS))
    barrier = time.time()
    deadline = time.monotonic() + wait
    for row, entry in journal.items():
        dump_dir, prefix = Path(entry["dump_dir"]), row_request_glob(int(row))[:-1]
        while time.monotonic() < deadline and _may_still_come(dump_dir, prefix, barrier):
            time.sleep(0.1)
        for leftover in dump_dir.glob(row_request_glob(int(row))):
            leftover.unlink(missing_ok=True)
    atomic_write_json(layout.journal, {})
    say(f"online feed: settled {len(journal)} request(s) an earlier trainer left (aborted, dumps removed)")
    return len(journal)


def _may_still_come(dump_dir: Path, prefix: str, barrier: float) -> bool:
    """A live writer holds a dump of the row (any attempt at it: rids start with ``prefix``), or has not
    rewritten its status since ``barrier``."""
    live = [status for status in read_writer_statuses(dump_dir) if status.fresh]
    return any(status.updated < barrier or any(rid.startswith(prefix) for rid in status.pending) for status in live)
