"""``extract``: hidden states for one shard (a range of dataset rows), from a running engine.

For each row not already complete in the sample store, POST ``/generate`` (SGLang's native
API: ``rid``, ``input_ids``, ``max_new_tokens`` 0) with ``concurrency`` requests in flight,
wait for the engine's dump ``<dump_dir>/<rid>.safetensors`` (:mod:`~eagleflow.extract.dump_wait`),
check it (docs/design.md §3.4: its header, its token ids and the writer's finiteness verdict; the
states are not read back) and move it to ``hidden_states/hs_{row}.safetensors`` by rename. The
published files are fsynced in the background and the shard reports ``success`` only after
that barrier. A per-shard manifest records what was done, skipped and failed, and the shard's
totals over every attempt (rows, tokens, bytes: a skipped row's come from the header checked
before it is skipped); a rerun redoes only what is not complete.

Failure policy: 5xx answers and timeouts are retried with backoff (bounded), after
``/abort_request`` of the first rid; a 4xx is not retried and its message names the row; "writer
behind" is retried without using up a retry; a row that still fails is recorded and the shard
carries on, then the step fails naming the rows. A late dump is waited for under its own rid,
never sent again while the engine's writer holds it. An engine that is gone (connection
refused after it was ready, its pid died) or hung (accepts, answers nothing), or a full disk,
stops the shard within seconds. The manifest says ``success`` only when every row is
complete; otherwise ``failed`` or ``interrupted`` (SIGTERM, Ctrl-C), with the reason. One
extraction of a shard runs at a time (a :class:`~eagleflow.files.FolderLock`); a second one
waits ``--lock-wait`` seconds, then refuses naming the first. ``--reextract-complete-shards`` redoes a
complete shard, its former files kept aside until the new ones are complete
(:mod:`~eagleflow.extract.completion`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.data import dataset_table
from eagleflow.verifier import config_int, resolve_aux_layer_ids
from eagleflow.engine import EngineClient, RowFailed, ServerGone, engine_label
from eagleflow.files import pid_alive
from eagleflow.errors import UserError
from eagleflow.extract.config import ExtractConfig, parse_rows
from eagleflow.extract.completion import drop_previous_files, previous_files_dir, set_aside_complete_shard
from eagleflow.extract.dump_wait import DiskFull, remove_dead_writer_statuses
from eagleflow.extract.handoff_reader import StoreUnreachable, handoff_for
from eagleflow.extract.manifest import FAILED, INTERRUPTED, SUCCESS, ShardManifest
from eagleflow.extract.rid_journal import RidJournal
from eagleflow.extract.row_fetch import RowFetcher, SampleShape
from eagleflow.extract.sample_store import SampleState, sample_path, validate
from eagleflow.files import DurabilityBarrier, FolderLock
from eagleflow.layout import RunLayout, hidden_states_dir, shard_name
from eagleflow.progress import Progress
from eagleflow.results import emit_result

MAX_LISTED_FAILURES = 20
MIN_ROWS_AWAITING_DUMPS = 4  # beside the requests in flight, rows whose dump is being written
# Exit status when the engine went away mid-shard (EX_TEMPFAIL): a retry on another engine may succeed.
EXIT_ENGINE_GONE = 75


class ShardExtractor:
    """Extracts one shard; see the module docstring for the policy."""

    def __init__(self, cfg: ExtractConfig, client: EngineClient | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self.start, self.end = parse_rows(cfg.rows)
        self.name = shard_name(self.start, self.end)
        self.hidden_dir = hidden_states_dir(cfg.dataset)
        # --dataset is <run>/dataset in a run folder, so its manifests live beside it.
        self.manifest_path = cfg.manifest or RunLayout(cfg.dataset.parent).shard_manifest(self.name)
        # The rids this shard sent: its own dumps in a folder other consumers may share (rid_journal).
        self.n_slots = len(resolve_aux_layer_ids(cfg.verifier, cfg.aux_layer_ids)) + 1
        self.hidden_size = config_int(cfg.verifier, "hidden_size")
        self.client = client or EngineClient(cfg.server, cfg.request_timeout)
        self.sleep = sleep
        self.engine = engine_label(cfg.engine_name, cfg.server)
        self.report = ShardManifest(self.name, self.start, self.end, engine=self.engine)
        self._stop = threading.Event()
        self._stopped: tuple[str, str] | None = None  # (state, reason) of a shard-wide stop
        self._stop_error: BaseException | None = None  # what _extract re-raises for it
        self._lock = threading.Lock()
        self._durable = DurabilityBarrier()
        shape = SampleShape(self.n_slots, self.hidden_size, cfg.hidden_states_dtype)
        # Its dump folder, or the run's sample store (whose reader takes a sample as long as the shard's longest row).
        largest = 0
        if cfg.sample_store:
            lengths = dataset_table(cfg.dataset, ["seq_len"]).column("seq_len").to_pylist()[self.start : self.end]
            largest = shape.file_bytes(max(lengths, default=1))
        self.handoff = handoff_for(cfg.dump_dir, cfg.sample_store, largest)
        self.rids = RidJournal(self.manifest_path.with_name(f".{self.name}.rids"), self.handoff)
        self.fetcher = RowFetcher(
            self.client, self.handoff, shape,
            cfg.dump_wait, cfg.max_retries, self._stop,
            in_flight=threading.Semaphore(cfg.concurrency),  # requests the engine works on at once
            publish_guard=self._lock,  # a stopped shard publishes nothing more: its manifest has been counted
            say=_say, sleep=sleep,
        )

    # --- the shard -------------------------------------------------------------------
    def run(self) -> ShardManifest:
        """Extract every row of the shard that is not complete; write the manifest.

        The manifest's state is ``success`` only when every row is complete and durable;
        a stop of any kind leaves ``interrupted`` or ``failed`` with the reason, and re-raises.
        Another extraction of the same shard still running is waited for (``--lock-wait``), then
        refused naming it; nothing of the shard is touched then.
        """
        began = time.monotonic()
        for folder in (self.hidden_dir, self.cfg.dump_dir, self.manifest_path.parent):
            folder.mkdir(parents=True, exist_ok=True)
        # Before anything is touched: a second extraction of this shard would send its rows again,
        # and its start-up clean-up would delete the first one's dumps in flight.
        with self.lock():
            return self._run(began)

    def lock(self) -> FolderLock:
        """The shard's lock beside its manifest, ``shards/.rows_S-E.lock``: one extraction of a shard at a time
        (``hidden_states/`` holds only the rows' files)."""
        return FolderLock(
            self.manifest_path.with_name(f".{self.name}.lock"), self.cfg.lock_wait, holder="extraction",
            guarded=f"shard {self.name} of {self.cfg.dataset}",
            why="Two extractions of one shard would send its rows twice and delete each other's dumps",
        )

    def _run(self, began: float) -> ShardManifest:
        table = dataset_table(self.cfg.dataset, ["input_ids"])
        if self.end > len(table):
            raise UserError(f"--rows {self.cfg.rows} is past the end of the dataset ({len(table)} rows)")
        rows = table.slice(self.start, self.end - self.start).column("input_ids").to_pylist()
        if self.cfg.reextract_complete_shards:
            self._set_aside_complete_shard()
        self._write_manifest()  # "running" from the start: a stale state of an earlier attempt would mislead
        watchdog = threading.Thread(target=self._watch_pid, daemon=True) if self.cfg.server_pid else None
        try:
            self._remove_stale_dumps(starting=True)
            todo = self._skip_complete(rows)
            print(
                f"shard {self.name}: {len(rows)} rows, {self.report.skipped} already complete, {len(todo)} to extract "
                f"from {self.engine} with {self.cfg.concurrency} in flight",
                flush=True,
            )
            self._write_manifest()
            if watchdog:
                watchdog.start()
            self._extract(todo)
            if not self.report.failed:
                # The barrier: every file of the shard (this attempt's and earlier ones') is on disk.
                self._durable.wait([sample_path(self.hidden_dir, row) for row in range(self.start, self.end)])
        except KeyboardInterrupt as exc:
            self._stop_shard(INTERRUPTED, f"interrupted ({exc or 'KeyboardInterrupt'}); finished rows are kept, a rerun resumes")
            raise
        except ServerGone as exc:
            self._stop_shard(FAILED, exc.reason)
            raise
        except DiskFull as exc:
            self._stop_shard(FAILED, exc.reason)
            raise
        except BaseException as exc:
            self._stop_shard(FAILED, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            in_flight = sys.exc_info()[1]
            with self._lock:
                self._stop.set()
            self._durable.close()
            self._remove_stale_dumps(starting=False)
            self.report.seconds = round(time.monotonic() - began, 3)
            self.report.state, self.report.error = self._final_state()
            try:
                self._write_manifest()
            except OSError as exc:
                if in_flight is None:
                    raise
                # An error is in flight (e.g. the full disk that stopped the shard): it is the one to report.
                print(f"shard {self.name}: cannot write {self.manifest_path}: {exc}", flush=True)
        if self.report.state == SUCCESS:
            dropped = drop_previous_files(self.manifest_path)
            if dropped:
                print(f"shard {self.name}: re-extracted; its former files in {dropped} are deleted", flush=True)
        return self.report

    def _set_aside_complete_shard(self) -> None:
        """``--reextract-complete-shards``: a complete shard's files go aside until the new ones are complete."""
        moved = set_aside_complete_shard(self.manifest_path, self.hidden_dir, self.start, self.end)
        aside = previous_files_dir(self.manifest_path)
        if moved:
            print(f"shard {self.name}: re-extracting a complete shard: its {moved[1]} files are set aside in {moved[0]} "
                  "until the new ones are complete", flush=True)
        elif aside.exists():
            print(f"shard {self.name}: resuming its re-extraction; the former files stay in {aside} until it is complete",
                  flush=True)

    def _final_state(self) -> tuple[str, str]:
        if self._stopped:
            return self._stopped
        if self.report.failed:
            return FAILED, f"{len(self.report.failed)} row(s) failed"
        missing = (self.end - self.start) - self.report.done - self.report.skipped
        if missing:
            return FAILED, f"{missing} row(s) neither extracted nor failed"
        return SUCCESS, ""

    def _skip_complete(self, rows: list[list[int]]) -> list[tuple[int, list[int]]]:
        todo = []
        for offset, ids in enumerate(rows):
            row = self.start + offset
            check = validate(
                sample_path(self.hidden_dir, row), ids, self.n_slots, self.hidden_size, self.cfg.hidden_states_dtype,
                check_values=False,
            )
            if check.ok:  # its header's token count and the file's size go into the shard's totals
                self.report.count_complete(check.num_tokens, check.num_bytes, extracted=False)
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
        # More rows in progress than requests in flight: a row whose answer came back waits for its
        # dump while the next row's request already runs, so the engine's writer is never idle.
        rows_in_progress = self.cfg.concurrency + max(self.cfg.concurrency, MIN_ROWS_AWAITING_DUMPS)
        pool = ThreadPoolExecutor(rows_in_progress, thread_name_prefix="extract")
        finished_normally = False
        try:
            def submit_next() -> None:
                item = next(queue, None)
                if item is not None and not self._stop.is_set():
                    pending[pool.submit(self._extract_row, *item)] = item[0]

            for _ in range(rows_in_progress):
                submit_next()
            while pending and not self._stopped:
                finished, _ = wait(list(pending), timeout=1.0, return_when=FIRST_COMPLETED)
                for future in finished:
                    row = pending.pop(future)
                    try:
                        n_tokens, n_bytes = future.result()
                    except (ServerGone, DiskFull) as exc:
                        self._stop_shard(FAILED, exc.reason, exc)
                        break
                    except StoreUnreachable as exc:  # the run's sample store: every row would fail alike
                        self._stop_shard(FAILED, str(exc), exc)
                        break
                    except RowFailed as exc:
                        if self._stopped:
                            break  # stopped: the row is not at fault
                        self._row_failed(row, exc.reason)
                    else:
                        self.report.count_complete(n_tokens, n_bytes, extracted=True)
                        tokens += n_tokens
                        written_bytes += n_bytes
                    elapsed = max(time.monotonic() - began, 1e-9)
                    rates = f"{tokens / elapsed:.0f} tokens/s {written_bytes / elapsed / 1e6:.1f} MB/s failed {len(self.report.failed)}"
                    if progress.advance(extra=rates):
                        self._write_manifest()
                    submit_next()
            finished_normally = not self._stopped
        finally:
            # In-flight requests are abandoned, not awaited: a gone server or a SIGTERM must
            # not hold the shard for another --request-timeout.
            if not finished_normally:
                self._stop.set()
            pool.shutdown(wait=finished_normally, cancel_futures=True)
        if self._stopped and self._stop_error is not None:
            raise self._stop_error

    def _extract_row(self, row: int, ids: list[int]) -> tuple[int, int]:
        """One row into ``hidden_states/hs_{row}`` (:class:`~eagleflow.extract.row_fetch.RowFetcher`); ``(tokens, bytes)``."""
        target = sample_path(self.hidden_dir, row)
        sent: list[str] = []

        def on_rid(rid: str | None) -> None:  # None: the last rid sent was collected
            if rid is None:
                self.rids.collected(sent[-1])
            else:
                sent.append(rid)
                self.rids.sent(rid)

        result = self.fetcher.fetch(row, ids, target, on_rid=on_rid)
        self._durable.add(target)
        return result

    # --- bookkeeping -----------------------------------------------------------------
    def _row_failed(self, row: int, reason: str) -> None:
        print(f"row {row}: FAILED: {reason}", flush=True)
        self.report.failed.append({"row": row, "reason": reason})

    def _stop_shard(self, state: str, reason: str, error: BaseException | None = None) -> None:
        """Stop every row of the shard; the first reason given is the one recorded."""
        with self._lock:
            if not self._stopped:
                self._stopped, self._stop_error = (state, reason), error
                print(f"shard {self.name}: stopping ({state}): {reason}", flush=True)
            self._stop.set()

    def _watch_pid(self) -> None:
        while not self._stop.wait(1.0):
            if not pid_alive(self.cfg.server_pid or 0):
                reason = f"engine process {self.cfg.server_pid} is gone (see the server log)"
                self._stop_shard(FAILED, reason, ServerGone(reason))
                return

    def _remove_stale_dumps(self, starting: bool) -> None:
        """Dumps this shard sent for and nobody will collect (a killed attempt's, an aborted rid's): by its
        journal of rids, never by row, so another run's or an online trainer's dumps of the same rows stay."""
        if starting:
            left = self.rids.open()
            if left:
                print(f"shard {self.name}: removed the dumps of {left} request(s) an earlier attempt left", flush=True)
        else:
            self.rids.close()
        remove_dead_writer_statuses(self.handoff)

    def _write_manifest(self) -> None:
        self.report.write(self.manifest_path)


def _say(line: str) -> None:
    print(line, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ExtractConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(ExtractConfig, args)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        extractor = ShardExtractor(cfg)
    except StoreUnreachable as exc:
        print(f"error: extract --rows {cfg.rows}: {exc}; a retry resumes once it answers", flush=True)
        return 1
    try:
        report = extractor.run()
    except ServerGone as exc:
        print(f"error: shard {extractor.name} stopped: {exc.reason}; a retry resumes on an engine that is up", flush=True)
        os._exit(EXIT_ENGINE_GONE)  # worker threads may still sit in a dead connection; the manifest is written
    except (DiskFull, StoreUnreachable) as exc:
        print(f"error: shard {extractor.name} stopped: {getattr(exc, 'reason', exc)}; finished rows are kept, a retry resumes", flush=True)
        os._exit(1)  # worker threads may still sit in a dead connection; the manifest is written
    except KeyboardInterrupt:
        print(f"shard {extractor.name} interrupted; finished rows are kept, a rerun resumes", flush=True)
        os._exit(1)
    emit_result(report.result(extractor.manifest_path))
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
