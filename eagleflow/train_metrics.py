"""Training metrics as JSONL records and readable lines, taken from speculators' metric dicts.

speculators logs one dict per logged step on logger ``speculators.metrics``::

    {"train": {"loss": …, "loss_0": …, "full_acc_0": …, "cond_acc_0": …, …}, "profile": {…,
     "tokens_per_s": …}, "epoch": e, "lr": float | {"Muon": …, "AdamW": …}, "global_step": s}

and one per validation epoch, ``{"val": {"loss_epoch": …, "loss_0_epoch": …, …}, "epoch": e}``,
both with ``extra={"step": s}``. :class:`MetricsRecorder` is a logging handler attached to that
logger; it turns each dict into one record of ``metrics.jsonl`` (the format the plotting and UI
helpers read) and prints one readable line::

    {"kind": "train", "step", "epoch", "lr", "loss", "loss_0", "full_acc_0", "cond_acc_0", …,
     "tokens_per_s", "time"}
    {"kind": "val", "step", "epoch", "loss", "loss_0", "full_acc_0", "cond_acc_0", …, "time"}

Records are appended and flushed one line at a time, so a partial file is always readable.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from eagleflow.files import atomic_write_text
from eagleflow.progress import format_duration

_TTT_LOSS = re.compile(r"^loss_(\d+)$")
PER_STEP_KEYS = ("loss", "full_acc", "cond_acc")


def _number(value: Any) -> float | None:
    """A finite float, or None for NaN/Inf/missing (JSON has no NaN)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _ttt_steps(values: Mapping[str, Any]) -> list[int]:
    return sorted(int(m.group(1)) for key in values if (m := _TTT_LOSS.match(key)))


def _per_step(values: Mapping[str, Any], suffix: str = "") -> dict[str, float | None]:
    out: dict[str, float | None] = {"loss": _number(values.get("loss" + suffix))}
    for k in _ttt_steps({key.removesuffix(suffix): v for key, v in values.items() if key.endswith(suffix)}):
        for name in PER_STEP_KEYS:
            out[f"{name}_{k}"] = _number(values.get(f"{name}_{k}{suffix}"))
    return out


def _lr(value: Any) -> float | None:
    """The AdamW learning rate (the one ``--lr`` sets) when speculators reports several."""
    if isinstance(value, Mapping):
        value = value.get("AdamW", next(iter(value.values()), None))
    return _number(value)


def train_record(msg: Mapping[str, Any], step: int, now: float, world_size: int = 1) -> dict[str, Any]:
    """The ``kind: train`` record of one logged training step."""
    profile = msg.get("profile") or {}
    tokens_per_s = _number(profile.get("tokens_per_s")) if isinstance(profile, Mapping) else None
    record: dict[str, Any] = {"kind": "train", "step": int(step), "epoch": int(msg.get("epoch", 0)), "lr": _lr(msg.get("lr"))}
    record.update(_per_step(msg["train"]))
    # speculators times rank 0's packed batch; every rank processes one of the same size.
    record["tokens_per_s"] = tokens_per_s * world_size if tokens_per_s is not None else None
    record["time"] = now
    return record


def val_record(msg: Mapping[str, Any], step: int, now: float) -> dict[str, Any]:
    """The ``kind: val`` record of one validation epoch (speculators' ``_epoch`` suffix dropped)."""
    record: dict[str, Any] = {"kind": "val", "step": int(step), "epoch": int(msg.get("epoch", 0))}
    record.update(_per_step(msg["val"], suffix="_epoch"))
    record["time"] = now
    return record


def _fmt(value: float | None, digits: int = 3) -> str:
    return "nan" if value is None else f"{value:.{digits}f}"


def format_record(record: Mapping[str, Any]) -> str:
    """``step 12 epoch 0 lr 3.0e-05 loss 4.210 acc0 0.310 acc1 0.120 …`` (accuracies are full_acc_k)."""
    accs = " ".join(
        f"acc{k} {_fmt(record.get(f'full_acc_{k}'))}" for k in _ttt_steps(record)
    )
    if record["kind"] == "val":
        return f"val epoch {record['epoch']} step {record['step']} loss {_fmt(record['loss'], 4)} {accs}"
    lr = "nan" if record.get("lr") is None else f"{record['lr']:.1e}"
    line = f"step {record['step']} epoch {record['epoch']} lr {lr} loss {_fmt(record['loss'], 4)} {accs}"
    if record.get("tokens_per_s") is not None:
        line += f" {record['tokens_per_s']:.0f} tok/s"
    return line


