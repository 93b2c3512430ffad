"""The demo's terminal: Airflow's task logs go to a file, the terminal gets one line per task.

``make demo`` runs the DAG in this process (``dag.test()``), where every task logs to its stdout:
about 1,900 lines. :class:`LogsToFile` sends all of it to one file while the DAG runs, and
:func:`task_line` says what a finished task did in one line: its state, its duration and the
figure that matters for it, read from its XCom result (and the files that result names).
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from eagleflow.errors import UserError
from eagleflow.progress import format_bytes, format_duration

TAIL_LINES = 30  # of a failed task's log, on the terminal
NOT_RUN_STATES = ("upstream_failed", "skipped", "removed")  # no duration shown: they took none worth saying


@dataclass(frozen=True)
class TaskOutcome:
    """One finished try of a task instance, as the terminal shows it."""

    task_id: str
    label: str  # ``extract_shard[rows_0-40]``: the task and its map index's name
    state: str
    seconds: float | None
    result: Any = None  # its XCom return value
    map_index: int = -1


def task_line(outcome: TaskOutcome) -> str:
    """``  success          extract_shard[rows_0-40]        2s  40 rows, 5,646 tokens, 2.9 MB of hidden states``."""
    ran = outcome.seconds is not None and outcome.state not in NOT_RUN_STATES
    took = format_duration(outcome.seconds) if ran else ""  # type: ignore[arg-type]
    figure = task_figure(outcome.task_id, outcome.result) if outcome.state == "success" else ""
    return f"  {outcome.state:<15} {outcome.label:<40} {took:>6}  {figure}".rstrip()


def task_figure(task_id: str, result: Any) -> str:
    """The figure that matters for ``task_id``'s ``result`` ('' when there is none to show)."""
    if isinstance(result, dict) and set(result) == {"skipped"}:
        return str(result["skipped"])  # a task that had nothing to do says why
    figure = _FIGURES.get(task_id)
    try:
        return figure(result) if figure else (result if isinstance(result, str) else "")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OSError, UserError):
        # A result of an unexpected shape (an older run's, a partial one) loses its figure, never the line.
        return ""


def _engine(r: dict[str, Any]) -> str:
    if r.get("not_launched"):
        return f"{r['name']}: not launched ({r['not_launched']})"
    return f"{r['name']} at {r['url']}" + (f" (pid {r['pid']})" if r.get("pid") else "")


def _regenerated(r: dict[str, Any]) -> str:
    if not r.get("regenerated"):
        return f"off: {r['source']} used as it is"
    return f"{r['rows']} conversations regenerated ({r['shortened_conversations']} shortened, {r['skipped_rows']} left out)"


def _node(n: dict[str, Any]) -> str:
    drafter = n["drafter"]["name"]
    return n["name"] if n["name"] == drafter else f"{n['name']} ({drafter})"  # several drafters: nodes named after them


def _capture(r: dict[str, Any]) -> str:
    if r.get("passed") is None:
        return "not checked: no engine of this run to check"
    return (f"{'passed' if r['passed'] else 'FAILED'}: worst final-slot logprob error {r['worst_logprob_error']:.3f}, "
            f"top-1 agreement {r['top1_agreement']:.0%}")


def _shard(r: dict[str, Any]) -> str:
    # A shard resumed after a stop says how many rows it extracted now and how many it found done.
    now = f" ({r['done']} extracted now, {r['skipped']} found done)" if r.get("skipped") else ""
    failed = f", {r['failed']} FAILED" if r.get("failed") else ""
    return f"{r['total_rows']} rows{now}{failed}, {r['total_tokens']:,} tokens, {format_bytes(r['total_bytes'])} of hidden states"


def _vocab(r: dict[str, Any]) -> str:
    if "draft_vocab_size" not in r:  # one result per size, when the run's drafters read several
        return "; ".join(_vocab(one) for one in r.values())
    return (f"{r['draft_vocab_size']} of {r['target_vocab_size']} ids ({r['distinct_tokens']} seen), "
            f"{r['coverage']:.1%} of training tokens covered")


def _trained(r: dict[str, Any]) -> str:
    from eagleflow.metrics import latest_metrics, read_metrics

    latest = latest_metrics(read_metrics(r["metrics_path"]))
    val = latest["val"] or {}
    # EAGLE-3: the first draft step's accuracy; a block drafter: every block position's.
    accuracy = ("block accuracy", val.get("full_acc")) if latest["drafter"] == "block" else (
        "step-0 accuracy", (latest["ttt"] or [{}])[0].get("val_full_acc"))
    figures = [f"final val loss {val['loss']:.3f}" if val.get("loss") is not None else "no validation yet"]
    if accuracy[1] is not None:
        figures.append(f"{accuracy[0]} {accuracy[1]:.3f}")
    return ", ".join(figures) + f" ({r['train_seconds']:.0f}s of training)"


