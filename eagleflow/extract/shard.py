"""``extract``: hidden states for one shard (a range of dataset rows), from a running engine.

For each row not already complete in the sample store, POST ``/generate`` (SGLang's native
API: ``rid``, ``input_ids``, ``max_new_tokens`` 0) with ``concurrency`` requests in flight,
wait for the engine's dump ``<dump_dir>/<rid>.safetensors``, check it (DESIGN.md §3.4) and
move it to ``hidden_states/hs_{row}.safetensors`` by rename. A per-shard manifest records
what was done, skipped and failed; a rerun redoes only what is not complete.

Failure policy: 5xx answers and timeouts are retried with backoff (bounded); a 4xx is not
retried and its message names the row; a row that still fails is recorded and the shard
carries on, then the step fails naming the rows. A server that is gone (connection refused
after it was ready, or its pid died) stops the shard within seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field, field_validator

from eagleflow.config import AuxLayerIds, StoredHiddenStatesDtype, add_model_arguments, model_from_args
from eagleflow.data.verifier import config_int, resolve_aux_layer_ids
from eagleflow.engine.process import engine_label, pid_alive
from eagleflow.errors import UserError
from eagleflow.extract.client import EngineClient, RowFailed, ServerGone, wait_for_dump
from eagleflow.extract.manifest import ShardManifest
from eagleflow.extract.sample_store import SampleState, publish_dump, sample_path, validate
from eagleflow.layout import RunLayout, hidden_states_dir, shard_name
from eagleflow.progress import Progress
from eagleflow.results import emit_result
from sglang_patch.dump_writer import dump_path, error_path
from sglang_patch.request_ids import row_request_glob

MAX_LISTED_FAILURES = 20
# Exit status when the engine went away mid-shard (EX_TEMPFAIL): a retry on another engine may succeed.
EXIT_ENGINE_GONE = 75


class ExtractConfig(BaseModel):
    """Flags of ``python -m eagleflow extract``."""

    dataset: Path = Field(description="training dataset folder (prepare-dataset output)")
    server: str = Field(description="engine base URL, e.g. http://127.0.0.1:30000")
    engine: str = Field("", description="the engine's name (engine-0, …), for the log and the manifest")
    dump_dir: Path = Field(description="folder where the engine writes <rid>.safetensors")
    rows: str = Field(description="START:END, end exclusive")
    model: Path = Field(description="verifier model folder (hidden size)")
    aux_layer_ids: AuxLayerIds = Field(description="captured layer ids; the files hold one more slot, the final state")
    hidden_states_dtype: StoredHiddenStatesDtype
    manifest: Path | None = Field(None, description="shard manifest path; default: the run folder's shards/rows_S-E.json beside --dataset")
    concurrency: int = Field(8, ge=1, le=256, description="requests kept in flight")
    server_pid: int | None = Field(None, description="engine process id on this machine, watched so a dead engine stops the shard at once")
    request_timeout: float = Field(600.0, gt=0, description="seconds to wait for one /generate answer")
    max_retries: int = Field(3, ge=0, description="retries of a row after a 5xx answer or a timeout")
    dump_wait: float = Field(60.0, ge=0, description="seconds to wait for a dump to appear after the answer")
    progress_every: int = Field(50, ge=1, description="print a progress line every this many rows")
    progress_interval: float = Field(30.0, gt=0, description="or every this many seconds")

    @field_validator("rows")
    @classmethod
    def _rows_range(cls, value: str) -> str:
        parse_rows(value)
        return value


def parse_rows(text: str) -> tuple[int, int]:
    """``"0:2000"`` -> ``(0, 2000)``; end exclusive, start < end."""
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError as exc:
        raise ValueError(f"expected START:END, got {text!r}") from exc
    if not 0 <= start < end:
        raise ValueError(f"expected 0 <= START < END, got {text!r}")
    return start, end


class ShardExtractor:
    """Extracts one shard; see the module docstring for the policy."""

    def __init__(self, cfg: ExtractConfig, client: EngineClient | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self.start, self.end = parse_rows(cfg.rows)
        self.name = shard_name(self.start, self.end)
        self.hidden_dir = hidden_states_dir(cfg.dataset)
        # --dataset is <run>/dataset in a run folder, so its manifests live beside it.
        self.manifest_path = cfg.manifest or RunLayout(cfg.dataset.parent).shard_manifest(self.name)
        self.n_slots = len(resolve_aux_layer_ids(cfg.model, cfg.aux_layer_ids)) + 1
        self.hidden_size = config_int(cfg.model, "hidden_size")
        self.client = client or EngineClient(cfg.server, cfg.request_timeout)
        self.sleep = sleep
        self.engine = engine_label(cfg.engine, cfg.server)
        self.report = ShardManifest(self.name, self.start, self.end, engine=self.engine)
        self._stop = threading.Event()
        self._gone: str | None = None
        self._lock = threading.Lock()

    # --- the shard -------------------------------------------------------------------
    def run(self) -> ShardManifest:
        """Extract every row of the shard that is not complete; write the manifest."""
        import datasets

        began = time.monotonic()
        for folder in (self.hidden_dir, self.cfg.dump_dir, self.manifest_path.parent):
            folder.mkdir(parents=True, exist_ok=True)
        try:
            table = datasets.load_from_disk(str(self.cfg.dataset))
        except FileNotFoundError as exc:
            raise UserError(f"--dataset {self.cfg.dataset} is not a prepared dataset: {exc}") from exc
        if self.end > len(table):
            raise UserError(f"--rows {self.cfg.rows} is past the end of the dataset ({len(table)} rows)")
        rows = table.select(range(self.start, self.end)).with_format(None)["input_ids"]
        self._remove_stale_dumps()
        todo = self._skip_complete(rows)
        print(
            f"shard {self.name}: {len(rows)} rows, {self.report.skipped} already complete, {len(todo)} to extract "
            f"from {self.engine} with {self.cfg.concurrency} in flight",
            flush=True,
        )
        self._write_manifest()
        watchdog = threading.Thread(target=self._watch_pid, daemon=True) if self.cfg.server_pid else None
        if watchdog:
            watchdog.start()
        try:
            self._extract(todo)
        finally:
            self._stop.set()
            self._remove_stale_dumps()
            self.report.seconds = round(time.monotonic() - began, 3)
            if self._gone:
                self.report.state, self.report.error = "failed", self._gone
            elif self.report.failed:
                self.report.state = "failed"
            elif self.report.state == "running":
                self.report.state = "success"
            self._write_manifest()
        return self.report

    def _skip_complete(self, rows: list[list[int]]) -> list[tuple[int, list[int]]]:
        todo = []
        for offset, ids in enumerate(rows):
            row = self.start + offset
            check = validate(
                sample_path(self.hidden_dir, row), ids, self.n_slots, self.hidden_size, self.cfg.hidden_states_dtype,
                check_values=False,
            )
            if check.ok:
                self.report.skipped += 1
                continue
            if check.state is SampleState.CORRUPT:
                print(f"row {row}: existing file is corrupt ({check.reason}); redoing it", flush=True)
                sample_path(self.hidden_dir, row).unlink(missing_ok=True)
            todo.append((row, ids))
        return todo

    def _extract(self, todo: list[tuple[int, list[int]]]) -> None:
        progress = Progress(
            len(todo), label="rows", every=self.cfg.progress_every, interval=self.cfg.progress_interval
        )
        began = time.monotonic()
        written_bytes = 0
        tokens = 0
        pending: dict[Future, int] = {}
        queue = iter(todo)
        pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="extract")
        finished_normally = False
        try:
            def submit_next() -> None:
                item = next(queue, None)
                if item is not None and not self._stop.is_set():
                    pending[pool.submit(self._extract_row, *item)] = item[0]

            for _ in range(self.cfg.concurrency):
                submit_next()
            while pending:
                finished, _ = wait(list(pending), timeout=1.0, return_when=FIRST_COMPLETED)
                if self._gone:
                    break
                for future in finished:
                    row = pending.pop(future)
                    try:
                        n_tokens, n_bytes = future.result()
                    except ServerGone as exc:
                        self._server_gone(exc.reason)
                        break
                    except RowFailed as exc:
                        self._row_failed(row, exc.reason)
                    else:
                        self.report.done += 1
                        self.report.tokens += n_tokens
                        self.report.bytes += n_bytes
                        tokens += n_tokens
                        written_bytes += n_bytes
                    elapsed = max(time.monotonic() - began, 1e-9)
                    rates = f"{tokens / elapsed:.0f} tokens/s {written_bytes / elapsed / 1e6:.1f} MB/s failed {len(self.report.failed)}"
                    if progress.advance(extra=rates):
                        self._write_manifest()
                    submit_next()
                if self._gone:
                    break
            finished_normally = not self._gone
        finally:
            # In-flight requests are abandoned, not awaited: a gone server or a SIGTERM must
            # not hold the shard for another --request-timeout.
            if not finished_normally:
                self._stop.set()
            pool.shutdown(wait=finished_normally, cancel_futures=True)
        if self._gone:
            raise ServerGone(self._gone)

    def _extract_row(self, row: int, ids: list[int]) -> tuple[int, int]:
        """One row, with retries of retryable failures; returns ``(tokens, bytes)``."""
        delay = 1.0
        for attempt in range(self.cfg.max_retries + 1):
            if self._stop.is_set():
                raise RowFailed("shard stopped")
            try:
                return self._extract_once(row, ids)
            except RowFailed as exc:
                if not exc.retryable or attempt == self.cfg.max_retries:
                    if exc.retryable:
                        raise RowFailed(f"{exc.reason} (after {attempt + 1} attempts)") from exc
                    raise
                print(f"row {row}: {exc.reason}; retrying in {delay:.0f}s", flush=True)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def _extract_once(self, row: int, ids: list[int]) -> tuple[int, int]:
        rid, meta = self.client.generate(row, ids)
        try:
            cached = int(meta.get("cached_tokens", 0) or 0)
            if cached:
                raise RowFailed(f"engine reused {cached} cached prefix tokens (radix cache on?); states would be short")
            prompt_tokens = meta.get("prompt_tokens")
            if prompt_tokens is not None and int(prompt_tokens) != len(ids):
                raise RowFailed(f"engine counted {prompt_tokens} prompt tokens, the row has {len(ids)}")
            dump = self._wait_for_dump(rid)
            check = validate(dump, ids, self.n_slots, self.hidden_size, self.cfg.hidden_states_dtype)
            if not check.ok:
                raise RowFailed(f"dump {dump.name} is not usable: {check.reason}")
            publish_dump(dump, sample_path(self.hidden_dir, row))
            return len(ids), check.num_bytes
        finally:
            dump_path(self.cfg.dump_dir, rid).unlink(missing_ok=True)
            error_path(self.cfg.dump_dir, rid).unlink(missing_ok=True)

    def _wait_for_dump(self, rid: str) -> Path:
        return wait_for_dump(self.cfg.dump_dir, rid, self.cfg.dump_wait, self._stop, self.sleep)

    # --- bookkeeping -----------------------------------------------------------------
    def _row_failed(self, row: int, reason: str) -> None:
        print(f"row {row}: FAILED: {reason}", flush=True)
        self.report.failed.append({"row": row, "reason": reason})

    def _server_gone(self, reason: str) -> None:
        with self._lock:
            if not self._gone:
                self._gone = reason
                print(f"shard {self.name}: stopping: {reason}", flush=True)
        self._stop.set()

    def _watch_pid(self) -> None:
        while not self._stop.wait(1.0):
            if not pid_alive(self.cfg.server_pid or 0):
                self._server_gone(f"engine process {self.cfg.server_pid} is gone (see the server log)")
                return

    def _remove_stale_dumps(self) -> None:
        """Dumps of this shard's rows left by a killed attempt: nobody will collect them."""
        for row in range(self.start, self.end):
            for stale in self.cfg.dump_dir.glob(row_request_glob(row)):
                stale.unlink(missing_ok=True)

    def _write_manifest(self) -> None:
        self.report.write(self.manifest_path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ExtractConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(ExtractConfig, args)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    extractor = ShardExtractor(cfg)
    try:
        report = extractor.run()
    except ServerGone as exc:
        print(f"error: shard {extractor.name} stopped: {exc.reason}; a retry resumes on an engine that is up", flush=True)
        os._exit(EXIT_ENGINE_GONE)  # worker threads may still sit in a dead connection; the manifest is written
    except KeyboardInterrupt:
        print(f"shard {extractor.name} interrupted; finished rows are kept, a rerun resumes", flush=True)
        os._exit(1)
    emit_result(
        {
            "name": report.name,
            "done": report.done,
            "skipped": report.skipped,
            "failed": len(report.failed),
            "tokens": report.tokens,
            "bytes": report.bytes,
            "seconds": report.seconds,
            "manifest": str(extractor.manifest_path),
        }
    )
    if report.failed:
        rows = ", ".join(str(f["row"]) for f in report.failed[:MAX_LISTED_FAILURES])
        more = len(report.failed) - MAX_LISTED_FAILURES
        print(
            f"error: shard {report.name}: {len(report.failed)} row(s) failed: {rows}{f' and {more} more' if more > 0 else ''}; "
            f"reasons in {extractor.manifest_path}. A retry redoes only these rows.",
            flush=True,
        )
        return 1
    return 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
