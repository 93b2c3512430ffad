"""Samples through a Mooncake Store (``sample_transport`` mooncake): real master, metadata server, engines, training.

The store is the product's own (:func:`eagleflow.engine.sample_store_service.ensure_store`: ``mooncake_master``
and ``mooncake_http_metadata_server`` started on 127.0.0.1), the engines reference engines whose capture
puts each sample into it, the trainer speculators reading them back through the online feed. The
faults are injected for real: the trainer's process group sent SIGTERM, the master and the engine
SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from reference_engines import launch_engine
from test_online import FAULT_ROWS, epoch_done, fetched, kill_engine, largest_sample, online_argv, rows_only, run, wait_for
from training_data import AUX, assert_records

from eagleflow.engine.process import ServerInfo, pid_alive
from eagleflow.engine.sample_store_service import STATE_FILE, ensure_store, read_store_state, stop_store
from eagleflow.extract.dump_wait import raise_for_record
from eagleflow.extract.handoff_reader import StoreHandOff, StoreUnreachable
from eagleflow.extract.config import ExtractConfig
from eagleflow.extract.sample_store import validate
from eagleflow.extract.shard import ShardExtractor
from eagleflow.engine import RowFailed
from eagleflow.layout import FeedLayout, TrainLayout, hidden_states_dir
from eagleflow.results import find_result
from sglang_patch.dump_writer import DumpWriter
from sglang_patch.mooncake_store import STATUS_MARK, StoreAddress
from sglang_patch.sample_file import write_sample_file

pytest.importorskip("mooncake.store", reason="sample_transport mooncake needs mooncake-transfer-engine-non-cuda (dev extra)")


@pytest.fixture
def store(tmp_path: Path):  # noqa: ANN201
    """The run's own store, as the launch starts it; stopped (both processes) afterwards."""
    folder = tmp_path / "server"
    address = ensure_store(folder, "eagleflow/test")
    assert address is not None
    yield folder, address
    stop_store(folder)


def sample_keys(address: StoreAddress) -> list[str]:
    """The run's sample and error keys in the store (the writers' statuses aside)."""
    handoff = StoreHandOff(address)
    return [k for k in handoff.store.keys(f"{address.namespace}/") if f"/{STATUS_MARK}" not in k]


def answers(reader: StoreHandOff) -> bool:
    try:
        return not reader.has_sample("row1-gone")
    except StoreUnreachable:
        return False


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny tensors; a shared 2-core machine


def store_engine(model: Path, tmp_path: Path, address: StoreAddress, name: str = "engine-0", port: int | None = None, **kw) -> ServerInfo:  # noqa: ANN003
    engine = launch_engine(model, tmp_path / "dumps", tmp_path / f"{name}.log", f"--sample-store={address.to_json()}",
                           aux=AUX, name=name, port=port, **kw)
    return ServerInfo(**{**engine.as_dict(), "sample_store": address.as_dict()})


def store_argv(dataset: Path, model: Path, out: Path, engine: ServerInfo, *extra: str) -> list[str]:
    return online_argv(dataset, model, out, [engine], f"--sample-store={engine.store_json()}", *extra)


def test_a_sample_goes_through_the_store_as_its_file_bytes_and_is_removed_once_read(store, tmp_path: Path) -> None:  # noqa: ANN001
    _, address = store
    writer = DumpWriter(tmp_path / "dumps", max_pending_bytes=1 << 20, sample_store=address)
    reader = StoreHandOff(address, 1 << 20)
    try:
        states, ids = torch.randn(12, 3, 16), torch.arange(12)
        assert writer.submit("row7-abc", states, ids)
        writer.flush(30)
        assert reader.has_sample("row7-abc") and reader.error_record("row7-abc") is None
        (tmp_path / "ready").mkdir()
        part = reader.local_copy("row7-abc", tmp_path / "ready" / "hs_7.safetensors")
        # The value is exactly the §3.2 file the folder transport writes, checked as one.
        expected = write_sample_file(tmp_path / "file.safetensors", states, ids, "bf16", {"eagleflow.values": "finite"})
        assert part.read_bytes() == expected.read_bytes()
        assert validate(part, list(range(12)), 3, 16, "bf16", trust_writer_verdict=True).ok
        reader.discard("row7-abc", tmp_path / "ready" / "hs_7.safetensors")
        assert not reader.has_sample("row7-abc") and list((tmp_path / "ready").iterdir()) == []
        assert [s.pid for s in reader.statuses()] == [os.getpid()], "the writer's status is in the store"
        assert not (tmp_path / "dumps").exists() or not list((tmp_path / "dumps").iterdir()), "nothing in the dump folder"

        # A sample over the store's room for one (the writer's budget): an error record naming the Param, no sample.
        assert not writer.submit("row8-abc", torch.randn(8000, 3, 16), torch.arange(8000))
        writer.flush(30)
        record = reader.error_record("row8-abc")
        assert record is not None and record.kind == "too_large" and not reader.has_sample("row8-abc")
        with pytest.raises(RowFailed, match=r"one request needs .* more than the whole budget of .*dump_queue_gb"):
            raise_for_record(record)
    finally:
        writer.close()
    assert reader.statuses() == [], "a closed writer removes its status"


