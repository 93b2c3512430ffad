"""extract: rows -> engine -> validated hs_{row} files, with resume, retries and a fast stop.

The engine is the real reference engine in a subprocess, started and stopped with the same
functions the operators use (eagleflow.engine.process); the extractor speaks real HTTP to it. The
retry and dump-check rules are also pinned with an injected ``post=`` fake.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.config import model_to_argv
from eagleflow.data.prepare import write_training_dataset
from eagleflow.engine.process import ServerInfo, stop_server
from eagleflow.engine.client import EngineClient
from eagleflow.extract.completion import already_complete_message, complete_shard, incomplete_shards
from eagleflow.extract.sample_store import sample_path, validate, write_sample
from eagleflow.extract.manifest import ShardManifest
from eagleflow.extract.shard import EXIT_ENGINE_GONE, ShardExtractor
from eagleflow.layout import RunLayout
from eagleflow.results import find_result
from extract_engines import AUX, HIDDEN, ROWS, config, launch_engine, make_rows
from sglang_patch.dump_writer import DumpWriter


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    rows = make_rows(ROWS)
    path = tmp_path_factory.mktemp("run") / "dataset"
    write_training_dataset(rows, [[1] * len(r) for r in rows], path)
    return path, rows


@pytest.fixture(scope="module")
def engine(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    folder = tmp_path_factory.mktemp("engine")
    info = launch_engine(random_tiny_model, folder / "dumps", folder / "server.log", faults={"fail_row": [5]})
    yield info
    stop_server(info.pid, grace=10)


def test_shard_extracts_every_row_then_a_rerun_skips_them_without_reading_them(dataset, engine, random_tiny_model, capsys) -> None:
    path, rows = dataset
    report = ShardExtractor(config(path, engine, random_tiny_model, "6:24")).run()
    assert (report.done, report.skipped, report.failed, report.state) == (18, 0, [], "success")
    assert report.tokens == sum(len(r) for r in rows[6:24])
    for row in range(6, 24):
        assert validate(sample_path(path / "hidden_states", row), rows[row], len(AUX) + 1, HIDDEN).ok
    manifest = json.loads((path.parent / "shards" / "rows_6-24.json").read_text())
    assert manifest["done"] == 18 and manifest["state"] == "success" and manifest["bytes"] == report.bytes
    out = capsys.readouterr().out
    assert "rows: 5/18" in out and "tokens/s" in out and "MB/s" in out and "ETA" in out
    assert not list(Path(engine.dump_dir).glob("row*"))  # every dump was moved, none copied

    # A published file is complete by contract (docs/design.md §3.2): a rerun checks only its header
    # and token ids, never the states (hundreds of GB at full scale). A NaN planted in one file
    # after publication proves it: a full re-read would redo that row.
    planted = sample_path(path / "hidden_states", 7)
    tensors = load_file(planted)
    tensors["hidden_states"][0, 0, 0] = float("nan")
    save_file(tensors, planted)
    inodes = {row: sample_path(path / "hidden_states", row).stat() for row in range(6, 24)}
    client = CountingClient(engine.url, 60.0)
    again = ShardExtractor(config(path, engine, random_tiny_model, "6:24"), client=client).run()
    assert (again.done, again.skipped, again.failed, again.state) == (0, 18, [], "success")
    assert client.generated == 0  # not one request reached the engine
    # The shard's totals survive the resume: this attempt extracted nothing, yet the manifest and
    # the XCom still count every row's tokens and bytes (from the headers it checked to skip them).
    on_disk = sum(sample_path(path / "hidden_states", row).stat().st_size for row in range(6, 24))
    assert (again.tokens, again.bytes) == (0, 0)
    assert (again.total_rows, again.total_tokens, again.total_bytes) == (18, report.tokens, on_disk)
    assert (report.total_tokens, report.total_bytes) == (report.tokens, report.bytes)  # the first attempt did it all
    manifest = json.loads((path.parent / "shards" / "rows_6-24.json").read_text())
    assert (manifest["total_rows"], manifest["total_tokens"], manifest["total_bytes"]) == (18, report.tokens, on_disk)
    result = again.result(path.parent / "shards" / "rows_6-24.json")
    assert (result["tokens"], result["total_rows"], result["total_tokens"], result["total_bytes"]) == (0, 18, report.tokens, on_disk)
    for row, stat in inodes.items():
        now = sample_path(path / "hidden_states", row).stat()
        assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


def test_an_fp8_engine_writes_the_quantised_bf16_states_and_the_extractor_takes_only_fp8(
    dataset, engine, random_tiny_model, tmp_path: Path
) -> None:
    """The reference engine's dump writer quantises what it would store as bf16 (hs-connectors' bytes);
    an fp8 run redoes a row left in bf16 by an earlier run, instead of mixing storage dtypes."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    path, rows = dataset
    fp8_dataset = tmp_path / "run" / "dataset"
    first = 10
    ShardExtractor(config(path, engine, random_tiny_model, f"{first}:{first + 4}")).run()  # bf16 (skips rows done)
    write_training_dataset(rows[first : first + 4], [[1] * len(r) for r in rows[first : first + 4]], fp8_dataset)
    hidden = fp8_dataset / "hidden_states"
    write_sample(hidden, 0, torch.zeros(len(rows[first]), len(AUX) + 1, HIDDEN), torch.tensor(rows[first]))  # bf16 leftover
    fp8_engine = launch_engine(random_tiny_model, tmp_path / "dumps", tmp_path / "server.log", "--hidden-states-dtype", "fp8")
    try:
        report = ShardExtractor(config(fp8_dataset, fp8_engine, random_tiny_model, "0:4", hidden_states_dtype="fp8")).run()
    finally:
        stop_server(fp8_engine.pid, grace=10)
    assert (report.done, report.skipped, report.failed) == (4, 0, [])
    for row in range(4):
        assert validate(sample_path(hidden, row), rows[first + row], len(AUX) + 1, HIDDEN, "fp8").ok
        stored = load_file(sample_path(hidden, row))
        bf16 = load_file(sample_path(path / "hidden_states", first + row))["hidden_states"]  # the bf16 engine's, same rows
        values, scales = quantize_tensor_to_fp8(bf16)
        assert torch.equal(stored["hidden_states"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(stored["hidden_states_scales"], scales)
    fp8_bytes, bf16_bytes = report.bytes, sum(sample_path(path / "hidden_states", first + r).stat().st_size for r in range(4))
    assert fp8_bytes < 0.6 * bf16_bytes


class CountingClient(EngineClient):
    """The real client, counting the rows it sends."""

    generated = 0

    def generate(self, row: int, input_ids: list[int], rid: str | None = None) -> tuple[str, dict[str, Any]]:
        self.generated += 1
        return super().generate(row, input_ids, rid)


def test_failed_row_is_recorded_the_shard_carries_on_and_the_cli_names_it(dataset, engine, random_tiny_model) -> None:
    path, rows = dataset
    manifest = path.parent / "shards" / "rows_0-6.json"
    cfg = config(path, engine, random_tiny_model, "0:6")
    proc = subprocess.run(
        [sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 row(s) failed: 5" in proc.stdout and "A retry redoes only these rows" in proc.stdout
    data = json.loads(manifest.read_text())
    assert data["state"] == "failed" and data["done"] == 5
    assert data["failed"][0]["row"] == 5 and "injected failure for row 5" in data["failed"][0]["reason"]
    assert "after 2 attempts" in data["failed"][0]["reason"]  # a 500 is retried
    assert not sample_path(path / "hidden_states", 5).exists()
    # The XCom the operator pushes: this attempt's figures and the shard's totals.
    result = find_result(proc.stdout.splitlines())
    assert result is not None and (result["failed"], result["total_rows"]) == (1, 5)
    assert result["total_tokens"] == sum(len(rows[r]) for r in range(5)) == data["total_tokens"]


def test_a_4xx_is_not_retried_and_names_the_row(tmp_path: Path, engine, random_tiny_model) -> None:
    write_training_dataset([[1, 2, 3], [7, 5000, 9]], [[1, 1, 1], [1, 1, 1]], tmp_path / "dataset")
    report = ShardExtractor(config(tmp_path / "dataset", engine, random_tiny_model, "0:2", max_retries=3)).run()
    assert report.done == 1 and len(report.failed) == 1
    reason = report.failed[0]["reason"]
    assert "row 1" in reason and "400" in reason and "input_ids[1]" in reason and "attempts" not in reason


def test_killing_the_engine_mid_shard_stops_within_seconds_and_the_next_attempt_resumes(
    tmp_path: Path, random_tiny_model: Path
) -> None:
    rows = make_rows(40, seed=1)
    dataset = tmp_path / "dataset"
    write_training_dataset(rows, [[1] * len(r) for r in rows], dataset)
    server = launch_engine(random_tiny_model, tmp_path / "dumps", tmp_path / "server.log")
    cfg = config(dataset, server, random_tiny_model, "0:40", concurrency=2, progress_every=1, server_pid=server.pid, engine_name="engine-3")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleflow", "extract", *model_to_argv(cfg)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("rows: 6/"):
            break
    os.killpg(os.getpgid(server.pid), signal.SIGKILL)
    killed_at = time.monotonic()
    rest = proc.stdout.read()
    proc.wait(timeout=30)
    assert proc.returncode == EXIT_ENGINE_GONE  # "try again elsewhere", not "these rows are bad"
    assert time.monotonic() - killed_at < 10
    assert "is gone" in rest or "refuses connections" in rest, rest
    stopped = ShardManifest.read(cfg.manifest or dataset.parent / "shards" / "rows_0-40.json")
    assert (stopped.state, stopped.engine) == ("failed", f"engine-3 at {server.url}")
    done_before = {p.name: p.stat().st_mtime_ns for p in (dataset / "hidden_states").glob("hs_*.safetensors")}
    assert 6 <= len(done_before) < 40
    assert not [p for p in (dataset / "hidden_states").iterdir() if not p.name.startswith("hs_")]  # no partial files

    server = launch_engine(random_tiny_model, tmp_path / "dumps", tmp_path / "server2.log")
    try:
        report = ShardExtractor(cfg.model_copy(update={"server": server.url, "server_pid": server.pid, "engine_name": "engine-0"})).run()
    finally:
        stop_server(server.pid, grace=10)
    assert report.skipped == len(done_before) and report.done == 40 - len(done_before) and not report.failed
    # Totals over both attempts: every row's tokens and every file's bytes, not the second attempt's alone.
    files = [sample_path(dataset / "hidden_states", row) for row in range(40)]
    assert report.total_tokens == sum(len(r) for r in rows[:40]) > report.tokens
    assert report.total_bytes == sum(f.stat().st_size for f in files) > report.bytes
    assert report.engine == f"engine-0 at {server.url}"  # the manifest names the engine of the attempt that finished
    for name, mtime in done_before.items():
        assert (dataset / "hidden_states" / name).stat().st_mtime_ns == mtime
    for row in range(40):
        assert validate(sample_path(dataset / "hidden_states", row), rows[row], len(AUX) + 1, HIDDEN).ok


# ---- the dump checks and retry rules, with a fake engine ----------------------------------------


class FakeResponse:
    def __init__(self, status: int, body: Any) -> None:
        self.status_code, self._body, self.text = status, body, json.dumps(body)

    def json(self) -> Any:
        return self._body


class FakeEngine:
    """Answers /generate like SGLang and writes dumps through the real DumpWriter."""

    def __init__(self, dump_dir: Path, script: list[str]) -> None:
        self.writer = DumpWriter(dump_dir)
        self.script = script
        self.calls = 0

    def __call__(self, url: str, json: dict, timeout: float) -> FakeResponse:
        if not url.endswith("/generate"):
            return FakeResponse(200, {})  # /abort_request: nothing is still running here
        action = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        rid, ids = json["rid"], json["input_ids"]
        meta = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0}
        if action == "500":
            return FakeResponse(500, {"error": {"message": "boom"}})
        if action == "cached":
            meta["cached_tokens"] = 2
        elif action == "error-file":
            self.writer.submit_error(rid, "extend_prefix_len=3 > 0: prefix reuse would give a short dump", kind="prefix_reused")
        elif action == "nan":
            states = torch.zeros(len(ids), len(AUX) + 1, HIDDEN)
            states[0, 0, 0] = float("nan")
            self.writer.submit(rid, states, torch.tensor(ids))
        elif action == "ok":
            self.writer.submit(rid, torch.randn(len(ids), len(AUX) + 1, HIDDEN), torch.tensor(ids))
        self.writer.flush(10)
        return FakeResponse(200, {"text": "", "meta_info": meta})


@pytest.mark.parametrize(
    ("script", "calls", "reason"),
    [
        (["500", "ok"], 2, None),
        (["500", "500", "500"], 3, "engine answered 500: boom (after 3 attempts)"),
        (["cached"], 1, "reused 2 cached prefix tokens"),
        (["error-file"], 1, "engine reported: extend_prefix_len=3 > 0"),
        (["nan"], 1, "NaN"),
        (["none"], 3, "dump writer does not hold"),
    ],
)
def test_dump_checks_and_retries(tmp_path: Path, random_tiny_model: Path, script: list[str], calls: int, reason: str | None) -> None:
    write_training_dataset([[3, 4, 5, 6]], [[1, 1, 1, 1]], tmp_path / "dataset")
    fake = FakeEngine(tmp_path / "dumps", script)
    server = ServerInfo("http://engine.invalid", None, "", "", str(tmp_path / "dumps"))
    cfg = config(tmp_path / "dataset", server, random_tiny_model, "0:1", max_retries=2, dump_wait=0.2)
    extractor = ShardExtractor(cfg, client=EngineClient(cfg.server, cfg.request_timeout, post=fake), sleep=lambda s: time.sleep(min(s, 0.01)))
    extractor._stop.wait = lambda timeout=None: False  # no backoff sleeps in the test
    report = extractor.run()
    assert fake.calls == calls
    if reason is None:
        assert report.done == 1 and not report.failed
    else:
        assert report.done == 0 and reason in report.failed[0]["reason"]
        assert not list((tmp_path / "dumps").glob("row0-*"))  # bad dumps are not left behind


@pytest.mark.parametrize("damage", ["wrong tokens", "truncated"])
def test_a_damaged_file_is_redone_and_its_neighbour_is_not(tmp_path: Path, random_tiny_model: Path, damage: str) -> None:
    write_training_dataset([[3, 4, 5], [6, 7, 8, 9]], [[1, 1, 1], [1, 1, 1, 1]], tmp_path / "dataset")
    hidden = tmp_path / "dataset" / "hidden_states"
    if damage == "wrong tokens":
        write_sample(hidden, 0, torch.zeros(3, len(AUX) + 1, HIDDEN), torch.tensor([3, 4, 6]))
    else:  # a file cut short on disk (a crash before the data reached it, a copy that stopped)
        path = write_sample(hidden, 0, torch.zeros(3, len(AUX) + 1, HIDDEN), torch.tensor([3, 4, 5]))
        os.truncate(path, path.stat().st_size - 100)
    neighbour = write_sample(hidden, 1, torch.ones(4, len(AUX) + 1, HIDDEN), torch.tensor([6, 7, 8, 9]))
    before = (neighbour.stat().st_ino, neighbour.stat().st_mtime_ns)
    fake = FakeEngine(tmp_path / "dumps", ["ok"])
    server = ServerInfo("http://engine.invalid", None, "", "", str(tmp_path / "dumps"))
    cfg = config(tmp_path / "dataset", server, random_tiny_model, "0:2")
    report = ShardExtractor(cfg, client=EngineClient(cfg.server, cfg.request_timeout, post=fake)).run()
    assert (report.done, report.skipped, report.state, fake.calls) == (1, 1, "success", 1)
    assert validate(sample_path(hidden, 0), [3, 4, 5], len(AUX) + 1, HIDDEN).ok
    assert (neighbour.stat().st_ino, neighbour.stat().st_mtime_ns) == before


def test_rows_past_the_dataset_end_is_a_user_error(dataset, random_tiny_model: Path) -> None:
    from eagleflow.errors import UserError

    path, _ = dataset
    server = ServerInfo("http://engine.invalid", None, "", "", str(path.parent / "dumps"))
    with pytest.raises(UserError, match="past the end of the dataset"):
        ShardExtractor(config(path, server, random_tiny_model, "20:30")).run()
    with pytest.raises(ValueError, match="START < END"):
        config(path, server, random_tiny_model, "30:20")


# ---- a complete shard: told complete; re-extracted only when asked, its files kept until the new ones are ----------


def test_a_complete_shard_is_known_complete_until_a_file_is_missing_or_changed(tmp_path: Path, engine, random_tiny_model) -> None:
    rows = make_rows(5, seed=3)  # not row 5: this module's engine fails it
    dataset = tmp_path / "run" / "dataset"
    write_training_dataset(rows, [[1] * len(r) for r in rows], dataset)
    manifest_path, hidden = tmp_path / "run" / "shards" / "rows_0-5.json", dataset / "hidden_states"
    assert complete_shard(manifest_path, hidden, 0, 5) is None  # nothing extracted yet
    ShardExtractor(config(dataset, engine, random_tiny_model, "0:5")).run()

    done = complete_shard(manifest_path, hidden, 0, 5)
    assert done is not None and (done.name, done.total_rows) == ("rows_0-5", 5)
    assert complete_shard(manifest_path, hidden, 0, 4) is None  # another shard's rows
    message = already_complete_message(done, manifest_path, hidden, "Param reextract_complete_shards")
    assert message.startswith(f"shard rows_0-5 already complete (rows 0:5, files hs_0.safetensors … hs_4.safetensors in {hidden}, "
                              f"manifest {manifest_path}); nothing to extract — set Param reextract_complete_shards")
    layout = RunLayout(tmp_path / "run")
    assert incomplete_shards(layout, [{"name": "rows_0-5", "start": 0, "end": 5}]) == []

    # A file replaced by one of another size, or gone: the shard is to be extracted again (and the extractor redoes that row).
    third = sample_path(hidden, 3)
    third.write_bytes(third.read_bytes()[:-8])
    assert complete_shard(manifest_path, hidden, 0, 5) is None
    third.unlink()
    assert incomplete_shards(layout, [{"name": "rows_0-5", "start": 0, "end": 5}]) == ["rows_0-5"]
    redone = ShardExtractor(config(dataset, engine, random_tiny_model, "0:5")).run()
    assert (redone.done, redone.skipped) == (1, 4) and complete_shard(manifest_path, hidden, 0, 5) is not None


def test_a_forced_reextraction_keeps_the_old_files_aside_until_the_new_shard_is_complete(
    tmp_path: Path, engine, random_tiny_model
) -> None:
    rows = make_rows(30, seed=4)  # the shard is rows 6:30: this module's engine fails row 5
    dataset = tmp_path / "run" / "dataset"
    write_training_dataset(rows, [[1] * len(r) for r in rows], dataset)
    hidden, shards = dataset / "hidden_states", tmp_path / "run" / "shards"
    cfg = config(dataset, engine, random_tiny_model, "6:30", concurrency=1, progress_every=1)
    ShardExtractor(cfg).run()
    old = {row: sample_path(hidden, row).stat().st_ino for row in range(6, 30)}

    # Forced, and stopped (SIGTERM) a few rows in: the old files are all aside, untouched, the new ones in place.
    forced = cfg.model_copy(update={"reextract_complete_shards": True})
    proc = subprocess.Popen([sys.executable, "-m", "eagleflow", "extract", *model_to_argv(forced)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    said = []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("rows: 3/"):
            break
    proc.send_signal(signal.SIGTERM)
    said.append(proc.stdout.read())
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert any(f"its 24 files are set aside in {shards / 'previous' / 'rows_6-30'}" in line for line in said), said
    aside = shards / "previous" / "rows_6-30"
    assert {p.name: p.stat().st_ino for p in aside.iterdir()} == {sample_path(hidden, r).name: ino for r, ino in old.items()}
    new_rows = {int(p.stem.removeprefix("hs_")) for p in hidden.glob("hs_*.safetensors")}
    assert 3 <= len(new_rows) < 24 and ShardManifest.read(shards / "rows_6-30.json").state == "interrupted"
    assert complete_shard(shards / "rows_6-30.json", hidden, 6, 30) is None

    # Run again (a retry, the Param still on): it resumes the re-extraction rather than setting the new rows aside.
    report = ShardExtractor(forced).run()
    assert (report.state, report.skipped, report.done) == ("success", len(new_rows), 24 - len(new_rows))
    assert not (shards / "previous").exists()  # the old files went once the new shard was complete
    for row in range(6, 30):
        assert sample_path(hidden, row).stat().st_ino != old[row]  # every row extracted anew
        assert validate(sample_path(hidden, row), rows[row], len(AUX) + 1, HIDDEN).ok
    assert complete_shard(shards / "rows_6-30.json", hidden, 6, 30) is not None

    # Forced again on the complete shard: set aside anew and redone whole; without the flag, nothing is touched.
    again = ShardExtractor(forced).run()
    assert (again.done, again.skipped) == (24, 0) and not (shards / "previous").exists()
    untouched = ShardExtractor(cfg).run()
    assert (untouched.done, untouched.skipped) == (0, 24)
