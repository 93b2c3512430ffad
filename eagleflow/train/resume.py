"""Where a training run stands in its folder, and what a rerun resumes from.

A rerun with the same ``--out`` resumes from the newest complete epoch checkpoint in
``checkpoints/`` (speculators' own resume, same ``--save-path``) and says which; half-saved
epochs and a stale ``interrupted`` save move to ``previous/<time>/``; settings that shape the
model or the schedule must match the stored run's; ``--restart`` moves the old run aside.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from eagleflow.errors import UserError
from eagleflow.files import atomic_write_text
from eagleflow.layout import TrainLayout
from eagleflow.metrics import read_records
from eagleflow.train.child import TrainLog
from eagleflow.train.config import RESUME_MUST_MATCH, TrainConfig

CHECKPOINT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "training_state.json")


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete epoch checkpoint and the step training continues from."""

    path: Path
    epoch: int  # 0-based, as speculators names the folder
    global_step: int


def epoch_dirs(checkpoints: Path) -> dict[int, Path]:
    """speculators' numbered epoch folders (symlinks such as ``epoch0_end`` are skipped)."""
    if not checkpoints.is_dir():
        return {}
    return {int(p.name): p for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink()}


def checkpoint_complete(path: Path) -> bool:
    """Whether an epoch folder holds everything a resume loads (training_state.json comes last)."""
    if not all((path / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            handle.keys()
        json.loads((path / "training_state.json").read_text())
    except Exception:  # a torn file from a kill mid-save
        return False
    return True


def unvalidated(complete: dict[int, Path], metrics: Path) -> list[Path]:
    """The newest epoch folder when its validation did not finish (no val record, no ``val_metrics.json``).

    speculators saves an epoch's checkpoint, then validates: a run stopped during that validation (an
    online feed that lost its engine or store, a kill) leaves a complete folder of an epoch never
    validated, and a resume from it would never validate that epoch. Its epoch is redone instead.
    Only the newest folder can be such (a later epoch followed every other); without metrics nothing is judged.
    """
    if not complete or not metrics.exists():
        return []
    newest = max(complete)
    validated = {r.get("epoch") for r in read_records(metrics) if r.get("kind") == "val"}
    return [] if newest in validated or (complete[newest] / "val_metrics.json").exists() else [complete[newest]]


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _move_aside(paths: TrainLayout, names: list[Path], log: TrainLog, why: str) -> Path | None:
    present = [p for p in names if p.exists() or p.is_symlink()]
    if not present:
        return None
    target = paths.previous / _stamp()
    target.mkdir(parents=True, exist_ok=True)
    for p in present:
        os.replace(p, target / p.name)
    log.say(f"{why}: moved {', '.join(p.name for p in present)} to {target}")
    return target


def prepare_checkpoints(cfg: TrainConfig, paths: TrainLayout, log: TrainLog) -> ResumePoint | None:
    """Decide between a fresh start and a resume, and leave ``checkpoints/`` ready for speculators.

    ``--restart`` moves the old run aside. Otherwise incomplete epoch folders (a kill during a
    save) move to ``previous/`` so speculators resumes from the newest complete one, a stale
    ``interrupted`` folder moves there too, the resume flags must match the stored run's, and
    ``metrics.jsonl`` loses the records of steps the resume will redo.
    """
    old_run = [paths.checkpoints, paths.metrics, paths.result, paths.config, paths.drafter]
    if cfg.restart:
        _move_aside(paths, old_run, log, "--restart")
        return None
    dirs = epoch_dirs(paths.checkpoints)
    incomplete = [p for _, p in sorted(dirs.items()) if not checkpoint_complete(p)]
    incomplete += unvalidated({e: p for e, p in dirs.items() if p not in incomplete}, paths.metrics)
    stale = [paths.checkpoints / "interrupted"] if (paths.checkpoints / "interrupted").exists() else []
    if incomplete or stale:
        _move_aside(
            paths, incomplete + stale, log,
            "left-overs a resume cannot use (a half-saved epoch, an epoch whose validation did not finish, a SIGTERM save)",
        )
        for link in paths.checkpoints.glob("epoch*_*"):
            if link.is_symlink() and not link.exists():
                link.unlink()
        best = paths.checkpoints / "checkpoint_best"
        if best.is_symlink() and not best.exists():
            best.unlink()
    complete = epoch_dirs(paths.checkpoints)
    if not complete:
        if paths.metrics.exists():
            _move_aside(paths, [paths.metrics], log, "no checkpoint to resume from; metrics of the lost run")
        return None
    if paths.config.exists():
        stored = json.loads(paths.config.read_text())
        if "draft_variant" in stored:  # the family's name before DFlash: eagle3 or eagle3.1
            stored.setdefault("draft_algorithm", stored.pop("draft_variant"))
        current = json.loads(cfg.model_dump_json())
        # A flag added since that run was made: it trained with the flag's default (e.g. block_size None).
        stored = {k: stored.get(k, TrainConfig.model_fields[k].default) for k in RESUME_MUST_MATCH}
        changed = [k for k in RESUME_MUST_MATCH if stored[k] != current.get(k)]
        if changed:
            details = "; ".join(f"--{k.replace('_', '-')} was {stored.get(k)}, now {current.get(k)}" for k in changed)
            raise UserError(
                f"{paths.checkpoints} holds a run made with other settings ({details}); resume with the same "
                f"values or pass --restart"
            )
    epoch = max(complete)
    state = json.loads((complete[epoch] / "training_state.json").read_text())
    point = ResumePoint(complete[epoch].absolute(), epoch, int(state.get("global_step", 0)))
    dropped = truncate_for_resume(paths.metrics, point.global_step, point.epoch)
    log.say(
        f"resuming from checkpoint {point.path} (epoch {epoch + 1} of {cfg.epochs} finished, "
        f"global step {point.global_step})"
        + (f"; dropped {dropped} metric records of steps that will be redone" if dropped else "")
    )
    return point


def best_checkpoint(paths: TrainLayout) -> Path | None:
    """speculators' ``checkpoint_best`` (lowest validation loss), else the newest epoch folder."""
    best = paths.checkpoints / "checkpoint_best"
    if best.exists():
        return best.resolve()
    dirs = epoch_dirs(paths.checkpoints)
    return dirs[max(dirs)].absolute() if dirs else None


def truncate_for_resume(path: str | os.PathLike[str], resume_step: int, last_epoch: int) -> int:
    """Keep only what a resume from a checkpoint will not redo; return how many records were dropped.

    A run killed mid-epoch logged steps past its last checkpoint; the resumed run logs them
    again. Train records with ``step >= resume_step`` and val records of epochs after
    ``last_epoch`` go, so every step appears once in the file. Rewritten atomically.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records = read_records(path)
    kept = [
        r
        for r in records
        if (r.get("kind") == "train" and r.get("step", 0) < resume_step)
        or (r.get("kind") == "val" and r.get("epoch", 0) <= last_epoch)
    ]
    total_lines = len(path.read_text(encoding="utf-8").splitlines())
    if len(kept) != total_lines:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return total_lines - len(kept)
