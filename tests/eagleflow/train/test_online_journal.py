"""The online feed's settle removes the dumps of its own requests, by rid, never another consumer's of the same row.

The dump folder is the engine's: an extraction of another run (or of this one) may hold dumps of the
same row numbers there. The engine here is gone (a dead port), as after the trainer's engine died:
its requests cannot be aborted, their files are removed all the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagleflow.engine.process import free_port
from eagleflow.files import atomic_write_json
from eagleflow.layout import FeedLayout
from eagleflow.train.online.journal import settle_journal
from sglang_patch.handoff import dump_path, error_path
from sglang_patch.request_ids import row_request_id


def test_the_settle_removes_every_journaled_rid_of_a_row_and_nothing_else(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: the engine is gone
    retried, latest, extraction = row_request_id(3), row_request_id(3), row_request_id(3)
    for rid in (retried, latest, extraction):
        dump_path(dumps, rid).write_bytes(b"a dump")
    error_path(dumps, retried).write_text("{}")
    layout = FeedLayout(tmp_path / "online")
    layout.root.mkdir()
    # An aborted retry of row 3 and its attempt under way, as the feed journals them: by rid.
    atomic_write_json(layout.journal, {rid: {"row": 3, "rid": rid, "url": url, "dump_dir": str(dumps)} for rid in (retried, latest)})
    assert settle_journal(layout, say=lambda _: None, wait=1.0) == 2
    assert sorted(p.name for p in dumps.iterdir()) == [dump_path(dumps, extraction).name], "the extraction's dump of row 3 stays"
    assert json.loads(layout.journal.read_text()) == {}