def test_a_gone_master_is_named_and_a_sample_that_left_the_store_is_never_published(
    store, trained_data: Path, tiny_model: Path, tmp_path: Path  # noqa: ANN001
) -> None:
    folder, address = store
    reader = StoreHandOff(address)
    with pytest.raises(RowFailed, match="left .* before it was read"):
        reader.local_copy("row1-gone", tmp_path / "hs_1.safetensors")
    assert list(tmp_path.glob(".hs_1*")) == [], "no part file of a sample that was not there"
    os.kill(read_store_state(folder)["master_pid"], signal.SIGKILL)
    with pytest.raises(StoreUnreachable, match=rf"the Mooncake master at {address.master}.*does not answer"):
        reader.has_sample("row1-gone")
    # A step that reads through the store stops naming it, no traceback (here an extraction starting meanwhile).
    extract = run([sys.executable, "-m", "eagleflow", "extract", "--dataset", str(rows_only(trained_data, tmp_path / "ds", 4)),
                   "--server", "http://127.0.0.1:9", "--dump-dir", str(tmp_path / "dumps"), f"--sample-store={address.to_json()}",
                   "--rows", "0:4", "--verifier", str(tiny_model), "--aux-layer-ids", ",".join(map(str, AUX))])
    assert extract.returncode == 1 and "Traceback" not in extract.stdout + extract.stderr, extract.stdout + extract.stderr
    assert f"error: extract --rows 0:4: cannot connect to the Mooncake master at {address.master}" in extract.stdout, extract.stdout
    assert ensure_store(folder, "eagleflow/test", start_new=False) == address, "brought back on the same ports"
    wait_for(lambda: answers(reader), "the client to reconnect to the master on its old address", timeout=30)


def test_the_store_clients_of_an_engine_and_a_reader_take_no_connection_from_another_interface(
    store, tiny_model: Path, tmp_path: Path, process_groups: list[int]  # noqa: ANN001
) -> None:
    """The run's own store is for this node only (README "Where a run may write and listen"): Mooncake opens its
    clients' listeners on every address, so each listener of the engine, the reader (the extractor's client),
    the master and the metadata server is 127.0.0.1, or refuses a connection to this host's other addresses."""
    import ipaddress
    import socket

    import psutil

    def listeners(*procs: psutil.Process) -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for proc in procs for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    hosts = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    elsewhere = [host for host in hosts if not (ipaddress.ip_address(host).is_loopback or ipaddress.ip_address(host).is_link_local)]
    if not elsewhere:
        pytest.skip("this host has no address besides loopback: no other interface to come from")
    folder, address = store
    engine = store_engine(tiny_model, tmp_path, address)
    process_groups.append(engine.pid)
    before = listeners(psutil.Process())
    reader = StoreHandOff(address)  # in this process: its listeners are the ones that were not here before
    assert not reader.has_sample("row0-none")
    state = read_store_state(folder)
    others = [psutil.Process(pid) for pid in (engine.pid, state["master_pid"], state["metadata_pid"])]
    opened = (listeners(psutil.Process()) - before) | listeners(*others, *others[0].children(recursive=True))

    def reaches(host: str, port: int) -> bool:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.settimeout(5)
            return probe.connect_ex((host, port)) == 0

    wide = sorted(port for ip, port in opened if ip in ("0.0.0.0", "::"))
    assert len(wide) >= 4, f"Mooncake's clients (2 listeners each) listen on every address: {sorted(opened)}"
    assert {ip for ip, _ in opened} <= {"127.0.0.1", "0.0.0.0", "::"}, sorted(opened)
    for port in wide:
        assert reaches("127.0.0.1", port), f"port {port} still serves this host"
        assert not [host for host in elsewhere if reaches(host, port)], f"port {port} takes connections from {elsewhere}"
    assert not reader.has_sample("row0-none"), "the reader still answers"


