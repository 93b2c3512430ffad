"""``train``: the EAGLE-3 drafter, trained by ``speculators`` in a child process.

``python -m eagleflow train --dataset DATASET --verifier DIR --out TRAIN_DIR --aux-layer-ids 3,31,59``

The step checks its inputs (dataset format, hidden-state files and their shape, layer ids),
uses the draft vocabulary (:mod:`eagleflow.data.vocab`; built only if missing), gives
speculators a verifier it can read (:mod:`eagleflow.train.verifier_head`), decides between a
fresh start and a resume (:mod:`eagleflow.train.resume`), then runs speculators as its child
(:mod:`eagleflow.train.child`; started first, so its imports overlap these checks); every logged step becomes a record of
``TRAIN_DIR/metrics.jsonl`` (:mod:`eagleflow.train.recorder`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.data.verifier import resolve_aux_layer_ids, text_config
from eagleflow.errors import UserError
from eagleflow.export.targets import serving_target
from eagleflow.files import atomic_write_json
from eagleflow.layout import TrainLayout, hidden_states_dir
from eagleflow.results import emit_result
from eagleflow.train.child import (
    TrainerChild, TrainingFailed, TrainLog, child_command, child_env, resolve_device, run_child, speculators_flags,
)
from eagleflow.train.config import TrainConfig
from eagleflow.train.disk_space import NO_SPACE_ERRNOS, child_failed_message, no_space_reason
from eagleflow.train.lock import TrainFolderLock
from eagleflow.train.resume import best_checkpoint, epoch_dirs, prepare_checkpoints
from eagleflow.train.speculators_support import installed_release
from sglang_patch.sample_format import HiddenStatesDtype


def check_dataset(cfg: TrainConfig, hidden_size: int) -> tuple[int, HiddenStatesDtype]:
    """Fail early, naming the file or row, on what speculators would trip over mid-run.

    Checks: the folder is a ``datasets`` folder saved in torch format (speculators compares
    each row's ``input_ids`` with ``torch.equal``), every row has its ``hs_{row}`` file, all in
    one storage dtype (read from each header: the dtype decides how speculators reads them),
    the first file has ``len(aux_layer_ids) + 1`` slots of the verifier's hidden size, and both
    the train and the validation split get at least one row. Returns the rows and the dtype.
    """
    import datasets

    from safetensors import safe_open

    from eagleflow.extract.sample_store import sample_path, stored_dtype
    from sglang_patch.sample_file import HIDDEN_STATES_KEY  # it imports torch: not before the child has started

    state = cfg.dataset / "state.json"
    if not state.exists():
        raise UserError(f"--dataset {cfg.dataset} is not a prepared dataset (no state.json)")
    format_type = json.loads(state.read_text()).get("_format_type")
    if format_type != "torch":
        raise UserError(
            f"--dataset {cfg.dataset} is saved in format {format_type!r}; speculators reads rows as torch "
            f"tensors, so the dataset must be saved after set_format('torch') (re-run prepare-dataset)"
        )
    table = datasets.load_from_disk(str(cfg.dataset))
    missing_columns = {"input_ids", "loss_mask", "seq_len"} - set(table.column_names)
    if missing_columns:
        raise UserError(f"--dataset {cfg.dataset} lacks column(s) {sorted(missing_columns)}")
    rows = len(table)
    hs_dir = hidden_states_dir(cfg.dataset)
    missing = [row for row in range(rows) if not sample_path(hs_dir, row).exists()]
    if missing:
        raise UserError(
            f"--dataset {cfg.dataset}: {len(missing)} of {rows} rows have no hidden states in {hs_dir} "
            f"(rows {_rows_text(missing)}); finish extraction first"
        )
    stored_as: dict[HiddenStatesDtype | None, list[int]] = {}
    for row in range(rows):
        stored_as.setdefault(stored_dtype(sample_path(hs_dir, row)), []).append(row)
    if len(stored_as) > 1 or None in stored_as:
        kinds = "; ".join(
            f"{dtype or 'unreadable or another dtype'}: rows {_rows_text(found)}" for dtype, found in stored_as.items()
        )
        raise UserError(
            f"--dataset {cfg.dataset}: the hidden-state files are not all stored alike ({kinds}); "
            "re-extract the odd rows with the run's hidden_states_dtype"
        )
    (dtype,) = stored_as
    first = sample_path(hs_dir, 0)
    with safe_open(str(first), framework="pt") as handle:
        shape = list(handle.get_slice(HIDDEN_STATES_KEY).get_shape())
    expected = [len(cfg.aux_layer_ids) + 1, hidden_size]
    if shape[1:] != expected:
        raise UserError(
            f"{first} has hidden_states of shape {shape}; --aux-layer-ids {cfg.aux_layer_ids} and the verifier's "
            f"hidden size need [seq_len, {expected[0]}, {expected[1]}] (aux slots + the final state)"
        )
    train_rows = int(rows * cfg.train_data_ratio)
    if not 0 < train_rows < rows:
        raise UserError(
            f"--train-data-ratio {cfg.train_data_ratio} of {rows} rows leaves the train or the validation split empty"
        )
    return rows, dtype  # type: ignore[return-value]  # None was refused above


def _rows_text(rows: list[int]) -> str:
    return ", ".join(str(r) for r in rows[:10]) + (" …" if len(rows) > 10 else "")


def _format_count(n: int) -> str:
    return f"{n:,}"


def summary_line(drafter: dict[str, Any]) -> str:
    return (
        f"drafter: {_format_count(drafter['total_parameters'])} parameters "
        f"({_format_count(drafter['trainable_parameters'])} trainable), {drafter['draft_layers']} draft layer(s), "
        f"hidden {drafter['hidden_size']}, draft vocab {drafter['draft_vocab_size']} of verifier vocab "
        f"{drafter['verifier_vocab_size']}, aux layers {drafter['target_layer_ids']}"
    )


def ensure_vocab(cfg: TrainConfig, verifier_vocab: int, log: TrainLog) -> None:
    """Use the draft vocabulary ``build-vocab`` made; build it only when it is missing or invalid.

    In the DAG the build_vocab task has made it already; run by hand, ``train`` needs no
    separate step.
    """
    from eagleflow.data.vocab import VocabConfig, VocabFiles, build_vocab, load_mappings

    files = VocabFiles(cfg.dataset, cfg.draft_vocab_size)
    if load_mappings(files, verifier_vocab) is not None and files.token_freq.exists():
        log.say(f"draft vocabulary {files.d2t.name}, {files.t2d.name} from {cfg.dataset}")
        return
    log.say(f"no valid draft vocabulary of {cfg.draft_vocab_size} ids in {cfg.dataset}; building it")
    build_vocab(VocabConfig(dataset=cfg.dataset, draft_vocab_size=cfg.draft_vocab_size, target_vocab_size=verifier_vocab))


def run_training(cfg: TrainConfig) -> dict[str, str]:
    """Run the step; return ``{checkpoint_dir, best_checkpoint, metrics_path, log_path}``.

    :raises UserError: bad input or settings (exit 2).
    :raises TrainingFailed: the child failed or was interrupted (exit: its status).
    """
    from eagleflow.train.verifier_head import prepare_verifier

    cfg = cfg.model_copy(
        update={
            "dataset": cfg.dataset.absolute(),
            "verifier": cfg.verifier.absolute(),
            "out": cfg.out.absolute(),
            "draft_config": cfg.draft_config.absolute() if cfg.draft_config else None,
        }
    )
    paths = TrainLayout(cfg.out)
    paths.root.mkdir(parents=True, exist_ok=True)
    release = installed_release()  # fail before any work; the child checks the names it patches
    lock = TrainFolderLock(paths.lock, cfg.lock_wait)
    lock.acquire()  # before the folder is touched: resume moves checkpoints aside
    log = TrainLog(paths.log)
    trainer: TrainerChild | None = None
    try:
        log.say(f"train {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: dataset {cfg.dataset}, verifier {cfg.verifier}")
        device = resolve_device(cfg)
        noise = 0.0 if release.noise_std_flag else cfg.noise_std  # else speculators adds it itself
        if device.gpus <= 1:
            # Started now, it imports speculators while we check; it trains once given its flags.
            trainer = TrainerChild(child_command(device, paths, None, noise), child_env(device), log, lock)
        text = text_config(cfg.verifier)
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        resolve_aux_layer_ids(cfg.verifier, cfg.aux_layer_ids)
        rows, stored = check_dataset(cfg, hidden)
        if cfg.draft_vocab_size > vocab:
            raise UserError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the verifier vocabulary ({vocab})")
        log.say(
            f"{rows} rows, hidden states stored as {stored}; verifier: {layers} layers, hidden {hidden}, vocab {vocab}; "
            f"device {device.kind}" + (f" x{device.gpus}" if device.kind == "cuda" else "") + f"; speculators {release.version}"
        )

        resume = prepare_checkpoints(cfg, paths, log)
        if resume is not None and resume.epoch + 1 >= cfg.epochs:
            log.say(f"all {cfg.epochs} epochs are done; nothing to train")
        else:
            ensure_vocab(cfg, vocab, log)
            verifier = prepare_verifier(cfg.verifier, paths.verifier_head)
            atomic_write_json(paths.config, json.loads(cfg.model_dump_json()))
            if resume is None:
                log.say(f"starting fresh: {cfg.epochs} epochs, checkpoints in {paths.checkpoints}")
            target = serving_target(cfg.serve_with)
            log.say(f"serving with {target.name}: norm_before_residual {target.norm_before_residual} ({target.why})")
            flags = speculators_flags(cfg, verifier, device, paths, release, stored)
            if trainer is not None:
                returncode, forwarded = trainer.run(flags)
            else:
                returncode, forwarded = run_child(child_command(device, paths, flags, noise), child_env(device), log, lock)
            if forwarded is not None:
                name = signal.Signals(forwarded).name
                raise TrainingFailed(f"training stopped by {name}; rerun the step to resume", 128 + forwarded)
            if returncode != 0:
                raise TrainingFailed(child_failed_message(returncode, paths), returncode)
            done = epoch_dirs(paths.checkpoints)
            if not done or max(done) + 1 < cfg.epochs:
                last = max(done) + 1 if done else 0
                raise TrainingFailed(
                    f"speculators stopped after {last} of {cfg.epochs} epochs without an error (interrupted?); "
                    f"rerun the step to resume",
                    1,
                )
        best = best_checkpoint(paths)
        if best is None:
            raise TrainingFailed(f"no checkpoint in {paths.checkpoints}", 1)
        result = {
            "checkpoint_dir": str(paths.checkpoints),
            "best_checkpoint": str(best),
            "metrics_path": str(paths.metrics),
            "log_path": str(paths.log),
        }
        atomic_write_json(paths.result, result)
        if paths.drafter.exists():
            log.say(summary_line(json.loads(paths.drafter.read_text())))
        log.say(f"best checkpoint {best}")
        return result
    finally:
        if trainer is not None:
            trainer.cancel()  # a no-op once it has trained; else it exits without training
        log.close()
        lock.release()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, TrainConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(TrainConfig, args)
    try:
        result = run_training(cfg)
    except TrainingFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.returncode if 0 < exc.returncode < 256 else 1
    except OSError as exc:  # the disk of --out filled up under the step itself (train.log)
        if exc.errno not in NO_SPACE_ERRNOS:
            raise
        print(f"error: {no_space_reason(TrainLayout(cfg.out.absolute()), force=True)}", file=sys.stderr, flush=True)
        return 1
    emit_result(result)
    return 0
