"""A tiny DeepSeek-V3-architecture verifier, trained for a minute on the synthetic corpus.

The CPU path of the pipeline needs a verifier with the real model's architecture (MLA
attention, routed experts behind a dense first layer) that runs in seconds, and one that
has learnt something: a random verifier's next-token choices are noise and give the drafter
nothing to learn (docs/design.md §8). So :func:`make_tiny_model`

1. trains a byte-level BPE tokenizer of exactly ``--vocab`` tokens on the synthetic corpus
   (:mod:`eagleflow.demo.synthetic_data`, :mod:`eagleflow.demo.tiny_tokenizer`), with ChatML markers and a chat template whose
   ``{% generation %}`` block gives ``return_assistant_tokens_mask`` the assistant tokens;
2. builds ``DeepseekV3ForCausalLM`` (``--layers`` decoder layers, the first dense, the rest
   with ``--experts`` routed experts, ``--experts-per-token`` active, plus one shared expert);
3. trains it for ``--train-steps`` steps of next-token prediction on that corpus, printing
   step, loss, tokens/s and ETA;
4. measures greedy next-token accuracy on held-out conversations and saves everything in
   bf16 (the dtype the hidden-state files use, docs/design.md §3.2).

The same arguments give byte-identical files. The folder is built beside ``--out`` and
renamed into place, and it records its parameters in ``eagleflow_tiny_model.json`` (written
last), so a second call with the same parameters returns at once, and a killed build leaves
no half model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.demo.synthetic_data import corpus_text, generate_conversations
from eagleflow.demo.tiny_tokenizer import encode_conversations, train_tokenizer
from eagleflow.demo.tiny_training import build_model_config, evaluate, fixed_threads, no_hf_progress_bars, pack_tokens, train
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_json
from eagleflow.progress import format_duration
from sglang_patch.file_mode import published_file_mode

# Bump when the recipe changes (template, architecture defaults, training, how the record measures),
# so cached models made by an older recipe are rebuilt rather than reused (5: measured in float32).
RECIPE_VERSION = 5
RECORD_NAME = "eagleflow_tiny_model.json"

# speculators' default target layers are [2, n // 2, n - 3]; they are distinct only from 7 layers.
MIN_LAYERS = 7
# 256 byte tokens + the special tokens, and some room for merges.
MIN_VOCAB = 300

# The corpus streams are kept apart from the seeds make-dataset users pick (0, 1, …), so the
# verifier has not memorised the very rows it is asked about, and accuracy is measured on
# conversations it never saw.
CORPUS_SEED_OFFSET = 1_000_000
EVAL_SEED_OFFSET = 2_000_000

# One thread, always: the order of floating-point reductions depends on the thread count, so
# a fixed count makes the weights byte-identical run to run and machine to machine (same CPU
# kind); and on a shared 2-core machine two spinning OpenMP threads ran 6x slower than one.
TRAIN_THREADS = 1
# About 95 s on one free core; held-out greedy next-token accuracy ~70% (64% on assistant
# tokens), up from ~0% untrained. Recipe 3 took twice the batch at lr 3e-3 for 3 points more:
# the build is the suite's largest single cost, so 8 sequences a step at a higher peak lr.
DEFAULT_TRAIN_STEPS = 200
DEFAULT_BATCH_SIZE = 8
DEFAULT_LR = 1e-2


class TinyModelConfig(BaseModel):
    """Flags of ``python -m eagleflow make-tiny-model``; all but ``out`` are the cache key."""

    out: Path = Field(description="folder to write the model, tokenizer and eagleflow_tiny_model.json into")
    layers: int = Field(8, description=f"decoder layers (at least {MIN_LAYERS} for speculators' default target ids)")
    hidden: int = Field(64, description="hidden size")
    heads: int = Field(4, description="attention heads; the rope head dim is hidden / heads")
    experts: int = Field(4, description="routed experts in every layer after the first (dense) one")
    experts_per_token: int = Field(2, description="routed experts active per token")
    vocab: int = Field(1024, description=f"tokenizer and model vocabulary size (at least {MIN_VOCAB})")
    seed: int = Field(0, description="seeds the corpus, the initial weights and the data order")
    train_steps: int = Field(DEFAULT_TRAIN_STEPS, description="next-token training steps (0: leave the weights random)")
    batch_size: int = Field(DEFAULT_BATCH_SIZE, description="sequences per training step")
    seq_len: int = Field(256, description="tokens per training sequence")
    lr: float = Field(DEFAULT_LR, description="peak AdamW learning rate (linear warm-up, cosine decay)")
    corpus_rows: int = Field(4000, description="synthetic conversations the tokenizer and the model train on")
    eval_rows: int = Field(200, description="held-out conversations for the accuracy report")

    @model_validator(mode="after")
    def _check(self) -> TinyModelConfig:
        problems = []
        if self.layers < MIN_LAYERS:
            problems.append(
                f"--layers must be at least {MIN_LAYERS}, got {self.layers}: speculators' default target "
                "layers [2, n//2, n-3] must be distinct"
            )
        if self.hidden < 8 or self.heads < 1 or self.hidden % self.heads or (self.hidden // self.heads) % 2:
            problems.append(
                f"--hidden {self.hidden} must be at least 8 and divisible by --heads {self.heads} "
                "into an even head dim (rotary embeddings rotate pairs)"
            )
        if self.experts < 1 or not 1 <= self.experts_per_token <= self.experts:
            problems.append(
                f"--experts-per-token {self.experts_per_token} must be between 1 and --experts {self.experts}"
            )
        if self.vocab < MIN_VOCAB:
            problems.append(f"--vocab must be at least {MIN_VOCAB} (256 bytes, special tokens, merges), got {self.vocab}")
        for flag, value in (("--batch-size", self.batch_size), ("--seq-len", self.seq_len),
                            ("--corpus-rows", self.corpus_rows), ("--eval-rows", self.eval_rows)):
            if value < 1:
                problems.append(f"{flag} must be at least 1, got {value}")
        if self.train_steps < 0:
            problems.append(f"--train-steps must be at least 0, got {self.train_steps}")
        if not self.lr > 0:
            problems.append(f"--lr must be positive, got {self.lr}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def cache_key(self) -> dict[str, Any]:
        """What decides the folder's content: every field but ``out``, and the recipe version."""
        return {"recipe_version": RECIPE_VERSION, **self.model_dump(mode="json", exclude={"out"})}


