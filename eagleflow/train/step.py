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
from typing import TYPE_CHECKING, Any

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.verifier import resolve_aux_layer_ids, text_config
from eagleflow.errors import UserError
from eagleflow.drafters import family
from eagleflow.sglang_rules import serving_target
from eagleflow.files import atomic_write_json
from eagleflow.layout import FeedLayout, TrainLayout
from eagleflow.progress import format_bytes
from eagleflow.results import emit_result
from eagleflow.train.child import (
    TrainerChild, TrainingFailed, TrainLog, child_command, child_env, entry_argv, online_flags, resolve_device, run_child,
    speculators_flags,
)
from eagleflow.train.config import RESUME_MUST_MATCH, TrainConfig
from eagleflow.train.dataset_checks import check_dataset
from eagleflow.train.disk_space import NO_SPACE_ERRNOS, child_failed_message, no_space_reason
from eagleflow.train.failure import failure_cause
from eagleflow.train.lock import TrainFolderLock
from eagleflow.train.nodes import follow_node_0, lead_nodes
from eagleflow.train.resume import best_checkpoint, epoch_dirs, prepare_checkpoints
from eagleflow.train.online.settings import feed_settings, read_status
from eagleflow.train.speculators_support import check_online, installed_release

if TYPE_CHECKING:
    from eagleflow.reuse import MadeFrom


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
    from eagleflow.data import VocabConfig, VocabFiles, build_vocab, load_mappings

    files = VocabFiles(cfg.dataset, cfg.draft_vocab_size)
    if load_mappings(files, verifier_vocab) is not None and files.token_freq.exists():
        log.say(f"draft vocabulary {files.d2t.name}, {files.t2d.name} from {cfg.dataset}")
        return
    log.say(f"no valid draft vocabulary of {cfg.draft_vocab_size} ids in {cfg.dataset}; building it")
    build_vocab(VocabConfig(dataset=cfg.dataset, draft_vocab_size=cfg.draft_vocab_size, target_vocab_size=verifier_vocab))


