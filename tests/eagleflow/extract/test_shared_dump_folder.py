"""One engine's dump folder shared by two runs, and an engine budget below one sample: for real.

Param ``server_dump_dir`` may name one folder for several runs, and an online trainer and an
extraction then ask the same engine for the same row numbers. An extractor starting there once
deleted the trainer's dumps by row (the trainer sent 7 rows again, logged as "the engine
restarted"); now it removes only the dumps of its own requests, by its journal of rids.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eagleflow.config import model_to_argv
from eagleflow.data.prepare import write_training_dataset
from eagleflow.engine.client import EngineClient
from eagleflow.engine.process import ServerInfo
from eagleflow.extract.sample_store import validate
from eagleflow.extract.shard import ShardExtractor
from extract_engines import AUX, HIDDEN, config, launch_engine, make_rows
from sglang_patch.handoff import dump_path, read_writer_statuses
from sglang_patch.request_ids import row_request_id

ROWS = 8
FORWARD_SECONDS = 0.4


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def writer_idle(dumps: Path) -> bool:
    statuses = read_writer_statuses(dumps)
    return bool(statuses) and all(s.updated > time.time() - 0.5 and not s.pending for s in statuses)


def identity(path: Path) -> tuple[int, int, int] | None:
    """The file as it is (None: gone)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def new_dataset(folder: Path, rows: list[list[int]]) -> Path:
    return write_training_dataset(rows, [[1] * len(r) for r in rows], folder / "dataset")


@pytest.fixture
def slow_engine(random_tiny_model: Path, tmp_path: Path, process_groups: list[int]) -> ServerInfo:
    # A slow forward (a big model's prefill): an extractor killed outright always has a request in one,
    # and its dump lands after the kill, for nobody.
    engine = launch_engine(
        random_tiny_model, tmp_path / "dumps", tmp_path / "engine.log", faults={"forward_seconds": FORWARD_SECONDS}
    )
    process_groups.append(engine.pid)
    return engine


def test_an_extractor_starting_on_a_shared_dump_folder_removes_only_its_own_dumps(
    tmp_path: Path, random_tiny_model: Path, slow_engine: ServerInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = make_rows(ROWS, seed=3)
    dumps = Path(slow_engine.dump_dir)

    # Run A, an online trainer of another run on this engine: rows 0-3 answered, their dumps not taken yet.
    client = EngineClient(slow_engine.url, request_timeout=60)
    theirs = []
    for row in range(4):
        rid = row_request_id(row)  # the rids the online feed sends, row numbers and all
        client.generate(row, rows[row], rid=rid)
        theirs.append(dump_path(dumps, rid))
    wait_for(lambda: all(p.exists() for p in theirs), "run A's dumps")
    before = {p: identity(p) for p in theirs}

    # Run B's extraction of the same row numbers, killed outright mid-shard.
    cfg = config(new_dataset(tmp_path / "run-b", rows), slow_engine, random_tiny_model, f"0:{ROWS}", concurrency=2, progress_every=1)
    proc = subprocess.Popen([sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("rows: 2/"):
            break
    proc.kill()
    proc.communicate(timeout=30)

    def left_behind() -> list[Path]:
        return sorted(set(dumps.glob("row*")) - set(theirs))

    # The request it had in a forward finishes there and is written, for nobody.
    wait_for(lambda: bool(left_behind()) and writer_idle(dumps), "the killed attempt's dumps")
    ours = left_behind()

    # Run B again: its start-up clean-up removes what its first attempt left, and nothing of run A's.
    report = ShardExtractor(cfg).run()
    assert (report.state, report.done + report.skipped) == ("success", ROWS)
    assert {p: identity(p) for p in theirs} == before, "run A's dumps are untouched, file for file"
    assert [p.name for p in ours if p.exists()] == []
    assert "removed the dumps of " in capsys.readouterr().out
    for row, dump in enumerate(theirs):  # and run A can still take each: a whole dump of its row
        assert validate(dump, rows[row], len(AUX) + 1, HIDDEN, trust_writer_verdict=True).ok
    assert sorted(dumps.glob("row*")) == sorted(theirs), "nothing of run B's is left"


def test_an_engine_budget_below_one_sample_is_said_in_units_that_show_it(
    tmp_path: Path, random_tiny_model: Path, process_groups: list[int]
) -> None:
    """The writer prints GB with two decimals: a 1000-byte budget read "needs 0.00 GB … budget of 0.00 GB"."""
    engine = launch_engine(random_tiny_model, tmp_path / "dumps", tmp_path / "engine.log", "--dump-queue-bytes=1000")
    process_groups.append(engine.pid)
    rows = make_rows(2, seed=4)
    report = ShardExtractor(config(new_dataset(tmp_path, rows), engine, random_tiny_model, "0:2")).run()
    assert report.state == "failed" and len(report.failed) == 2
    for failure in report.failed:
        reason = failure["reason"]
        said = re.fullmatch(
            r"engine reported: one request needs ([\d.]+) kB of dump buffer, more than the whole budget of 1\.0 kB: "
            r"raise the dump queue budget \(eagleflow Param dump_queue_gb\) to at least ([\d.]+) GB",
            reason,
        )
        assert said, reason
        needed_kb, param_gb = float(said.group(1)), float(said.group(2))
        assert needed_kb > 1.0 and param_gb * 1e9 >= needed_kb * 1e3 - 50, reason  # the Param suggested holds the request


def test_the_journal_keeps_only_what_may_still_land_and_refuses_a_request_once_closed(tmp_path: Path) -> None:
    from eagleflow.engine.client import RowFailed
    from eagleflow.extract.handoff_reader import FolderHandOff
    from eagleflow.extract.rid_journal import RidJournal

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    journal_path = tmp_path / "shards" / ".rows_0-8.rids"
    journal_path.parent.mkdir()
    killed, other = row_request_id(1), row_request_id(1)
    for rid in (killed, other):
        dump_path(dumps, rid).write_bytes(b"a dump")
    journal_path.write_text(f"{killed}\nrow2-0a1b")  # a killed attempt's, its last line torn mid-write

    journal = RidJournal(journal_path, FolderHandOff(dumps))
    assert journal.open() == 2
    assert sorted(p.name for p in dumps.iterdir()) == [dump_path(dumps, other).name], "another consumer's dump of row 1 stays"
    collected, aborted = row_request_id(3), row_request_id(4)
    for rid in (collected, aborted):
        journal.sent(rid)
    journal.collected(collected)
    journal.close()
    assert journal_path.read_text() == f"{aborted}\n", "an aborted request's dump may land later: the next start removes it"
    with pytest.raises(RowFailed, match="stopped"):
        journal.sent(row_request_id(5))

    again = RidJournal(journal_path, FolderHandOff(dumps))
    assert again.open() == 1
    again.close()
    assert not journal_path.exists(), "every dump collected: no journal left"
