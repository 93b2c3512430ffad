"""The training step's metrics recorder: speculators' metric dicts -> ``metrics.jsonl`` and the log.

A logging handler attached to logger ``speculators.metrics`` (by
:mod:`eagleflow.train.speculators_entry`, after speculators' own logging setup). Each metric
dict becomes one record (:mod:`eagleflow.metrics.records`), appended and flushed one line at
a time so a partial file is always readable, and one readable line with position and ETA::

    step 12 epoch 0 lr 3.0e-05 loss 4.2100 acc0 0.310 … [epoch 1/5 step 13/400 ETA 5m12s]

(an EAGLE-3 drafter: accN is TTT step N's full_acc) or, for a block drafter (DFlash), its expected
accept length and the share of block slots right::

    step 12 epoch 0 lr 3.0e-03 loss 3.0458 eal 1.031 full_acc 0.031 … [epoch 1/2 step 13/42 ETA 1s]
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from eagleflow.metrics import format_record, train_record, val_record
from eagleflow.progress import format_duration


class MetricsRecorder(logging.Handler):
    """Writes each speculators metric dict as a JSONL record and prints a readable line.

    :param path: the ``metrics.jsonl`` to append to.
    :param stream: where readable lines go (stdout: the operator streams it into the task log).
    :param world_size: data-parallel ranks, to report the total token rate.
    :param data_wait: online training: the trainer's total wait for data so far (seconds); each
        train record gets ``data_wait_s``, the wait since the previous one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        stream: TextIO | None = None,
        world_size: int = 1,
        clock: Callable[[], float] = time.time,
        data_wait: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(logging.INFO)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stream = stream or sys.stdout
        self.world_size = world_size
        self.clock = clock
        self.data_wait = data_wait
        self._data_wait_seen = 0.0
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
            out = train_record(msg, step, self.clock(), self.world_size)
            if self.data_wait is not None:
                total = self.data_wait()
                out["data_wait_s"] = round(total - self._data_wait_seen, 4)
                self._data_wait_seen = total
            return out
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