def resolve_mask_token(cfg: TrainConfig, verifier_vocab: int) -> tuple[int, str] | None:
    """A block drafter's mask token id and how it was chosen (:func:`eagleflow.sglang_rules.choose_mask_token_id`; None for
    EAGLE-3, which never uses one); refuses, before training, what SGLang would refuse or serve otherwise:
    a reduced draft vocabulary, a mask token id not below the vocabulary size."""
    from eagleflow.sglang_rules import BlockRuleError, choose_mask_token_id

    if not family(cfg.draft_algorithm).block:
        return None
    default_vocab = TrainConfig.model_fields["draft_vocab_size"].default
    if cfg.draft_vocab_size != default_vocab and cfg.draft_vocab_size < verifier_vocab:
        raise UserError(
            f"--draft-vocab-size {cfg.draft_vocab_size}: {cfg.draft_algorithm} drafters train the verifier's full vocabulary "
            f"({verifier_vocab}): SGLang serves a block drafter through the target's own head, so a reduced vocabulary "
            "would be served as another function; leave the draft vocabulary size at its default (unused)"
        )
    from eagleflow.verifier import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.verifier, cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        if cfg.mask_token_id is None:
            raise UserError(f"--verifier {cfg.verifier}: no tokenizer to resolve the mask token from ({exc}); give --mask-token-id") from exc
        tokenizer = None
    try:
        return choose_mask_token_id(tokenizer, verifier_vocab, cfg.mask_token_id)
    except BlockRuleError as exc:
        raise UserError(f"--mask-token-id: {exc}") from exc


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
    if cfg.node_rank > 0:  # node-0 prepares the folder and says what to run
        return follow_node_0(cfg)
    paths = TrainLayout(cfg.out)
    paths.root.mkdir(parents=True, exist_ok=True)
    release = installed_release()  # fail before any work; the child checks the names it patches
    online = cfg.hidden_states_source == "engine"
    if online:
        check_online(release)
        if not cfg.engine_urls or cfg.dump_dir is None:
            raise UserError("--hidden-states-source engine needs --engine-urls and --dump-dir (the run's engines)")
    lock = TrainFolderLock(paths.lock, cfg.lock_wait)
    lock.acquire()  # before the folder is touched: resume moves checkpoints aside
    began = time.time()
    log = TrainLog(paths.log)
    trainer: TrainerChild | None = None
    try:
        log.say(f"train {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: dataset {cfg.dataset}, verifier {cfg.verifier}")
        made = made_from(cfg, paths)
        if cfg.train_nodes == 1 and best_checkpoint(paths) is not None:
            reused = made.reuse_or_none(cfg.restart, redo_with="Param restart, flag --restart")
            if reused is not None:
                return reused
        if made.changed("dataset") and not cfg.restart:
            # A cleared failed shard added rows, or shards were re-extracted: what was trained is not this data.
            log.say(f"the dataset changed since the training in {paths.root} began: training again from the start")
            cfg = cfg.model_copy(update={"restart": True})
        device = resolve_device(cfg)
        noise = 0.0 if release.noise_std_flag else cfg.noise_std  # else speculators adds it itself
        if device.gpus <= 1 and cfg.train_nodes == 1:
            # Started now, it imports speculators while we check; it trains once given its flags.
            trainer = TrainerChild(child_command(device, paths, None, noise, online), child_env(device), log, lock)
        text = text_config(cfg.verifier)
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        resolve_aux_layer_ids(cfg.verifier, cfg.captured)
        rows, stored = check_dataset(cfg, hidden)
        if cfg.draft_vocab_size > vocab and not family(cfg.draft_algorithm).block:  # block drafters: the full vocabulary
            raise UserError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the verifier vocabulary ({vocab})")
        mask = resolve_mask_token(cfg, vocab)
        mask_token_id = None if mask is None else mask[0]
        source = f"from the engines ({', '.join(cfg.engine_urls)})" if online else "stored"
        log.say(
            f"{rows} rows, hidden states {source} as {stored}; verifier: {layers} layers, hidden {hidden}, vocab {vocab}; "
            f"device {device.kind}" + (f" x{device.gpus}" if device.kind == "cuda" else "") + f"; speculators {release.version}"
        )

        if cfg.sample_slots is not None:
            log.say(f"one capture for several drafters: layers {cfg.captured}; this drafter reads {cfg.aux_layer_ids} (slots {cfg.sample_slots})")
        resume = prepare_checkpoints(cfg, paths, log)
        trained_seconds = previous_train_seconds(paths)  # what the attempt that trained took, kept by a rerun with nothing to do
        if resume is not None and resume.epoch + 1 >= cfg.epochs:
            log.say(f"all {cfg.epochs} epochs are done; nothing to train")
            if cfg.train_nodes > 1:
                lead_nodes(cfg, device, paths, None, log, lock)  # the other nodes learn it, and stop
        else:
            if not family(cfg.draft_algorithm).block:  # block drafters train the full vocabulary
                ensure_vocab(cfg, vocab, log)
            verifier = prepare_verifier(cfg.verifier, paths.verifier_head)
            atomic_write_json(paths.config, json.loads(cfg.model_dump_json()))
            if resume is None:
                log.say(f"starting fresh: {cfg.epochs} epochs, checkpoints in {paths.checkpoints}")
            if mask is not None:
                log.say(
                    f"{cfg.draft_algorithm} drafter: {cfg.num_layers} layer(s), block {cfg.block_size}, mask token id "
                    f"{mask[0]} ({mask[1]}), the full vocabulary of {vocab}"
                )
            else:
                target = serving_target(cfg.serve_with)
                log.say(f"serving with {target.name}: norm_before_residual {target.norm_before_residual} ({target.why})")
            made.save(None)  # what the checkpoints about to be written are made from
            flags = speculators_flags(cfg, verifier, device, paths, release, stored, mask_token_id)
            if online:
                flags += online_flags(feed_settings(cfg, paths, hidden).write())
            if cfg.train_nodes > 1:
                entry = entry_argv(paths, flags, noise, online, cfg.collective_timeout)
                returncode, forwarded = lead_nodes(cfg, device, paths, entry, log, lock)
            elif trainer is not None:
                returncode, forwarded = trainer.run(flags)
            else:
                returncode, forwarded = run_child(
                    child_command(device, paths, flags, noise, online), child_env(device), log, lock
                )
            if forwarded is not None:
                name = signal.Signals(forwarded).name
                raise TrainingFailed(f"training stopped by {name}; rerun the step to resume", 128 + forwarded)
            if returncode != 0:
                cause = failure_cause(paths, log.start, began, online)  # the gone engine, the torn file: not just the status
                raise TrainingFailed(child_failed_message(returncode, paths, cfg.train_nodes, cause), returncode)
            done = epoch_dirs(paths.checkpoints)
            if not done or max(done) + 1 < cfg.epochs:
                last = max(done) + 1 if done else 0
                raise TrainingFailed(
                    f"speculators stopped after {last} of {cfg.epochs} epochs without an error (interrupted?); "
                    f"rerun the step to resume",
                    1,
                )
            trained_seconds = round(time.time() - began, 1)
        best = best_checkpoint(paths)
        if best is None:
            raise TrainingFailed(f"no checkpoint in {paths.checkpoints}", 1)
        result: dict[str, Any] = {
            "checkpoint_dir": str(paths.checkpoints),
            "best_checkpoint": str(best),
            "metrics_path": str(paths.metrics),
            "log_path": str(paths.log),
            "train_seconds": trained_seconds,
        }
        if online:
            result["online"] = online_summary(FeedLayout(paths.online), log)
        atomic_write_json(paths.result, result)
        made.save(result, [paths.result, best])  # a reuse checks the best checkpoint's files are still as written
        if paths.drafter.exists():
            log.say(summary_line(json.loads(paths.drafter.read_text())))
        log.say(f"best checkpoint {best}")
        return result
    finally:
        if trainer is not None:
            trainer.cancel()  # a no-op once it has trained; else it exits without training
        if online:
            from eagleflow.train.online.journal import settle_journal

            # The child is gone: whatever it left in flight (killed, crashed) is aborted and its dumps removed.
            settle_journal(FeedLayout(paths.online), log.say)
        log.close()
        lock.release()


