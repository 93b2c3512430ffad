"""Online training (``--hidden-states-source engine``): real speculators training fed by real reference engines.

Every sample comes from a running engine over HTTP, through its capture hook's dumps, checked as
extraction checks them; the faults are injected for real (engines killed by pid, a slow writer,
the trainer's process group sent SIGTERM as ``on_kill`` does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import datasets
import pytest
from reference_engines import launch_engine
from training_data import AUX, assert_records, train_argv

from eagleflow.engine.client import EngineClient
from eagleflow.engine.process import ServerInfo, pid_alive
from eagleflow.errors import UserError
from eagleflow.extract.config import ExtractConfig
from eagleflow.extract.shard import ShardExtractor
from eagleflow.files import atomic_write_json
from eagleflow.layout import FeedLayout, TrainLayout, hidden_states_dir
from eagleflow.metrics.records import read_records
from eagleflow.results import find_result
from eagleflow.train.online.journal import settle_journal
from eagleflow.train.online.settings import held_bytes
from eagleflow.train.speculators_support import RELEASES, check_online
from sglang_patch.handoff import read_writer_statuses
from sglang_patch.request_ids import row_request_id
from sglang_patch.sample_file import sample_file_bytes

HIDDEN = 64
FAULT_ROWS = 40


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny tensors; a shared 2-core machine


def rows_only(dataset: Path, dest: Path, rows: int | None = None) -> Path:
    """The prepared dataset without its hidden states (what online training starts from), optionally its first rows."""
    table = datasets.load_from_disk(str(dataset))
    if rows is not None:
        table = table.select(range(rows))
    table.save_to_disk(str(dest))
    return dest


def largest_sample(dataset: Path) -> int:
    lengths = datasets.load_from_disk(str(dataset)).with_format(None)["seq_len"]
    return sample_file_bytes(max(lengths), len(AUX) + 1, HIDDEN, "bf16")


def online_argv(dataset: Path, verifier: Path, out: Path, engines: list[ServerInfo], *extra: str) -> list[str]:
    return train_argv(
        dataset, verifier, out, "--hidden-states-source", "engine",
        "--engine-urls=" + ",".join(e.url for e in engines), "--engine-names=" + ",".join(e.name for e in engines),
        "--dump-dir", engines[0].dump_dir, *extra,
    )


def run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def row_files(dump_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(dump_dir).glob("row*"))


def kill_engine(engine: ServerInfo) -> None:
    os.killpg(engine.pid, signal.SIGKILL)
    os.waitpid(engine.pid, 0)


def wait_for(predicate, what: str, timeout: float = 300.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def epoch_done(out: Path) -> bool:
    """Epoch 0 finished: speculators saves the checkpoint, validates (the ``val`` record), then writes the
    epoch's ``val_metrics.json`` and points ``checkpoint_best`` at it, its last act of the epoch. (Waiting
    for the record alone once snapshotted the folder before ``val_metrics.json`` came.)"""
    return (TrainLayout(out).checkpoints / "checkpoint_best").exists()


def fetched(out: Path) -> int:
    try:
        return int(json.loads(FeedLayout(TrainLayout(out).online).status.read_text()).get("fetched", 0))
    except (OSError, ValueError):
        return 0


# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_engine_mode_learns_as_disk_mode_does_within_a_disk_window(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    """Same seed, data and settings: engine mode gives the same validation figures per epoch as disk
    mode on the same engine's states, while the bytes on disk stay within the window plus one sample."""
    sample = largest_sample(trained_data)
    window = 2 * sample
    dumps = tmp_path / "dumps"
    engine = launch_engine(tiny_model, dumps, tmp_path / "engine.log", f"--dump-queue-bytes={window}", aux=AUX)
    process_groups.append(engine.pid)

    # Disk mode, from the files this engine writes (extraction, as the DAG runs it).
    disk = rows_only(trained_data, tmp_path / "disk" / "dataset")
    rows = len(datasets.load_from_disk(str(disk)))
    ShardExtractor(ExtractConfig(
        dataset=disk, server=engine.url, dump_dir=dumps, rows=f"0:{rows}", verifier=tiny_model, aux_layer_ids=AUX,
        manifest=tmp_path / "disk" / "shard.json",
    )).run()
    stored = sum(p.stat().st_size for p in hidden_states_dir(disk).iterdir())
    disk_run = run(train_argv(disk, tiny_model, tmp_path / "disk" / "train", "--epochs", "2"))
    assert disk_run.returncode == 0, disk_run.stdout[-3000:] + disk_run.stderr[-3000:]

    # Engine mode, no cache, a window of two samples; the disk is sampled throughout.
    online = rows_only(trained_data, tmp_path / "online" / "dataset")
    out = tmp_path / "online" / "train"
    feed = FeedLayout(TrainLayout(out).online)
    watched = [dumps, feed.ready, feed.cache]
    peak, samples, done = [0], [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], held_bytes(watched))
            samples[0] += 1
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    online_run = run(online_argv(online, tiny_model, out, [engine], "--epochs", "2", f"--online-window-gb={window / 1e9}"))
    done.set()
    watcher.join()
    assert online_run.returncode == 0, online_run.stdout[-3000:] + online_run.stderr[-3000:]
    assert not hidden_states_dir(online).exists(), "online training stores no dataset of hidden states"

    # The same learning: the reference engine is deterministic (one forward at a time, the same
    # kernels), so each sample is bit for bit the file disk mode read; torch's generator is
    # drawn in the same order (noise, shuffling) in the one trainer process.
    _, disk_val = assert_records(tmp_path / "disk" / "train" / "metrics.jsonl", 2)
    train, online_val = assert_records(out / "metrics.jsonl", 2, online=True)
    for a, b in zip(disk_val, online_val, strict=True):
        for key in ("loss", "full_acc_0", "full_acc_1", "full_acc_2"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (key, a, b)

    # The disk: never more than the window plus one sample, against a dataset many times that.
    assert samples[0] > 100, "the watcher sampled the folders throughout the run"
    assert 0 < peak[0] <= window + sample, (peak[0], window, sample)
    assert stored >= 10 * (window + sample), (stored, window + sample)
    result = find_result(online_run.stdout.splitlines())
    assert 0 < result["online"]["peak_bytes"] <= window + sample
    assert result["online"]["fetched"] == 2 * rows, "each epoch asked the engine for every row again (cache 0)"

    # The trainer's wait for data, per logged step, in the records and the log.
    assert all("data_wait_s" in r and r["data_wait_s"] >= 0 for r in train)
    assert " data wait " in online_run.stdout
    # Nothing left behind: no dump, no prefetched sample, no request in the journal.
    assert row_files(dumps) == [] and list(feed.ready.iterdir()) == []
    assert json.loads(feed.journal.read_text()) == {}


@pytest.mark.e2e
def test_a_cache_keeps_what_fits_for_later_epochs(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    engine = launch_engine(tiny_model, tmp_path / "dumps", tmp_path / "engine.log", aux=AUX)
    process_groups.append(engine.pid)
    out = tmp_path / "train"
    proc = run(online_argv(dataset, tiny_model, out, [engine], "--epochs", "3", "--online-cache-gb=1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    online = find_result(proc.stdout.splitlines())["online"]
    assert online["fetched"] == FAULT_ROWS, "the first epoch fetched each row once; the later two read the cache"
    assert online["cached"] == FAULT_ROWS
    assert len(list(FeedLayout(TrainLayout(out).online).cache.glob("hs_*.safetensors"))) == FAULT_ROWS
    assert_records(out / "metrics.jsonl", 3, online=True)


def test_a_window_smaller_than_one_sample_is_refused_before_training(trained_data: Path, tiny_model: Path, tmp_path: Path) -> None:
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    out = tmp_path / "train"
    engine = ServerInfo.at("http://127.0.0.1:9")  # never asked: the check comes first
    engine = ServerInfo(**{**engine.as_dict(), "dump_dir": str(tmp_path / "dumps")})
    proc = run(online_argv(dataset, tiny_model, out, [engine], "--online-window-gb=0.000001"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "smaller than the largest sample, row " in proc.stderr and "--online-window-gb" in proc.stderr
    assert not (out / "checkpoints").exists(), "nothing trained"


def test_a_release_without_transfer_backends_is_refused_by_name() -> None:
    with pytest.raises(UserError, match="speculators 0.8.1 has no hidden-states transfer backends"):
        check_online(RELEASES["0.8.1"])
    check_online(RELEASES["0.9.0"])


@pytest.mark.e2e
def test_an_engine_killed_mid_epoch_hands_its_rows_to_a_slow_one_that_is_waited_for(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    dumps = tmp_path / "dumps"
    slow = launch_engine(tiny_model, dumps, tmp_path / "slow.log", aux=AUX, name="engine-0", faults={"write_delay": 0.05})
    doomed = launch_engine(tiny_model, dumps, tmp_path / "doomed.log", aux=AUX, name="engine-1")
    process_groups.extend([slow.pid, doomed.pid])
    out = tmp_path / "train"
    step = subprocess.Popen(
        online_argv(dataset, tiny_model, out, [slow, doomed], "--epochs", "2", "--online-prefetch=4"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    wait_for(lambda: fetched(out) >= 10 or step.poll() is not None, "the first samples")
    kill_engine(doomed)
    output, _ = step.communicate(timeout=600)
    assert step.returncode == 0, output[-4000:]
    assert f"engine-1 at {doomed.url} is gone" in output
    assert_records(out / "metrics.jsonl", 2, online=True)
    waits = [r["data_wait_s"] for r in read_records(out / "metrics.jsonl") if r["kind"] == "train"]
    assert sum(waits) > 0, "the slow writer kept the trainer waiting, and the log says for how long"
    assert row_files(dumps) == []


@pytest.mark.e2e
def test_the_only_engine_gone_past_engine_wait_stops_training_naming_it_and_the_retry_resumes(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    dumps = tmp_path / "dumps"
    engine = launch_engine(tiny_model, dumps, tmp_path / "engine.log", aux=AUX)
    process_groups.append(engine.pid)
    out = tmp_path / "train"
    argv = online_argv(dataset, tiny_model, out, [engine], "--epochs", "3", "--engine-wait=3")
    step = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checkpoints = TrainLayout(out).checkpoints
    wait_for(lambda: epoch_done(out) or step.poll() is not None, "the first epoch's checkpoint")
    kept = sorted((p.name, p.stat().st_size) for p in (checkpoints / "0").iterdir())
    kill_engine(engine)
    output, _ = step.communicate(timeout=300)
    assert step.returncode != 0, output[-3000:]
    assert f"no engine answered for 3s (engine_wait): engine-0 at {engine.url}" in output
    # The step's last line, what the task summary shows, names the gone engine, not only the child's status.
    assert output.strip().splitlines()[-1].startswith("error: online feed stopped: no engine answered for 3s"), output[-1500:]
    assert "Traceback" not in output, output[-3000:]
    assert sorted((p.name, p.stat().st_size) for p in (checkpoints / "0").iterdir()) == kept, "the finished epoch is kept"

    # The engine comes back (on its port); the retry resumes from the last checkpoint and finishes.
    back = launch_engine(tiny_model, dumps, tmp_path / "engine.log", aux=AUX, port=int(engine.url.rsplit(":", 1)[1]))
    process_groups.append(back.pid)
    retry = run(argv)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert "Resuming" in retry.stdout or "resum" in retry.stdout.lower()
    assert_records(out / "metrics.jsonl", 3, online=True)
    assert row_files(dumps) == []


@pytest.mark.e2e
def test_a_killed_trainer_leaves_no_request_running_and_no_dump_and_the_retry_resumes(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    dumps = tmp_path / "dumps"
    # A slow writer, so requests are in flight and dumps queued when the trainer is stopped.
    engine = launch_engine(tiny_model, dumps, tmp_path / "engine.log", aux=AUX, faults={"write_delay": 0.1})
    process_groups.append(engine.pid)
    out = tmp_path / "train"
    argv = online_argv(dataset, tiny_model, out, [engine], "--epochs", "2")
    step = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    checkpoints = TrainLayout(out).checkpoints
    wait_for(lambda: epoch_done(out) or step.poll() is not None, "the first epoch's checkpoint")
    first = fetched(out)
    wait_for(lambda: fetched(out) > first + 3 or step.poll() is not None, "requests of the second epoch")
    os.killpg(step.pid, signal.SIGTERM)  # what the operator's on_kill sends
    output, _ = step.communicate(timeout=120)
    assert step.returncode != 0

    assert pid_alive(engine.pid), "the engine is the run's; only the trainer stopped"
    assert not any(status.pending for status in read_writer_statuses(dumps)), "no request of the trainer left in the writer"
    assert row_files(dumps) == [], "no orphan dump once the engine answered"
    feed = FeedLayout(TrainLayout(out).online)
    assert json.loads(feed.journal.read_text()) == {} and list(feed.ready.iterdir()) == []
    assert (checkpoints / "0").is_dir()

    retry = run(argv)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert_records(out / "metrics.jsonl", 2, online=True)


@pytest.mark.e2e
def test_a_request_aborted_mid_forward_has_its_late_dump_removed_by_the_settle(
    tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    """An abort cannot stop a forward under way: its dump reaches the writer after the abort (a killed
    trainer's request did this once in CI and left an orphan dump). The settle waits the forward out
    and removes the dump once written."""
    dumps = tmp_path / "dumps"
    engine = launch_engine(tiny_model, dumps, tmp_path / "engine.log", aux=AUX, faults={"forward_seconds": 3.0})
    process_groups.append(engine.pid)
    rid = row_request_id(3)
    request = threading.Thread(target=lambda: EngineClient(engine.url, request_timeout=60).generate(3, list(range(5, 37)), rid=rid))
    request.start()
    time.sleep(1.0)  # the request is in its forward (3 s)
    layout = FeedLayout(tmp_path / "online")
    layout.root.mkdir()
    atomic_write_json(layout.journal, {"3": {"rid": rid, "url": engine.url, "dump_dir": str(dumps)}})
    assert settle_journal(layout, say=lambda _: None) == 1
    request.join(timeout=60)
    wait_for(lambda: all(s.updated > time.time() - 0.5 and not s.pending for s in read_writer_statuses(dumps)), "the writer idle")
    assert row_files(dumps) == [], "the aborted request's dump came after the abort and was removed"
    assert json.loads(layout.journal.read_text()) == {}


def captured_requests(engine: ServerInfo) -> int:
    """The prefills of captured requests the engine has answered, as it counts them."""
    import urllib.request

    with urllib.request.urlopen(f"{engine.url}/server_info", timeout=30) as answer:
        return int(json.loads(answer.read())["eagleflow_captured_requests"])


@pytest.mark.e2e
def test_two_drafters_online_take_one_prefill_per_sample_per_epoch_within_one_window(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    """An EAGLE-3 (the lead) and a DFlash reading two of the three captured layers train side by side from
    the engine: each sample is asked of the engine once per epoch (counted at the engine) and handed to
    both trainers, and the disk holds at most one window plus one sample, however many trainers read it."""
    sample = largest_sample(trained_data)
    window = 2 * sample
    dumps = tmp_path / "dumps"
    engine = launch_engine(tiny_model, dumps, tmp_path / "engine.log", f"--dump-queue-bytes={window}", aux=AUX)
    process_groups.append(engine.pid)
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    lead, follower = tmp_path / "drafters" / "eagle3" / "train", tmp_path / "drafters" / "dflash" / "train"
    shared = [f"--online-trainers={lead},{follower}", "--online-peer-wait", "300", "--epochs", "2", f"--online-window-gb={window / 1e9}"]
    dflash = ["--draft-algorithm", "dflash", "--draft-vocab-size", "1024", "--block-size", "4", "--num-layers", "1",
              "--mask-token-id", "0", "--max-anchors", "16", "--aux-layer-ids", "2,6", "--captured-aux-layer-ids", "2,4,6"]
    feeds = [FeedLayout(TrainLayout(out).online) for out in (lead, follower)]
    watched = [dumps, feeds[0].ready, feeds[0].staging, feeds[1].ready]
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], held_bytes(watched))
            time.sleep(0.005)

    before = captured_requests(engine)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    trainers = [
        subprocess.Popen(online_argv(dataset, tiny_model, lead, [engine], *shared), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        subprocess.Popen(online_argv(dataset, tiny_model, follower, [engine], *shared, *dflash), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True),
    ]
    outputs = [t.communicate(timeout=900)[0] for t in trainers]
    done.set()
    watcher.join()
    for trainer, output in zip(trainers, outputs):
        assert trainer.returncode == 0, output[-4000:]

    # One prefill per sample per epoch for both trainers, counted where it is paid.
    assert captured_requests(engine) - before == 2 * FAULT_ROWS
    assert "handing every sample to dflash too" in outputs[0], outputs[0][-3000:]
    assert "no request of its own" in outputs[1], outputs[1][-3000:]
    results = [find_result(output.splitlines()) for output in outputs]
    assert results[0]["online"]["fetched"] == 2 * FAULT_ROWS and results[1]["online"]["fetched"] == 0
    # Both learned from what they were handed: the EAGLE-3's per-step records, the DFlash's block metrics,
    # the DFlash from its own two layers of the three captured.
    assert_records(lead / "metrics.jsonl", 2, online=True)
    records = [json.loads(line) for line in (follower / "metrics.jsonl").read_text().splitlines()]
    assert {"eal", "full_acc"} <= set(records[-1]) and records[-1]["epoch"] == 1
    assert json.loads(TrainLayout(follower).config.read_text())["aux_layer_ids"] == [2, 6]
    # The disk: one window plus one sample for both (a handed sample is a link to the same bytes).
    assert 0 < peak[0] <= window + sample, (peak[0], window, sample)
    assert 0 < results[0]["online"]["peak_bytes"] <= window + sample
    # Nothing left behind.
    assert row_files(dumps) == []
    assert [list(f.ready.iterdir()) for f in feeds] == [[], []] and list(feeds[0].staging.iterdir()) == []


@pytest.mark.e2e
def test_a_drafter_killed_mid_epoch_is_dropped_by_the_lead_and_its_retry_fetches_alone(
    trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]
) -> None:
    """The follower's trainer killed while the lead hands it samples: the lead stops waiting for it once its
    heartbeat goes silent, removes the links it held and finishes; the follower's retry fetches its own."""
    from eagleflow.train.online.share import HEARTBEAT_STALE_S

    dumps = tmp_path / "dumps"
    engine = launch_engine(tiny_model, dumps, tmp_path / "engine.log", aux=AUX, faults={"write_delay": 0.05})
    process_groups.append(engine.pid)
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    lead, follower = tmp_path / "drafters" / "eagle3" / "train", tmp_path / "drafters" / "eagle3-lr" / "train"
    shared = [f"--online-trainers={lead},{follower}", "--online-peer-wait", "300", "--epochs", "2"]
    lead_step = subprocess.Popen(online_argv(dataset, tiny_model, lead, [engine], *shared), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    follower_argv = online_argv(dataset, tiny_model, follower, [engine], *shared, "--lr", "1e-3")
    follower_step = subprocess.Popen(follower_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    feed = FeedLayout(TrainLayout(follower).online)
    wait_for(lambda: fetched(lead) > 10 or lead_step.poll() is not None, "samples handed to both trainers")
    killed = time.monotonic()
    os.killpg(follower_step.pid, signal.SIGKILL)  # the trainer and its speculators child, no clean-up
    follower_step.communicate(timeout=60)

    output, _ = lead_step.communicate(timeout=600)
    assert lead_step.returncode == 0, output[-4000:]
    assert "no longer handing samples to eagle3-lr: its feed stopped" in output, output[-3000:]
    assert time.monotonic() - killed >= HEARTBEAT_STALE_S - 1, "the lead waited for the silent trainer's heartbeat"
    assert list(feed.ready.iterdir()) == [], "the links the killed trainer held were removed: nothing grows"
    assert json.loads(feed.dropped.read_text())["why"] == "its feed stopped"

    before = captured_requests(engine)
    retry = run(follower_argv)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert "fetching alone" in retry.stdout, retry.stdout[-3000:]
    assert captured_requests(engine) - before == fetched(follower) >= FAULT_ROWS
    assert_records(follower / "metrics.jsonl", 2, online=True)
    assert row_files(dumps) == [] and list(feed.ready.iterdir()) == []
