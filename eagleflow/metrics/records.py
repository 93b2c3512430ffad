"""The training-metrics record: its shape, how speculators' metric dicts become one, how to read them.

speculators logs one dict per logged step on logger ``speculators.metrics``::

    {"train": {"loss": …, "loss_0": …, "full_acc_0": …, "cond_acc_0": …, …}, "profile": {…,
     "tokens_per_s": …}, "epoch": e, "lr": float | {"Muon": …, "AdamW": …}, "global_step": s}

and one per validation epoch, ``{"val": {"loss_epoch": …, "loss_0_epoch": …, …}, "epoch": e}``,
both with ``extra={"step": s}``. Each becomes one line of ``metrics.jsonl``::

    {"kind": "train", "step", "epoch", "lr", "loss", "loss_0", "full_acc_0", "cond_acc_0", …,
     "tokens_per_s", "time"}           (online training adds "data_wait_s": the trainer's wait for
                                        data since the previous logged step)
    {"kind": "val", "step", "epoch", "loss", "loss_0", "full_acc_0", "cond_acc_0", …, "time"}

That is an EAGLE-3 drafter's record: per TTT step k, ``loss_k``, ``full_acc_k`` (share of
positions whose k-th draft token is right) and ``cond_acc_k`` (the same, counting only positions
where the earlier steps were right).

A block drafter (DFlash: ``--speculator-type dflash``) drafts a block of B tokens in one pass;
its dicts carry, once speculators reduced each ``<name>_sum / <name>_total`` into ``<name>``::

    {"train": {"loss": …, "ce_loss": …, "kl_div_loss": …, "full_acc": …, "position_1_acc": …, …,
     "position_3_acc": …, "eal": …, "error_records": …}, "profile": {…}, "epoch", "lr", "global_step"}
    {"val": {"loss_epoch": …, "ce_loss_epoch": …, …, "eal_epoch": …}, "epoch": e}

and become (:func:`is_block`: the dict has ``eal`` or a ``position_k_acc``)::

    {"kind": "train", "step", "epoch", "lr", "loss", "<term>_loss", …, "eal", "full_acc",
     "position_1_acc", …, "position_{B-1}_acc", "tokens_per_s", "time"}   (+ "data_wait_s" online)
    {"kind": "val", "step", "epoch", "loss", "<term>_loss", …, "eal", "full_acc",
     "position_1_acc", …, "position_{B-1}_acc", "time"}

- ``loss``: the weighted sum of the loss terms; ``<term>_loss`` (``ce_loss``, ``kl_div_loss``, …):
  each term unweighted, in speculators' order, present only when the loss has more than one term;
- ``eal``: expected accept length, speculators' headline metric: per block, the leading run of
  right draft slots plus the verifier's bonus token, averaged over blocks (1 … B);
- ``full_acc``: share of the block's draft slots that are right, all slots together;
- ``position_k_acc``: share right at block slot k, k ascending (1 … B-1: slot 0 is the anchor,
  the verifier's own token; a drafter trained with ``--sample-from-anchor`` also has slot 0).

Written by the training step's recorder (:mod:`eagleflow.train.recorder`), read by
:mod:`eagleflow.metrics.reader` (charts, UI) and by resume (:mod:`eagleflow.train.resume`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError

KINDS = ("train", "val")
# Per-TTT-step metric names, in the order they are shown.
STEP_METRICS = ("loss", "full_acc", "cond_acc")
# The optimizer group whose learning rate --lr sets (speculators reports one per group with Muon).
LR_GROUP = "AdamW"

_TTT_LOSS = re.compile(r"^loss_(\d+)$")
# A block drafter's per-slot accuracy and its loss terms (speculators' "<name>_loss").
_POSITION_ACC = re.compile(r"^position_(\d+)_acc$")
_LOSS_TERM = re.compile(r"^[A-Za-z]\w*_loss$")
# The block-wide metrics of a block drafter, in the order they are shown (after the loss terms).
BLOCK_METRICS = ("eal", "full_acc")


def number(value: Any) -> float | None:
    """A finite float, or None for NaN/Inf/missing (JSON has no NaN)."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) else None


def ttt_steps_of(values: Mapping[str, Any]) -> list[int]:
    """The TTT steps k that have a ``loss_k`` key, ascending."""
    return sorted(int(m.group(1)) for key in values if (m := _TTT_LOSS.match(str(key))))


