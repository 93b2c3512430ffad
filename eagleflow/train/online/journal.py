"""The online feed's journal of requests in flight, and settling what a stopped trainer left in it.

The journal names each request by its rid, and only those rids' files are removed: the dump folder
is the engine's, and an extraction (of this run or another) may have dumps of the same rows in it.

Light (no torch): the training step settles the journal after its child exits, however it exited.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from eagleflow.engine import HUNG_PROBE_SECONDS, EngineClient, ServerInfo, check_ready
from eagleflow.files import atomic_write_json
from eagleflow.layout import FeedLayout
from eagleflow.extract import HandOff, StoreUnreachable, handoff_for

SETTLE_WAIT_S = 30.0  # how long a left-over request's dump is awaited before it is removed anyway


def settle_journal(layout: FeedLayout, say: Callable[[str], None] = print, wait: float = SETTLE_WAIT_S) -> int:
    """Abort the requests an earlier trainer left in its journal and remove their dumps; return how many.

    A dump the engine's writer still holds is awaited (up to ``wait`` seconds) so it is removed
    once written, not left behind; a gone engine's requests are simply forgotten. The journal maps
    each entry (keyed by rid; by row in journals of earlier releases) to its ``rid``, ``url``, ``dump_dir`` and
    ``sample_store`` (the run's store, when the samples went through one: they are removed from there).
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
    for entry in journal.values():
        rid = str(entry["rid"])
        try:
            handoff = handoff_for(entry.get("dump_dir"), entry.get("sample_store"))
            while time.monotonic() < deadline and _may_still_come(handoff, rid, barrier):
                time.sleep(0.1)
            handoff.discard(rid)  # exactly this request's files (or keys): never a row's others
        except StoreUnreachable as exc:  # a gone master took its keys with it: nothing of this rid is left there
            say(f"online feed: {rid}: {exc}")
    atomic_write_json(layout.journal, {})
    say(f"online feed: settled {len(journal)} request(s) an earlier trainer left (aborted, dumps removed)")
    return len(journal)


def _may_still_come(handoff: HandOff, rid: str, barrier: float) -> bool:
    """A live writer holds the dump of ``rid``, or has not rewritten its status since ``barrier``."""
    live = [status for status in handoff.statuses() if status.fresh]
    return any(status.updated < barrier or rid in status.pending for status in live)
