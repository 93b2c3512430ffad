"""Faults during extraction, each injected for real against a real reference engine over HTTP:
a writer slower than the engine (late dumps, "writer behind"), a NaN in the states, a hung engine
(SIGSTOP), a full disk (a small tmpfs), a SIGTERM to the extractor. Each test checks what the
user sees (manifest state and reason, the CLI's lines), that no finished row is lost or redone,
and that the retry completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from eagleflow.config import model_to_argv
from eagleflow.data.prepare import write_training_dataset
from eagleflow.engine.process import ServerInfo, stop_server
from eagleflow.engine.client import ServerGone
from eagleflow.extract.dump_wait import DiskFull
from eagleflow.extract.manifest import ShardManifest
from eagleflow.extract.sample_store import sample_path, validate
from eagleflow.extract.shard import EXIT_ENGINE_GONE, ShardExtractor
from extract_engines import AUX, HIDDEN, config, launch_engine, make_rows
from sglang_patch.dump_writer import RECORD_RESERVE_BYTES
from sglang_patch.handoff import read_writer_statuses
from sglang_patch.sample_file import sample_file_bytes

pytestmark = pytest.mark.e2e

SLOTS = len(AUX) + 1
WRITE_DELAY = 2.5  # seconds the slow engine's writer sleeps before each dump: longer than a pass may wait (2 s)
NAN_ROW = 14


@pytest.fixture(scope="module")
def rows() -> list[list[int]]:
    return make_rows(18, seed=3)


@pytest.fixture(scope="module")
def budget(rows: list[list[int]]) -> int:
    """Room for one dump of the largest row (and a little more): a second request must wait."""
    return int(1.2 * max(sample_file_bytes(len(r), SLOTS, HIDDEN) for r in rows))


@pytest.fixture(scope="module")
def slow_engine(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, budget: int) -> Iterator[ServerInfo]:
    """An engine whose disk is slower than its forward passes, with a small dump budget."""
    folder = tmp_path_factory.mktemp("slow-engine")
    info = launch_engine(
        random_tiny_model, folder / "dumps", folder / "server.log",
        "--dump-queue-bytes", str(budget), faults={"write_delay": WRITE_DELAY, "nan_row": [NAN_ROW]},
    )
    yield info
    stop_server(info.pid, grace=10)


def new_dataset(folder: Path, rows: list[list[int]]) -> Path:
    write_training_dataset(rows, [[1] * len(r) for r in rows], folder / "dataset")
    return folder / "dataset"


def identities(dataset: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (dataset / "hidden_states").glob("hs_*.safetensors")}


def writer_status(server: ServerInfo, settled: bool = False):
    """The engine's writer status; ``settled``: a snapshot taken from now on, with nothing pending."""
    asked = time.time()
    deadline = time.monotonic() + 30
    while True:
        (status,) = [s for s in read_writer_statuses(server.dump_dir) if s.pid == server.pid]
        if not settled or (status.updated > asked and not status.pending):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


