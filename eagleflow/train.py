"""``train``: the EAGLE-3 drafter, trained by ``speculators`` in a child process.

``python -m eagleflow train --dataset DATASET --verifier DIR --out TRAIN_DIR --aux-layer-ids 3,31,59``

The step checks its inputs (dataset format, hidden-state files and their shape, layer ids),
builds the draft vocabulary if needed (:mod:`eagleflow.vocab`), gives speculators a verifier it
can read (:mod:`eagleflow.train_verifier`), then starts speculators' own training entry through
:mod:`eagleflow.speculators_entry`: ``python -m eagleflow.speculators_entry …`` on CPU or one
GPU, ``torchrun --nproc-per-node G -m eagleflow.speculators_entry …`` on several. The child's
output goes line by line to stdout and to ``TRAIN_DIR/train.log``; every logged step becomes
a record of ``TRAIN_DIR/metrics.jsonl``; SIGTERM/SIGINT are forwarded to the child's process
group (speculators then saves an ``interrupted`` checkpoint and stops).

A rerun with the same ``--out`` resumes from the newest complete epoch checkpoint in
``TRAIN_DIR/checkpoints/`` (speculators' own resume, same ``--save-path``) and says which;
only ``--restart`` starts from scratch, moving the old run to ``TRAIN_DIR/previous/<time>/``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_json
from eagleflow.results import emit_result
from eagleflow.train_metrics import truncate_for_resume

# Flags whose change between a run and its resume would silently change the model or the
# learning-rate schedule (speculators would stretch or cut the cosine over a new total).
RESUME_MUST_MATCH = (
    "aux_layer_ids",
    "epochs",
    "lr",
    "scheduler_type",
    "scheduler_warmup_ratio",
    "optimizer",
    "total_seq_len",
    "ttt_steps",
    "train_data_ratio",
    "draft_vocab_size",
    "num_layers",
    "draft_config",
)
CHECKPOINT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "training_state.json")


class TrainConfig(BaseModel):
    """Flags of ``python -m eagleflow train``; defaults are the seed run's hyperparameters."""

    dataset: Path = Field(description="training dataset folder with hidden_states/ (DESIGN.md §3.3)")
    verifier: Path = Field(description="verifier model folder (config.json + safetensors)")
    out: Path = Field(description="training folder: checkpoints/, metrics.jsonl, train.log, result.json")
    aux_layer_ids: list[int] = Field(
        description="captured layer ids, as given to extraction (speculators --target-layer-ids)"
    )
    epochs: int = Field(5, ge=1, description="training epochs; resume with the same count")
    lr: float = Field(3e-5, gt=0, description="peak learning rate (AdamW)")
    total_seq_len: int = Field(2048, ge=16, description="tokens packed into one training sequence")
    ttt_steps: int = Field(3, ge=1, description="test-time-training steps the draft is unrolled over")
    noise_std: float = Field(0.05, ge=0, description="standard deviation of the noise added to hidden states")
    scheduler_type: Literal["cosine", "linear", "none"] = Field("cosine", description="learning-rate schedule")
    scheduler_warmup_ratio: float = Field(0.01, ge=0, le=1, description="warmup as a fraction of all steps")
    num_workers: int = Field(4, ge=0, description="data-loader worker processes")
    draft_vocab_size: int = Field(32000, ge=1, description="draft vocabulary size (d2t/t2d built if missing)")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="optimizer; with muon, --lr applies to the AdamW group only"
    )
    num_layers: int = Field(1, ge=1, description="draft decoder layers (ignored with --draft-config)")
    draft_config: Path | None = Field(
        None, description="decoder config JSON (LlamaConfig) fixing the draft layer shape, e.g. for Kimi-K2.5"
    )
    train_data_ratio: float = Field(0.9, gt=0, lt=1, description="fraction of rows trained on; the rest validates")
    log_freq: int = Field(1, ge=1, description="log a metrics record every N steps")
    seed: int = Field(42, description="random seed")
    mask_token_id: int = Field(
        0, ge=0, description="given so speculators does not load the verifier's tokenizer; EAGLE-3 does not use it"
    )
    trust_remote_code: bool = Field(False, description="let transformers run the verifier's own config code")
    hidden_states_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="compute dtype of hidden states")
    loss_implementation: Literal["auto", "fused", "eager"] = Field(
        "auto", description="speculators loss kernel; auto: fused on GPU, eager on CPU"
    )
    draft_attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = Field(
        "auto", description="draft attention; auto: simple_flex_attention on GPU, sdpa on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where to train; auto: cuda when available")
    gpus: int | None = Field(None, ge=1, description="GPUs to train on (torchrun when more than one); default: all")
    restart: bool = Field(False, description="start from scratch; the old run moves to OUT/previous/<time>/")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        ids = self.aux_layer_ids
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"--aux-layer-ids must be distinct non-negative layer ids, got {ids}")
        if self.device == "cpu" and self.gpus is not None:
            raise ValueError("--gpus does not apply with --device cpu")
        return self