def test_a_store_port_held_by_another_process_is_named_and_the_store_comes_back_once_it_is_free(store, tmp_path: Path) -> None:  # noqa: ANN001
    import psutil

    from eagleflow.errors import UserError

    folder, address = store
    state = read_store_state(folder)
    os.kill(state["master_pid"], signal.SIGKILL)
    port = int(address.master.rsplit(":", 1)[1])
    holder = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\ns = socket.socket()\n"
                               "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('127.0.0.1', int(sys.argv[1])))\n"
                               "s.listen()\nprint('held', flush=True)\ntime.sleep(60)", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        name = psutil.Process(holder.pid).name()
        with pytest.raises(UserError, match=rf"port {port} on 127\.0\.0\.1 is held by another process \(pid {holder.pid}, name {name}\); "
                           "it is the Mooncake master's RPC port"):
            ensure_store(folder, "eagleflow/test", start_new=False)
        assert not pid_alive(state["metadata_pid"]), "nothing of the store is left running"
    finally:
        holder.kill()
        holder.wait()
    assert ensure_store(folder, "eagleflow/test", start_new=False) == address, "brought back on its ports once they are free"


def test_a_sample_over_the_stores_room_is_refused_before_training(trained_data: Path, tiny_model: Path, tmp_path: Path) -> None:
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    address = StoreAddress("127.0.0.1:9", "127.0.0.1:9", "P2PHANDSHAKE", "eagleflow/never-asked")
    engine = ServerInfo(url="http://127.0.0.1:9", pid=None, host="", log_path="", dump_dir=str(tmp_path / "d"), sample_store=address.as_dict())
    proc = run(store_argv(dataset, tiny_model, tmp_path / "train", engine, "--online-window-gb=0.000001"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the sample store's room for one sample" in proc.stderr and "smaller than the largest sample, row " in proc.stderr
    assert "dump_queue_gb" in proc.stderr and not (tmp_path / "train" / "checkpoints").exists()


@pytest.mark.e2e
def test_samples_through_the_store_train_as_files_do_and_the_dump_folder_never_holds_one(
    store, trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]  # noqa: ANN001
) -> None:
    """Same seed, rows and settings: the same validation figures per epoch whichever way the samples travel,
    and with the store no sample file ever appears in the engine's dump folder (sampled throughout)."""
    _, address = store
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    window = 2 * largest_sample(dataset)
    by_file = launch_engine(tiny_model, tmp_path / "file-dumps", tmp_path / "file.log", f"--dump-queue-bytes={window}", aux=AUX)
    by_store = store_engine(tiny_model, tmp_path, address)
    process_groups.extend([by_file.pid, by_store.pid])
    dumps = tmp_path / "dumps"
    seen: list[str] = []
    looks, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.extend(p.name for p in dumps.glob("*") if p.name.endswith((".safetensors", ".tmp", ".error.json")))
            looks[0] += 1
            time.sleep(0.005)

    file_run = run(online_argv(dataset, tiny_model, tmp_path / "file", [by_file], "--epochs", "2", f"--online-window-gb={window / 1e9}"))
    assert file_run.returncode == 0, file_run.stdout[-3000:] + file_run.stderr[-3000:]
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    store_run = run(store_argv(dataset, tiny_model, tmp_path / "store", by_store, "--epochs", "2", f"--online-window-gb={window / 1e9}"))
    done.set()
    watcher.join()
    assert store_run.returncode == 0, store_run.stdout[-3000:] + store_run.stderr[-3000:]

    _, file_val = assert_records(tmp_path / "file" / "metrics.jsonl", 2, online=True)
    _, store_val = assert_records(tmp_path / "store" / "metrics.jsonl", 2, online=True)
    for a, b in zip(file_val, store_val, strict=True):
        for key in ("loss", "full_acc_0", "full_acc_1", "full_acc_2"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (key, a, b)
    assert looks[0] > 100 and seen == [], f"the dump folder held {sorted(set(seen))[:5]}"
    online = find_result(store_run.stdout.splitlines())["online"]
    assert online["fetched"] == 2 * FAULT_ROWS and 0 < online["peak_bytes"] <= window + largest_sample(dataset)
    assert sample_keys(address) == [], "every sample read was removed from the store"
    assert list(FeedLayout(TrainLayout(tmp_path / "store").online).ready.iterdir()) == []

    # Extraction to disk reads through the same seam: the same files, byte for byte, whichever way they came.
    for name, engine in (("by-file", by_file), ("by-store", by_store)):
        ShardExtractor(ExtractConfig(
            dataset=rows_only(dataset, tmp_path / name / "dataset", 8), server=engine.url, dump_dir=Path(engine.dump_dir),
            sample_store=engine.store_json(), rows="0:8", verifier=tiny_model, aux_layer_ids=AUX, manifest=tmp_path / name / "shard.json",
        )).run()
    files = [sorted(hidden_states_dir(tmp_path / name / "dataset").iterdir()) for name in ("by-file", "by-store")]
    assert len(files[0]) == 8 and [p.read_bytes() for p in files[0]] == [p.read_bytes() for p in files[1]]
    assert sample_keys(address) == [] and not [p for p in dumps.glob("*") if p.name.endswith(".safetensors")]


@pytest.mark.e2e
def test_trainer_master_and_engine_killed_mid_run_each_retry_finishes_and_nothing_is_left(
    store, trained_data: Path, tiny_model: Path, tmp_path: Path, process_groups: list[int]  # noqa: ANN001
) -> None:
    """Three faults in one run of three epochs, each followed by the retry Airflow would make:
    the trainer killed (its samples leave the store), the master killed (training stops naming it; the
    retry brings it back on its ports, as train_drafter does, and resumes), the engine killed with samples
    in the store (none of them is trained on half-read; the retry, on the engine launched again, finishes)."""
    folder, address = store
    dataset = rows_only(trained_data, tmp_path / "dataset", FAULT_ROWS)
    engine = store_engine(tiny_model, tmp_path, address, faults={"write_delay": 0.05})
    process_groups.append(engine.pid)
    out = tmp_path / "train"
    feed = FeedLayout(TrainLayout(out).online)
    argv = store_argv(dataset, tiny_model, out, engine, "--epochs", "3", "--engine-wait=3", "--online-prefetch=6")

    # 1. The trainer killed as on_kill kills it, mid second epoch: no request of it left running, no sample in the store.
    step = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: epoch_done(out) or step.poll() is not None, "the first epoch's checkpoint")
    first = fetched(out)
    wait_for(lambda: fetched(out) > first + 3 or step.poll() is not None, "samples of the second epoch")
    os.killpg(step.pid, signal.SIGTERM)
    step.communicate(timeout=120)
    assert step.returncode != 0 and pid_alive(engine.pid)
    assert sample_keys(address) == [], "the samples the killed trainer held left the store"
    assert not any(s.pending for s in StoreHandOff(address).statuses()), "no request of it left in the writer"
    assert json.loads(feed.journal.read_text()) == {} and list(feed.ready.iterdir()) == []

    # 2. The master killed mid-epoch: training stops naming it, the finished epoch kept.
    feed.status.unlink()  # what fetched() reads: the retry's own figures from here on
    step = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: fetched(out) > 5 or step.poll() is not None, "the retry's first samples")
    os.kill(read_store_state(folder)["master_pid"], signal.SIGKILL)
    output, _ = step.communicate(timeout=300)
    assert step.returncode != 0, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: online feed stopped:") and f"the Mooncake master at {address.master}" in last, output[-3000:]
    assert (TrainLayout(out).checkpoints / "0").is_dir(), "the finished epoch is kept"

    # 3. The retry brings the run's store back on its ports; the engine is killed while its samples sit in the store.
    assert ensure_store(folder, "eagleflow/test", start_new=False) == address
    feed.status.unlink()
    step = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: fetched(out) > 5 or step.poll() is not None, "samples after the master came back")
    kill_engine(engine)
    output, _ = step.communicate(timeout=300)
    assert step.returncode != 0, output[-3000:]
    assert f"no engine answered for 3s (engine_wait): engine-0 at {engine.url}" in output, output[-3000:]
    assert [p.name for p in feed.ready.iterdir() if p.name.endswith(".part")] == [], "no half-read sample kept"

    # 4. The engine launched again on its port: the retry resumes and finishes all three epochs.
    back = store_engine(tiny_model, tmp_path, address, port=int(engine.url.rsplit(":", 1)[1]))
    process_groups.append(back.pid)
    retry = run(argv)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert_records(out / "metrics.jsonl", 3, online=True)
    assert sample_keys(address) == [] and list(feed.ready.iterdir()) == []
    assert not [p for p in (tmp_path / "dumps").glob("*") if p.name.endswith(".safetensors")]
    state = read_store_state(folder)
    assert state is not None
    stop_store(folder)
    assert not (folder / STATE_FILE).exists() and not pid_alive(state["master_pid"]) and not pid_alive(state["metadata_pid"])