class HealthWatch:
    """Polls ``/health`` and the writer's status in a thread: latency, answers, and whether the writer was full."""

    def __init__(self, server: ServerInfo, budget: int) -> None:
        self.server, self.budget = server, budget
        self.answers: list[tuple[int, float, bool]] = []  # (status, seconds, writer full at the time)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            status = writer_status(self.server)
            self.peak = max(self.peak, status.pending_bytes)
            started = time.monotonic()
            code = requests.get(f"{self.server.url}/health", timeout=60).status_code
            self.answers.append((code, time.monotonic() - started, status.pending_bytes > self.budget // 2))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_slow_writer_late_dumps_are_awaited_behind_ones_retried_and_the_engine_keeps_answering(
    tmp_path: Path, rows, slow_engine: ServerInfo, budget: int, random_tiny_model: Path, capsys
) -> None:
    dataset = new_dataset(tmp_path, rows)
    written_before = writer_status(slow_engine).written
    watch = HealthWatch(slow_engine, budget)
    try:
        report = ShardExtractor(config(dataset, slow_engine, random_tiny_model, "0:12", concurrency=4, dump_wait=2)).run()
    finally:
        watch.stop()
    out = capsys.readouterr().out
    assert (report.state, report.done, report.failed) == ("success", 12, []), out[-3000:]
    for row in range(12):
        assert validate(sample_path(dataset / "hidden_states", row), rows[row], SLOTS, HIDDEN).ok

    # Late dumps were waited for under their own rid; "writer behind" requests were sent again later.
    assert "waiting, not resending" in out and "writer behind" in out, out[-3000:]
    status = writer_status(slow_engine, settled=True)
    assert status.behind > 0
    # Every row's states were written exactly once: no row was sent again while its dump was queued,
    # so no GPU pass and no file was spent twice, and no orphan dump is left.
    assert status.written - written_before == 12
    assert not list(Path(slow_engine.dump_dir).glob("row*"))

    # The engine kept answering /health while its writer was full, and host memory held by queued
    # dumps never went past the budget (the writer's own accounting, which reserves before it allocates).
    assert watch.answers and all(code == 200 for code, _, _ in watch.answers), watch.answers
    assert any(full for _, _, full in watch.answers), "the writer was never behind: the test proves nothing"
    assert max(seconds for _, seconds, _ in watch.answers) < 4 * (2.0 + WRITE_DELAY), watch.answers
    assert watch.peak <= budget and status.peak_pending_bytes <= budget


def test_a_nan_in_the_states_is_never_published_and_the_retry_completes(
    tmp_path: Path, rows, slow_engine: ServerInfo, random_tiny_model: Path
) -> None:
    dataset = new_dataset(tmp_path, rows)
    cfg = config(dataset, slow_engine, random_tiny_model, "12:18", concurrency=2)
    report = ShardExtractor(cfg).run()
    assert report.state == "failed" and report.done == 5 and [f["row"] for f in report.failed] == [NAN_ROW]
    assert "non-finite values: 1 NaN, 0 Inf in slots [0]" in report.failed[0]["reason"]
    assert "attempts" not in report.failed[0]["reason"]  # the same input gives the same NaN: not retried
    assert not sample_path(dataset / "hidden_states", NAN_ROW).exists()
    kept = identities(dataset)

    again = ShardExtractor(cfg).run()  # the engine injects its NaN once: the retry completes
    assert (again.state, again.done, again.skipped) == ("success", 1, 5)
    assert {name: ident for name, ident in identities(dataset).items() if name in kept} == kept
    assert validate(sample_path(dataset / "hidden_states", NAN_ROW), rows[NAN_ROW], SLOTS, HIDDEN).ok


def test_sigterm_to_the_extractor_records_interrupted_and_the_rerun_resumes(
    tmp_path: Path, rows, slow_engine: ServerInfo, random_tiny_model: Path
) -> None:
    dataset = new_dataset(tmp_path, rows)
    cfg = config(dataset, slow_engine, random_tiny_model, "0:6", concurrency=2, progress_every=1)
    proc = subprocess.Popen([sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("rows: 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=30) == 1
    manifest = ShardManifest.read(dataset.parent / "shards" / "rows_0-6.json")
    assert manifest.state == "interrupted" and "signal 15" in manifest.error, manifest
    assert "interrupted; finished rows are kept" in rest
    kept = identities(dataset)
    assert 2 <= len(kept) < 6

    again = ShardExtractor(cfg).run()
    assert (again.state, again.skipped, again.done) == ("success", len(kept), 6 - len(kept))
    assert {name: ident for name, ident in identities(dataset).items() if name in kept} == kept


def test_a_second_extraction_of_a_running_shard_waits_then_refuses_naming_the_first_and_touches_nothing(
    tmp_path: Path, rows, slow_engine: ServerInfo, random_tiny_model: Path
) -> None:
    """A manual rerun while the task still runs: without the shard's lock its rows went out twice and
    its start-up clean-up deleted the first one's dumps in flight."""
    dataset = new_dataset(tmp_path, rows)
    # 12 rows at the slow writer's pace: the first holds the shard for ~25 s after its first row,
    # far longer than the second takes to start on a loaded machine.
    cfg = config(dataset, slow_engine, random_tiny_model, "0:12", concurrency=2, progress_every=1)
    written_before = writer_status(slow_engine, settled=True).written
    first = subprocess.Popen([sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg)], stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None
    for line in first.stdout:
        if line.startswith("rows: 1/"):
            break
    second = subprocess.run(
        [sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg.model_copy(update={"lock_wait": 1.0}))],
        capture_output=True, text=True, timeout=120,
    )
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"error: another extraction holds shard rows_0-12 of {dataset}: pid {first.pid} on " in second.stderr
    assert "waiting for the extraction that holds shard rows_0-12" in second.stdout and "Traceback" not in second.stderr
    first.stdout.read()
    assert first.wait(timeout=120) == 0
    manifest = ShardManifest.read(dataset.parent / "shards" / "rows_0-12.json")
    assert (manifest.state, manifest.done, manifest.failed) == ("success", 12, [])  # the refused run wrote nothing there
    assert writer_status(slow_engine, settled=True).written - written_before == 12  # each row's pass ran once
    again = ShardExtractor(cfg).run()  # and once it is done, the rerun finds every row complete
    assert (again.state, again.skipped, again.done) == ("success", 12, 0)


def test_a_hung_engine_stops_the_shard_naming_it_and_the_rerun_after_it_recovers_completes(
    tmp_path: Path, random_tiny_model: Path
) -> None:
    rows = make_rows(16, seed=4)
    dataset = new_dataset(tmp_path, rows)
    server = launch_engine(random_tiny_model, tmp_path / "dumps", tmp_path / "server.log")
    try:
        cfg = config(dataset, server, random_tiny_model, "0:16", concurrency=2, progress_every=1, request_timeout=3,
                     server_pid=server.pid)
        proc = subprocess.Popen([sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("rows: 4/"):
                break
        os.kill(server.pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
        hung_at = time.monotonic()
        try:
            rest = proc.stdout.read()
            assert proc.wait(timeout=60) == EXIT_ENGINE_GONE  # Airflow retries it on an engine that is up
            assert time.monotonic() - hung_at < 30
        finally:
            os.kill(server.pid, signal.SIGCONT)
        manifest = ShardManifest.read(dataset.parent / "shards" / "rows_0-16.json")
        assert manifest.state == "failed" and "hangs" in manifest.error and "/health" in manifest.error, manifest
        assert "hangs" in rest
        kept = identities(dataset)
        assert 4 <= len(kept) < 16

        again = ShardExtractor(cfg).run()
    finally:
        stop_server(server.pid, grace=10)
    assert (again.state, again.skipped, again.done) == ("success", len(kept), 16 - len(kept))
    assert {name: ident for name, ident in identities(dataset).items() if name in kept} == kept


def test_disk_full_mid_shard_fails_naming_folder_and_bytes_leaves_no_partial_file_and_the_retry_completes(
    tmp_path: Path, random_tiny_model: Path, small_tmpfs
) -> None:
    rows = make_rows(20, seed=5)
    disk = small_tmpfs("2m")
    dataset = new_dataset(disk, rows)
    server = launch_engine(random_tiny_model, disk / "dumps", tmp_path / "server.log")
    try:
        # Fill the disk so that about six rows fit beside what the engine's writer keeps free for its records.
        filler = disk / "filler"
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler.write_bytes(b"\0" * max(free - RECORD_RESERVE_BYTES - 6 * sample_file_bytes(40, SLOTS, HIDDEN), 0))
        cfg = config(dataset, server, random_tiny_model, "0:20", concurrency=2, server_pid=server.pid)
        with pytest.raises(DiskFull) as info:
            ShardExtractor(cfg).run()
        assert str(disk / "dumps") in info.value.reason and "bytes free" in info.value.reason
        manifest = ShardManifest.read(dataset.parent / "shards" / "rows_0-20.json")
        assert manifest.state == "failed" and "disk full" in manifest.error and str(disk / "dumps") in manifest.error
        assert "needs" in manifest.error and "bytes" in manifest.error
        hidden = dataset / "hidden_states"
        kept = identities(dataset)
        assert 1 <= len(kept) < 20
        assert sorted(p.name for p in hidden.iterdir()) == sorted(kept), "no partial or temp file"
        for name in kept:
            row = int(name[3:].split(".")[0])
            assert validate(hidden / name, rows[row], SLOTS, HIDDEN).ok

        filler.unlink()  # the user frees space; the retry completes without redoing anything
        again = ShardExtractor(cfg).run()
    finally:
        stop_server(server.pid, grace=10)
    assert (again.state, again.skipped, again.done) == ("success", len(kept), 20 - len(kept))
    assert {name: ident for name, ident in identities(dataset).items() if name in kept} == kept


def test_a_gone_engine_is_recorded_as_failed_with_the_reason(tmp_path: Path, random_tiny_model: Path) -> None:
    """The engine dies before the shard starts: nothing is marked done, the manifest names the reason."""
    rows = make_rows(3, seed=6)
    dataset = new_dataset(tmp_path, rows)
    server = launch_engine(random_tiny_model, tmp_path / "dumps", tmp_path / "server.log")
    stop_server(server.pid, grace=10)
    with pytest.raises(ServerGone):
        ShardExtractor(config(dataset, server, random_tiny_model, "0:3")).run()
    data = json.loads((dataset.parent / "shards" / "rows_0-3.json").read_text())
    assert data["state"] == "failed" and "refuses connections" in data["error"] and data["done"] == 0


def test_a_task_process_killed_outright_takes_its_step_with_it(
    tmp_path: Path, rows, slow_engine: ServerInfo, random_tiny_model: Path
) -> None:
    """The Airflow task process dies by SIGKILL (no on_kill): its step, in a session of its own,
    gets SIGTERM from the kernel (parent-death signal), records ``interrupted`` and exits."""
    dataset = new_dataset(tmp_path, rows)
    cfg = config(dataset, slow_engine, random_tiny_model, "0:6", concurrency=2, progress_every=1)
    task = textwrap.dedent(
        f"""
        from operators.step import EagleflowStepOperator
        EagleflowStepOperator(task_id="extract_shard", step="extract").run_step("extract", {model_to_argv(cfg)!r})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", task], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    manifest = dataset.parent / "shards" / "rows_0-6.json"
    deadline = time.monotonic() + 120
    while not (manifest.exists() and ShardManifest.read(manifest).done >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    while ShardManifest.read(manifest).state == "running":
        assert time.monotonic() < deadline + 30, ShardManifest.read(manifest)
        time.sleep(0.1)
    state = ShardManifest.read(manifest)
    assert state.state == "interrupted" and "signal 15" in state.error, state