@dataclass(frozen=True)
class TrainPaths:
    """Where one training run keeps its files (``<run>/train/`` in the run layout)."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter.json"

    @property
    def config(self) -> Path:
        return self.root / "train-config.json"

    @property
    def verifier_head(self) -> Path:
        return self.root / "verifier-head"

    @property
    def speculators_logs(self) -> Path:
        return self.root / "logs"


class TrainingFailed(Exception):
    """The speculators child failed or stopped early; ``returncode`` is its exit status."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


@dataclass(frozen=True)
class Device:
    kind: Literal["cpu", "cuda"]
    gpus: int


def resolve_device(cfg: TrainConfig) -> Device:
    """``--device auto`` -> cuda when torch sees a GPU; ``--gpus`` defaults to all it sees."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = cfg.device if cfg.device != "auto" else ("cuda" if available else "cpu")
    if kind == "cpu":
        if cfg.gpus is not None:
            raise UserError(f"--gpus {cfg.gpus}: torch sees no GPU (use --device cpu without --gpus to train on CPU)")
        return Device("cpu", 0)
    if available == 0:
        raise UserError("--device cuda: torch sees no GPU")
    gpus = cfg.gpus or available
    if gpus > available:
        raise UserError(f"--gpus {gpus}: torch sees only {available} GPU(s)")
    return Device("cuda", gpus)


# ---------------------------------------------------------------------------------------------
# Input checks


def _text_config(verifier: Path) -> dict[str, Any]:
    from eagleflow.verifier import text_config

    return text_config(verifier)


def check_dataset(cfg: TrainConfig, hidden_size: int) -> int:
    """Fail early, naming the file or row, on what speculators would trip over mid-run; return rows.

    Checks: the folder is a ``datasets`` folder saved in torch format (speculators compares
    each row's ``input_ids`` with ``torch.equal``), every row has its ``hs_{row}`` file, the
    first file has ``len(aux_layer_ids) + 1`` slots of the verifier's hidden size, and both the
    train and the validation split get at least one row.
    """
    import datasets

    from eagleflow.sample_store import sample_path

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
    hs_dir = cfg.dataset / "hidden_states"
    missing = [row for row in range(rows) if not sample_path(hs_dir, row).exists()]
    if missing:
        shown = ", ".join(str(r) for r in missing[:10]) + (" …" if len(missing) > 10 else "")
        raise UserError(
            f"--dataset {cfg.dataset}: {len(missing)} of {rows} rows have no hidden states in {hs_dir} "
            f"(rows {shown}); finish extraction first"
        )
    from safetensors import safe_open

    first = sample_path(hs_dir, 0)
    with safe_open(str(first), framework="pt") as handle:
        shape = list(handle.get_slice("hidden_states").get_shape())
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
    return rows


def check_layer_ids(cfg: TrainConfig, num_layers: int) -> None:
    """speculators accepts ids in ``[0, n]`` (n: the last layer's output); say so in our terms."""
    if max(cfg.aux_layer_ids) > num_layers:
        raise UserError(
            f"--aux-layer-ids {cfg.aux_layer_ids}: the verifier has {num_layers} layers, so ids must be in [0, {num_layers}]"
        )


# ---------------------------------------------------------------------------------------------
# Checkpoints and resume


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


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


class TrainLog:
    """Appends to ``train.log`` and echoes to stdout: what the operator streams into the task log."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 - closed in close()

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.handle.write(text)
        self.handle.flush()

    def say(self, message: str) -> None:
        self.write(f"[eagleflow] {message}\n")

    def close(self) -> None:
        self.handle.close()


def _move_aside(paths: TrainPaths, names: list[Path], log: TrainLog, why: str) -> Path | None:
    present = [p for p in names if p.exists() or p.is_symlink()]
    if not present:
        return None
    target = paths.root / "previous" / _stamp()
    target.mkdir(parents=True, exist_ok=True)
    for p in present:
        os.replace(p, target / p.name)
    log.say(f"{why}: moved {', '.join(p.name for p in present)} to {target}")
    return target


def prepare_checkpoints(cfg: TrainConfig, paths: TrainPaths, log: TrainLog) -> ResumePoint | None:
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
    stale = [paths.checkpoints / "interrupted"] if (paths.checkpoints / "interrupted").exists() else []
    if incomplete or stale:
        _move_aside(paths, incomplete + stale, log, "left-overs a resume cannot use (a half-saved epoch, a SIGTERM save)")
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
        current = json.loads(cfg.model_dump_json())
        changed = [k for k in RESUME_MUST_MATCH if stored.get(k) != current.get(k)]
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


def best_checkpoint(paths: TrainPaths) -> Path | None:
    """speculators' ``checkpoint_best`` (lowest validation loss), else the newest epoch folder."""
    best = paths.checkpoints / "checkpoint_best"
    if best.exists():
        return best.resolve()
    dirs = epoch_dirs(paths.checkpoints)
    return dirs[max(dirs)].absolute() if dirs else None


# ---------------------------------------------------------------------------------------------
# The child process


def speculators_flags(cfg: TrainConfig, verifier: Path, device: Device, paths: TrainPaths) -> list[str]:
    """speculators ``train`` flags for this run (an argv list; nothing goes through a shell)."""
    on_gpu = device.kind == "cuda"
    loss = cfg.loss_implementation if cfg.loss_implementation != "auto" else ("fused" if on_gpu else "eager")
    attn = cfg.draft_attn_impl if cfg.draft_attn_impl != "auto" else ("simple_flex_attention" if on_gpu else "sdpa")
    flags = [
        "--verifier-name-or-path", str(verifier),  # absolute: the checkpoint records it as typed
        "--data-path", str(cfg.dataset.absolute()),
        "--save-path", str(paths.checkpoints.absolute()),
        "--log-dir", str(paths.speculators_logs.absolute()),
        "--target-layer-ids", *[str(i) for i in cfg.aux_layer_ids],
        "--draft-vocab-size", str(cfg.draft_vocab_size),
        "--epochs", str(cfg.epochs),
        "--lr", str(cfg.lr),
        "--optimizer", cfg.optimizer,
        "--total-seq-len", str(cfg.total_seq_len),
        "--ttt-steps", str(cfg.ttt_steps),
        "--noise-std", str(cfg.noise_std),
        "--scheduler-type", cfg.scheduler_type,
        "--scheduler-warmup-ratio", str(cfg.scheduler_warmup_ratio),
        "--num-workers", str(cfg.num_workers),
        "--train-data-ratio", str(cfg.train_data_ratio),
        "--log-freq", str(cfg.log_freq),
        "--seed", str(cfg.seed),
        "--mask-token-id", str(cfg.mask_token_id),
        "--hidden-states-dtype", cfg.hidden_states_dtype,
        "--loss-implementation", loss,
        "--draft-attn-impl", attn,
        # Every epoch: resume needs them. (--save-best would keep only the best one; without it
        # speculators still points checkpoint_best at the lowest validation loss.)
        "--checkpoint-freq", "1",
        "--on-missing", "raise",  # extraction made every file; a gap is a bug, not a vLLM call
    ]
    if cfg.draft_config is not None:
        flags += ["--draft-config", str(cfg.draft_config.absolute())]
    else:
        flags += ["--num-layers", str(cfg.num_layers)]
    if cfg.trust_remote_code:
        flags.append("--trust-remote-code")
    return flags


def child_command(device: Device, paths: TrainPaths, flags: list[str]) -> list[str]:
    """``python -m eagleflow.speculators_entry …``, under torchrun for more than one GPU."""
    entry = ["-m", "eagleflow.speculators_entry", "--metrics", str(paths.metrics.absolute()),
             "--summary", str(paths.drafter.absolute()), "--"]
    if device.kind == "cuda" and device.gpus > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={device.gpus}"]
        return launcher + entry + flags
    return [sys.executable, "-u"] + entry + flags


def child_env(device: Device) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device.kind == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --device cpu on a GPU machine: speculators must not see one
    return env


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when this process dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the operator's process-group kill still reaches us


def run_child(command: list[str], env: dict[str, str], log: TrainLog) -> tuple[int, int | None]:
    """Run the child, stream its output, forward SIGTERM/SIGINT; return (exit code, signal forwarded)."""
    log.say("command: " + " ".join(command))
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        process_group=0,  # its own group, so a forwarded signal reaches torchrun's workers too
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    forwarded: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        forwarded.append(signum)
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            log.write(raw.decode("utf-8", errors="replace"))
        returncode = process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if process.poll() is None:  # we are unwinding on an error: do not leave training behind
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    return returncode, (forwarded[0] if forwarded else None)


# ---------------------------------------------------------------------------------------------
# The step


def _format_count(n: int) -> str:
    return f"{n:,}"


def summary_line(drafter: dict[str, Any]) -> str:
    return (
        f"drafter: {_format_count(drafter['total_parameters'])} parameters "
        f"({_format_count(drafter['trainable_parameters'])} trainable), {drafter['draft_layers']} draft layer(s), "
        f"hidden {drafter['hidden_size']}, draft vocab {drafter['draft_vocab_size']} of verifier vocab "
        f"{drafter['verifier_vocab_size']}, aux layers {drafter['target_layer_ids']}"
    )


def run_training(cfg: TrainConfig) -> dict[str, str]:
    """Run the step; return ``{checkpoint_dir, best_checkpoint, metrics_path, log_path}``.

    :raises UserError: bad input or settings (exit 2).
    :raises TrainingFailed: the child failed or was interrupted (exit: its status).
    """
    from eagleflow.train_verifier import prepare_verifier
    from eagleflow.vocab import VocabConfig, build_vocab

    cfg = cfg.model_copy(
        update={
            "dataset": cfg.dataset.absolute(),
            "verifier": cfg.verifier.absolute(),
            "out": cfg.out.absolute(),
            "draft_config": cfg.draft_config.absolute() if cfg.draft_config else None,
        }
    )
    paths = TrainPaths(cfg.out)
    paths.root.mkdir(parents=True, exist_ok=True)
    log = TrainLog(paths.log)
    try:
        log.say(f"train {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: dataset {cfg.dataset}, verifier {cfg.verifier}")
        text = _text_config(cfg.verifier)
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        check_layer_ids(cfg, layers)
        rows = check_dataset(cfg, hidden)
        if cfg.draft_vocab_size > vocab:
            raise UserError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the verifier vocabulary ({vocab})")
        device = resolve_device(cfg)
        log.say(
            f"{rows} rows; verifier: {layers} layers, hidden {hidden}, vocab {vocab}; "
            f"device {device.kind}" + (f" x{device.gpus}" if device.kind == "cuda" else "")
        )

        resume = prepare_checkpoints(cfg, paths, log)
        if resume is not None and resume.epoch + 1 >= cfg.epochs:
            log.say(f"all {cfg.epochs} epochs are done; nothing to train")
        else:
            build_vocab(VocabConfig(dataset=cfg.dataset, draft_vocab_size=cfg.draft_vocab_size, target_vocab_size=vocab))
            verifier = prepare_verifier(cfg.verifier, paths.verifier_head)
            atomic_write_json(paths.config, json.loads(cfg.model_dump_json()))
            if resume is None:
                log.say(f"starting fresh: {cfg.epochs} epochs, checkpoints in {paths.checkpoints}")
            flags = speculators_flags(cfg, verifier, device, paths)
            returncode, forwarded = run_child(child_command(device, paths, flags), child_env(device), log)
            if forwarded is not None:
                name = signal.Signals(forwarded).name
                raise TrainingFailed(f"training stopped by {name}; rerun the step to resume", 128 + forwarded)
            if returncode != 0:
                raise TrainingFailed(f"speculators exited with status {returncode}; see {paths.log}", returncode)
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
        log.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, TrainConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(TrainConfig, args)
    try:
        result = run_training(cfg)
    except TrainingFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.returncode if 0 < exc.returncode < 256 else 1
    emit_result(result)
    return 0