# --------------------------------------------------------------------------- the folder


def read_record(out: Path) -> dict[str, Any] | None:
    """The record of a finished build in ``out``, or None."""
    try:
        return json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_cached(config: TinyModelConfig) -> bool:
    """Whether ``config.out`` holds a complete model built with the same parameters."""
    record = read_record(config.out)
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return (
        record is not None
        and record.get("parameters") == config.cache_key()
        and all((config.out / name).is_file() for name in needed)
    )


def build(config: TinyModelConfig, folder: Path) -> dict[str, Any]:
    """Write tokenizer, trained model and record into the empty ``folder``; return the record."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    started = time.monotonic()
    with fixed_threads(TRAIN_THREADS):
        tokenizer = train_tokenizer(corpus_text(config.corpus_rows, seed=CORPUS_SEED_OFFSET + config.seed), config.vocab, folder)
        print(f"tokenizer: {len(tokenizer)} tokens trained on {config.corpus_rows} conversations", flush=True)
        corpus = encode_conversations(tokenizer, generate_conversations(config.corpus_rows, CORPUS_SEED_OFFSET + config.seed))
        held_out = encode_conversations(tokenizer, generate_conversations(config.eval_rows, EVAL_SEED_OFFSET + config.seed))
        windows = pack_tokens(corpus, config.seq_len)

        torch.manual_seed(config.seed)
        model = DeepseekV3ForCausalLM(build_model_config(config, tokenizer))
        parameters = sum(p.numel() for p in model.parameters())
        print(
            f"model: DeepseekV3ForCausalLM, {config.layers} layers, hidden {config.hidden}, {config.experts} experts "
            f"({config.experts_per_token} per token), {parameters:,} parameters; corpus {windows.numel():,} tokens "
            f"in {len(windows)} windows of {config.seq_len}",
            flush=True,
        )
        final_loss = train(model, windows, config) if config.train_steps else None
        # Saved in bf16, the dtype of the real verifier and of the hidden states. Measured with those
        # very bf16 weights computing in float32: CPUs without AVX-512 BF16 emulate bf16 matmuls (3x
        # the time here), and float32 is how the tests' engines serve the model.
        model = model.to(torch.bfloat16)
        with no_hf_progress_bars():  # a carriage-return bar would garble the task log
            model.save_pretrained(str(folder))
        metrics = evaluate(model.to(torch.float32), held_out)
    record = {
        "parameters": config.cache_key(),
        "num_parameters": parameters,
        "final_train_loss": None if final_loss is None else round(final_loss, 4),
        **metrics,
    }
    # Written last: its presence means the folder is complete. No timing in it, so the
    # folder's bytes depend on the parameters alone.
    atomic_write_json(folder / RECORD_NAME, record)
    print(f"built in {format_duration(time.monotonic() - started)}: final train loss {record['final_train_loss']}, "
          f"held-out loss {metrics['eval_loss']}, greedy next-token accuracy {metrics['eval_accuracy']:.1%} "
          f"(assistant tokens {metrics['eval_assistant_accuracy']:.1%}, {metrics['eval_tokens']} tokens)", flush=True)
    return record


def publish(folder: Path, out: Path) -> None:
    """Put the finished ``folder`` at ``out`` by renames, replacing an earlier tiny model there."""
    # save_pretrained writes model.safetensors owner-only; a model is read by other users too
    # (the Airflow worker, a server container).
    for path in folder.iterdir():
        path.chmod(published_file_mode())
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(folder, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(folder, out)


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on building ``out``, so concurrent callers wait and then find it cached."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f".{out.name}.lock"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building {out}", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def make_tiny_model(config: TinyModelConfig) -> Path:
    """Build the tiny verifier in ``config.out`` unless it is already there with the same parameters.

    :return: the model folder, loadable with ``AutoModelForCausalLM`` and ``AutoTokenizer``.
    """
    out = config.out.absolute()
    config = config.model_copy(update={"out": out})
    if is_cached(config):
        print(f"{out} already holds a tiny model with these parameters; nothing to do", flush=True)
        return out
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    with build_lock(out):
        if is_cached(config):  # another process built it while we waited
            print(f"{out} was built by another process with these parameters", flush=True)
            return out
        if out.is_dir() and any(out.iterdir()) and read_record(out) is None:
            # Never replace a folder we did not make: it may be someone's real model.
            raise UserError(f"--out {out} exists and is not a tiny model made by make-tiny-model; choose another folder")
        # Under the lock nobody else builds here: leftovers of killed builds can go.
        for stale in (*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
        folder = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        folder.mkdir()
        try:
            build(config, folder)
            publish(folder, out)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``make-tiny-model``, derived from :class:`TinyModelConfig`."""
    add_model_arguments(parser, TinyModelConfig)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # SystemExit unwinds through make_tiny_model's finally:, which removes the half-built folder.
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    """Build (or find) the tiny model and print where it is."""
    config = model_from_args(TinyModelConfig, args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    print(f"tiny model: {make_tiny_model(config)}")
    return 0
