"""Benchmark: online training (``--hidden-states-source engine``) against extract-then-train, on the same data.

One reference engine serves both. Offline: extraction of every row into the dataset (the
extractor, 8 in flight), then ``eagleflow train`` from the files. Online: ``eagleflow train``
asking the engine for each sample as it trains (no cache, a window of a few samples). Both train
two epochs with the same flags on the demo's kind of data (synthetic conversations, the tiny
untrained verifier: the figures are about bytes and time, not accuracy). Reported:

- peak bytes of hidden states on disk: offline, the dataset's files (they all exist at once
  before training); online, the feed's own peak (dumps + samples fetched ahead, sampled every
  50 ms), which the window bounds whatever the dataset's size;
- wall time of the online run against extraction + training;
- the share of the online run's training time the trainer waited for data;
- the same online run with ``sample_transport`` mooncake (a second engine handing its samples to a
  Mooncake Store the run starts on 127.0.0.1, the feed reading them back): samples and bytes per
  second of the feed through the store against the dump folder, and its trainer's data-wait share.

Run: ``.venv/bin/python benchmarks/bench_online.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_common import REPO, Row, run_alone

AUX, ROWS, DRAFT_VOCAB, EPOCHS = [2, 4, 6], 120, 256, 2
FLAGS = ["--epochs", str(EPOCHS), "--total-seq-len", "256", "--num-workers", "0", "--draft-vocab-size", str(DRAFT_VOCAB),
         "--device", "cpu", "--lr", "3e-3"]
WINDOW_SAMPLES = 4  # the online window, in largest samples
GOAL_PEAK_RATIO = 0.10


def prepared(work: Path) -> tuple[Path, Path]:
    """The tiny verifier and a prepared dataset of synthetic conversations (no hidden states yet)."""
    from eagleflow.data.chat_tokens import ChatTokenizer
    from eagleflow.data.prepare import write_training_dataset
    from eagleflow.demo.synthetic_data import generate_conversations
    from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model

    model = make_tiny_model(TinyModelConfig(out=REPO / ".cache" / "test-models" / "tiny-random", train_steps=0, corpus_rows=400))
    chat = ChatTokenizer(model)
    encoded = [chat(c["messages"]) for c in generate_conversations(ROWS, seed=5)]
    dataset = work / "dataset"
    write_training_dataset([e[0][:256] for e in encoded], [e[1][:256] for e in encoded], dataset)
    subprocess.run([sys.executable, "-m", "eagleflow", "build-vocab", "--dataset", str(dataset), "--verifier", str(model),
                    "--draft-vocab-size", str(DRAFT_VOCAB)], check=True, capture_output=True, cwd=REPO)
    return model, dataset


def copy_rows(dataset: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(dataset, dest)
    return dest


def engine(model: Path, dump_dir: Path, log: Path, budget: int, store: str | None = None):  # noqa: ANN201 - ServerInfo
    from eagleflow.config import model_to_argv
    from eagleflow.engine.process import Readiness, check_ready, free_port, pid_alive, start_server
    from eagleflow.engine.reference_config import ReferenceEngineConfig

    port = free_port()
    config = ReferenceEngineConfig(model=model, dump_dir=dump_dir, aux_layers=AUX, port=port, dump_queue_bytes=budget, sample_store=store)
    info = start_server([sys.executable, "-m", "eagleflow", "serve-reference", *model_to_argv(config), "--threads", "1"], {},
                        log, log.with_suffix(".json"), f"http://127.0.0.1:{port}", dump_dir)
    while check_ready(info).state is not Readiness.READY:
        if not pid_alive(info.pid):
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.2)
    return info


def timed(argv: list[str]) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - started, done.stdout


def train_argv(dataset: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(model), "--out", str(out),
            "--aux-layer-ids", ",".join(map(str, AUX)), *FLAGS, *extra]


def measure(work: Path) -> list[Row]:
    import datasets

    from eagleflow.engine.process import stop_server
    from eagleflow.engine.sample_store_service import ensure_store, stop_store
    from eagleflow.layout import hidden_states_dir
    from eagleflow.results import find_result
    from sglang_patch.sample_file import sample_file_bytes

    model, dataset = prepared(work)
    lengths = datasets.load_from_disk(str(dataset)).with_format(None)["seq_len"]
    window = WINDOW_SAMPLES * sample_file_bytes(max(lengths), len(AUX) + 1, 64, "bf16")
    dumps = work / "dumps"
    server = engine(model, dumps, work / "engine.log", window)
    try:
        offline = copy_rows(dataset, work / "offline")
        extract_s, _ = timed([sys.executable, "-m", "eagleflow", "extract", "--dataset", str(offline), "--server", server.url,
                              "--dump-dir", str(dumps), "--rows", f"0:{ROWS}", "--verifier", str(model),
                              "--aux-layer-ids", ",".join(map(str, AUX)), "--manifest", str(work / "shard.json")])
        stored = sum(p.stat().st_size for p in hidden_states_dir(offline).iterdir())
        train_s, _ = timed(train_argv(offline, model, work / "offline-train"))
        print(f"offline: extraction {extract_s:.1f}s, training {train_s:.1f}s, {stored:,} bytes of hidden states", flush=True)
        online = copy_rows(dataset, work / "online")
        online_s, stdout = timed(train_argv(online, model, work / "online-train", "--hidden-states-source", "engine",
                                            f"--engine-urls={server.url}", "--dump-dir", str(dumps),
                                            f"--online-window-gb={window / 1e9}"))
    finally:
        stop_server(server.pid, grace=10)
    # The same online run, the samples through the run's Mooncake Store.
    address = ensure_store(work / "store", "eagleflow/bench")
    assert address is not None
    store_server = engine(model, work / "store-dumps", work / "store-engine.log", window, address.to_json())
    raw = (handoff_rate(work, None), handoff_rate(work, address))
    try:
        store_s, store_stdout = timed(train_argv(copy_rows(dataset, work / "store-online"), model, work / "store-train",
                                                 "--hidden-states-source", "engine", f"--engine-urls={store_server.url}",
                                                 "--dump-dir", str(work / "store-dumps"), f"--sample-store={address.to_json()}",
                                                 f"--online-window-gb={window / 1e9}"))
    finally:
        stop_server(store_server.pid, grace=10)
        stop_store(work / "store")
    figures = find_result(stdout.splitlines())["online"]
    through_store = find_result(store_stdout.splitlines())["online"]
    print(f"online through the store: {store_s:.1f}s, {json.dumps(through_store)}", flush=True)
    peak, wait, seconds = figures["peak_bytes"], figures["data_wait_s"], figures["seconds"]
    print(f"online: {online_s:.1f}s, {json.dumps(figures)}", flush=True)
    peak_ratio, time_ratio = peak / stored, online_s / (extract_s + train_s)
    return [
        Row(f"peak disk bytes of hidden states, online vs offline ({ROWS} rows, {EPOCHS} epochs)",
            f"{peak:,} vs {stored:,} B = {peak_ratio:.3f}x", f"<= {GOAL_PEAK_RATIO:.2f}x", peak_ratio <= GOAL_PEAK_RATIO,
            f"online window {WINDOW_SAMPLES} largest samples ({window:,} B), no cache; offline holds the whole dataset; "
            "the online figure stays put as the dataset grows"),
        Row(f"wall time, online training vs offline extraction + training ({EPOCHS} epochs)",
            f"{online_s:.1f} s vs {extract_s:.1f} + {train_s:.1f} s = {time_ratio:.2f}x", "report", None,
            f"online asks the engine again every epoch (one prefill per sample per epoch); on CPU the tiny engine and the "
            "trainer share 2 cores"),
        Row("trainer data-wait share, online", f"{wait:.1f} s of {seconds:.1f} s = {wait / seconds:.1%}", "report", None,
            f"the trainer's wait for batches (online_prefetch 8, {figures['fetched']} samples fetched)"),
        *store_rows(figures, through_store, raw),
    ]


def handoff_rate(work: Path, store: object | None, samples: int = 24, tokens: int = 512, hidden: int = 2048) -> float:
    """MB/s of the hand-off alone, writer to reader (queued, published, read whole, checked, removed): bf16
    samples of ``tokens`` x 4 slots x ``hidden`` (8 MiB each), through the dump folder or the store."""
    import torch

    from eagleflow.extract import handoff_for
    from eagleflow.extract.sample_store import validate
    from sglang_patch.dump_writer import DumpWriter

    sample = torch.randn(tokens, 4, hidden).to(torch.bfloat16)
    ids = torch.arange(tokens)
    size = tokens * 4 * hidden * 2
    dumps, ready = work / f"handoff-{'store' if store else 'file'}", work / f"handoff-ready-{'store' if store else 'file'}"
    ready.mkdir(parents=True, exist_ok=True)
    writer = DumpWriter(dumps, max_pending_bytes=4 * size, sample_store=store)
    reader = handoff_for(dumps, store.to_json() if store else None, 2 * size)  # type: ignore[attr-defined]
    started = time.perf_counter()
    for n in range(samples):
        rid = f"row{n}-bench"
        assert writer.submit(rid, sample, ids)
        writer.flush(60)
        local = reader.local_copy(rid, ready / f"hs_{n}.safetensors")
        assert validate(local, ids.tolist(), 4, hidden, "bf16", trust_writer_verdict=True).ok
        reader.discard(rid, ready / f"hs_{n}.safetensors")
    seconds = time.perf_counter() - started
    writer.close()
    return samples * size / seconds / 1e6


def store_rows(by_file: dict, by_store: dict, raw: tuple[float, float]) -> list[Row]:  # noqa: D103 - file vs Mooncake Store
    def rates(figures: dict) -> tuple[float, float]:
        return figures["fetched"] / figures["seconds"], figures["fetched_bytes"] / figures["seconds"] / 1e6

    (file_n, file_mb), (store_n, store_mb) = rates(by_file), rates(by_store)
    wait, seconds = by_store["data_wait_s"], by_store["seconds"]
    return [
        Row("feed samples/s and MB/s, Mooncake Store vs dump folder",
            f"{store_n:.1f} vs {file_n:.1f} samples/s, {store_mb:.2f} vs {file_mb:.2f} MB/s = {store_n / file_n:.2f}x",
            "report", None, "the same rows and window; the tiny engine's prefill, not the transport, sets the pace on 2 cores"),
        Row("trainer data-wait share, online through the store", f"{wait:.1f} s of {seconds:.1f} s = {wait / seconds:.1%}",
            "report", None, "sample_transport mooncake: master and metadata server on 127.0.0.1, TCP"),
        Row("hand-off alone, MB/s, Mooncake Store vs dump folder", f"{raw[1]:.0f} vs {raw[0]:.0f} MB/s = {raw[1] / raw[0]:.2f}x",
            "report", None, "8 MiB bf16 samples one at a time: queued, put (or written), read whole (or found), checked, "
            "removed; the folder's file is found in place, the store's copied out of the engine's segment over TCP"),
    ]


if __name__ == "__main__":
    sys.exit(run_alone(measure, "bench-online"))