def made_from(cfg: TrainConfig, paths: TrainLayout) -> MadeFrom:
    """What a training is made from: the dataset's content (its rows, and their hidden states when stored) and the
    settings a resume must match."""
    from eagleflow.data import dataset_fingerprint
    from eagleflow.reuse import MadeFrom

    settings = json.loads(cfg.model_dump_json(include=set(RESUME_MUST_MATCH)))
    dataset = dataset_fingerprint(cfg.dataset, hidden_states=cfg.hidden_states_source == "disk")
    return MadeFrom("train", paths.root, {"dataset": dataset, "settings": settings})


def previous_train_seconds(paths: TrainLayout) -> float | None:
    """The wall seconds the finished training in ``paths`` took (its result.json), None when unknown."""
    try:
        seconds = json.loads(paths.result.read_text()).get("train_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(seconds) if isinstance(seconds, (int, float)) else None


def online_summary(layout: FeedLayout, log: TrainLog) -> dict[str, Any]:
    """The feed's figures for the train result (and the run page): samples fetched, peak bytes held, data wait."""
    status = read_status(layout)
    keys = ("fetched", "fetched_bytes", "cached", "cached_bytes", "peak_bytes", "window_bytes", "cache_bytes", "data_wait_s", "seconds")
    summary = {key: status.get(key) for key in keys}
    if status:
        log.say(
            f"online: {status.get('fetched', 0)} samples fetched ({format_bytes(status.get('fetched_bytes', 0))}), peak on disk "
            f"{format_bytes(status.get('peak_bytes', 0))} (window {format_bytes(status.get('window_bytes', 0))}, cache "
            f"{format_bytes(status.get('cache_bytes', 0))}), trainer waited {status.get('data_wait_s', 0):.1f}s for data"
        )
    return summary


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