def block_positions_of(values: Mapping[str, Any] | Iterable[str]) -> list[int]:
    """The block slots k that have a ``position_k_acc`` key, ascending."""
    return sorted(int(m.group(1)) for key in values if (m := _POSITION_ACC.match(str(key))))


def loss_terms_of(values: Mapping[str, Any] | Iterable[str]) -> list[str]:
    """The ``<term>_loss`` keys of a block drafter's metrics, in their order."""
    return [str(key) for key in values if _LOSS_TERM.match(str(key))]


def is_block(values: Mapping[str, Any] | Iterable[str]) -> bool:
    """Whether metric names (a record, a metric dict without its ``_epoch`` suffixes, or a frame's
    columns) are a block drafter's: an ``eal`` or a ``position_k_acc``."""
    return any(str(key) == "eal" or _POSITION_ACC.match(str(key)) for key in values)


def preferred_lr(value: Any) -> Any:
    """The learning rate to show: the value itself, or the AdamW group's of a per-group mapping
    (the one ``--lr`` sets), else the first group's."""
    if isinstance(value, Mapping):
        return value.get(LR_GROUP, next(iter(value.values()), None))
    return value


def _per_step(values: Mapping[str, Any], suffix: str = "") -> dict[str, float | None]:
    """The metrics of a record: EAGLE-3's per TTT step, or a block drafter's (see the module docstring)."""
    names = {str(key).removesuffix(suffix): v for key, v in values.items() if str(key).endswith(suffix)}
    out: dict[str, float | None] = {"loss": number(names.get("loss"))}
    if is_block(names):
        for key in loss_terms_of(names):
            out[key] = number(names[key])
        for name in BLOCK_METRICS:
            out[name] = number(names.get(name))
        for k in block_positions_of(names):
            out[f"position_{k}_acc"] = number(names[f"position_{k}_acc"])
        return out
    for k in ttt_steps_of(names):
        for name in STEP_METRICS:
            out[f"{name}_{k}"] = number(names.get(f"{name}_{k}"))
    return out


def train_record(msg: Mapping[str, Any], step: int, now: float, world_size: int = 1) -> dict[str, Any]:
    """The ``kind: train`` record of one logged training step."""
    profile = msg.get("profile") or {}
    tokens_per_s = number(profile.get("tokens_per_s")) if isinstance(profile, Mapping) else None
    record: dict[str, Any] = {
        "kind": "train", "step": int(step), "epoch": int(msg.get("epoch", 0)), "lr": number(preferred_lr(msg.get("lr"))),
    }
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
    """``step 12 epoch 0 lr 3.0e-05 loss 4.210 acc0 0.310 acc1 0.120 …`` (accuracies are full_acc_k);
    a block drafter's: ``step 12 epoch 0 lr 3.0e-03 loss 2.402 eal 1.094 full_acc 0.099 …``."""
    if is_block(record):
        accs = f"eal {_fmt(record.get('eal'))} full_acc {_fmt(record.get('full_acc'))}"
    else:
        accs = " ".join(f"acc{k} {_fmt(record.get(f'full_acc_{k}'))}" for k in ttt_steps_of(record))
    if record["kind"] == "val":
        return f"val epoch {record['epoch']} step {record['step']} loss {_fmt(record['loss'], 4)} {accs}"
    lr = "nan" if record.get("lr") is None else f"{record['lr']:.1e}"
    line = f"step {record['step']} epoch {record['epoch']} lr {lr} loss {_fmt(record['loss'], 4)} {accs}"
    if record.get("tokens_per_s") is not None:
        line += f" {record['tokens_per_s']:.0f} tok/s"
    if record.get("data_wait_s") is not None:
        line += f" data wait {record['data_wait_s']:.2f}s"
    return line


def iter_jsonl(text: str, source: str = "<text>") -> Iterator[dict[str, Any]]:
    """Every JSON object line of ``metrics.jsonl`` text, in order (records of any kind).

    The last line may be half-written while training runs (no newline yet): it is skipped.
    Any other line that does not parse is an error naming the line; blank lines are skipped.
    """
    lines = text.splitlines()
    last_complete = text.endswith(("\n", "\r"))
    for number_, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number_ == len(lines) and not last_complete:
                return  # still being written
            raise UserError(f"{source} line {number_}: not a JSON object ({exc.msg}): {line[:80]!r}") from exc
        if not isinstance(record, dict):
            raise UserError(f"{source} line {number_}: expected a JSON object, got {type(record).__name__}")
        yield record


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` file (none when it does not exist yet); see :func:`iter_jsonl`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return list(iter_jsonl(text, str(path)))