class MetricsRecorder(logging.Handler):
    """Writes each speculators metric dict as a JSONL record and prints a readable line.

    :param path: the ``metrics.jsonl`` to append to.
    :param stream: where readable lines go (stdout: the operator streams it into the task log).
    :param world_size: data-parallel ranks, to report the total token rate.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        stream: TextIO | None = None,
        world_size: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(logging.INFO)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stream = stream or sys.stdout
        self.world_size = world_size
        self.clock = clock
        self.records_written = 0
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        # Progress bookkeeping, set by begin_epoch (speculators' Trainer.train_epoch).
        self._epoch = 0
        self._num_epochs = 0
        self._steps_per_epoch = 0
        self._epoch_first_step = 0
        self._first_time: float | None = None
        self._steps_seen = 0

    def begin_epoch(self, epoch: int, num_epochs: int, steps_per_epoch: int, global_step: int) -> None:
        """Note where training stands, so step lines can carry position and ETA."""
        self._epoch, self._num_epochs = epoch, num_epochs
        self._steps_per_epoch, self._epoch_first_step = steps_per_epoch, global_step

    def _progress(self, step: int, now: float) -> str:
        if not self._steps_per_epoch:
            return ""
        if self._first_time is None:
            self._first_time = now
        self._steps_seen += 1
        local = step - self._epoch_first_step + 1
        # The packing sampler re-packs every epoch, so an epoch may run a step or two past
        # the length its loader announced.
        steps = max(self._steps_per_epoch, local)
        remaining = (steps - local) + (self._num_epochs - self._epoch - 1) * self._steps_per_epoch
        elapsed = now - self._first_time
        rate = (self._steps_seen - 1) / elapsed if elapsed > 0 else 0.0
        eta = format_duration(remaining / rate) if rate > 0 else "?"
        return f" [epoch {self._epoch + 1}/{self._num_epochs} step {local}/{steps} ETA {eta}]"

    def record_for(self, record: logging.LogRecord) -> dict[str, Any] | None:
        """The JSONL record for a log record, or None for what is not a step/epoch metric."""
        msg = record.msg
        step = getattr(record, "step", None)
        if not isinstance(msg, Mapping) or step is None or getattr(record, "hparams", False):
            return None
        if isinstance(msg.get("train"), Mapping):
            return train_record(msg, step, self.clock(), self.world_size)
        if isinstance(msg.get("val"), Mapping):
            return val_record(msg, step, self.clock())
        return None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            out = self.record_for(record)
            if out is None:
                return
            if self._file.closed:  # a later logging.config.dictConfig closes every handler
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(json.dumps(out) + "\n")
            self._file.flush()
            self.records_written += 1
            line = format_record(out)
            if out["kind"] == "train":
                line += self._progress(out["step"], out["time"])
            print(line, file=self.stream, flush=True)
        except Exception:  # a logging handler must never break training
            self.handleError(record)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        super().close()


def read_metrics(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records of a metrics file; a torn last line (process killed mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                return
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def truncate_for_resume(path: str | os.PathLike[str], resume_step: int, last_epoch: int) -> int:
    """Keep only what a resume from a checkpoint will not redo; return how many records were dropped.

    A run killed mid-epoch logged steps past its last checkpoint; the resumed run logs them
    again. Train records with ``step >= resume_step`` and val records of epochs after
    ``last_epoch`` go, so every step appears once in the file. Rewritten atomically.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records = list(read_metrics(path))
    kept = [
        r
        for r in records
        if (r.get("kind") == "train" and r.get("step", 0) < resume_step)
        or (r.get("kind") == "val" and r.get("epoch", 0) <= last_epoch)
    ]
    with open(path, encoding="utf-8") as handle:
        total_lines = sum(1 for _ in handle)
    if len(kept) != total_lines:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return total_lines - len(kept)