def _exported(r: dict[str, Any]) -> str:
    drafter = Path(r["drafter"])
    sglang = json.loads((drafter / "export.json").read_text())["sglang"]
    size = sum(p.stat().st_size for p in Path(r["sglang"]).rglob("*") if p.is_file())
    return f"{sglang['algorithm']} drafter for SGLang, {format_bytes(size)}"


def _evaluated(r: dict[str, Any]) -> str:
    speedup = "disturbed" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
    return f"accept length {r['accept_length']:.2f}, speedup {speedup} one at a time"


def _compared(r: dict[str, Any]) -> str:
    w = r.get("winner")
    if not w:
        return f"no winner; {r['compare']}"
    return f"winner {w['drafter']} ({w['algorithm']}) {w['config']}: {w['mean_speedup']:.2f}x at batch size {w['batch_size']}"


_FIGURES: dict[str, Callable[[Any], str]] = {
    "plan_engines": lambda r: f"{len(r)} engine(s): {', '.join(e['name'] for e in r)}",
    "plan_drafters": lambda r: f"drafters {', '.join(d['name'] for d in r)}",
    "launch_server": _engine,
    "wait_server_ready": lambda r: f"{r['name']} ready at {r['url']}",
    "regenerate_dataset": _regenerated,
    "prepare_dataset": lambda r: (f"{r['rows']} rows, {r['tokens']:,} tokens ({r['truncated']} truncated to {r['max_len']}, "
                                  f"{r['skipped_bad_rows']} bad rows left out)"),
    "dataset_stats": lambda r: (f"mean length {r['mean_len']} tokens; about {format_bytes(r['estimated_bytes'])} of "
                                f"{r['hidden_states_dtype']} hidden states to extract"),
    "verify_capture": _capture,
    "check_disk": lambda r: f"{format_bytes(r['required_bytes'])} needed, {format_bytes(r['free_bytes'])} free",
    "plan_shards": lambda r: f"{len(r)} shard(s) of {r[0]['end'] - r[0]['start']} rows",
    "extract_shard": _shard,
    "build_vocab": _vocab,
    "plan_train_nodes": lambda r: f"{len(r)} training node(s): {', '.join(_node(n) for n in r)}",
    "train_drafter": _trained,
    "plot_metrics": lambda r: f"{len(r['png'])} charts: {', '.join(Path(p).stem for p in r['png'])}",
    "export_drafter": _exported,
    "evaluate_drafter": _evaluated,
    "compare_drafters": _compared,
}


class LogsToFile:
    """While open, everything this process and its children print goes to ``path`` (truncated first).

    File descriptors 1 and 2 point at the file, so child processes and C libraries write there too;
    ``sys.stdout``/``sys.stderr`` and the logging handlers that held them write to fd 1 (under pytest they
    held its capture files, not fd 1). On exit all of them are put back; a handler made while it was open
    keeps writing to fd 1, which is the terminal again.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __enter__(self) -> LogsToFile:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed in __exit__)
        self._saved_fds = {fd: os.dup(fd) for fd in (1, 2)}
        for fd in (1, 2):
            os.dup2(self._file.fileno(), fd)
        self._streams = (sys.stdout, sys.stderr)
        self.stream: TextIO = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace",
                                               line_buffering=True)
        sys.stdout = sys.stderr = self.stream
        self._handlers = [h for h in _stream_handlers() if h.stream in self._streams]
        self._handler_streams = [h.setStream(self.stream) for h in self._handlers]
        return self

    def say(self, line: str) -> None:
        """Print ``line`` where stdout went before this opened (the terminal), not into the file."""
        os.write(self._saved_fds[1], (line + "\n").encode("utf-8", "replace"))

    def offset(self) -> int:
        """How many bytes the file holds, once what was printed so far is in it."""
        self.flush()
        return os.fstat(self._file.fileno()).st_size

    def flush(self) -> None:
        for handler in _stream_handlers():
            handler.flush()
        self.stream.flush()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.flush()
        for handler, stream in zip(self._handlers, self._handler_streams):
            if handler.stream is self.stream:
                handler.setStream(stream)
        sys.stdout, sys.stderr = self._streams
        for fd, saved in self._saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._file.close()


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler]


def log_tail(path: str | Path, start: int = 0, end: int | None = None, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of ``path``'s bytes ``start`` to ``end`` (a task's share of the log)."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(None if end is None else max(0, end - start)).decode("utf-8", "replace")
    return text.splitlines()[-lines:]
