"""A tiny DeepSeek-V3-architecture verifier, trained for a minute on the synthetic corpus.

The CPU path of the pipeline needs a verifier with the real model's architecture (MLA
attention, routed experts behind a dense first layer) that runs in seconds, and one that
has learnt something: a random verifier's next-token choices are noise and give the drafter
nothing to learn (DESIGN.md §8). So :func:`make_tiny_model`

1. trains a byte-level BPE tokenizer of exactly ``--vocab`` tokens on the synthetic corpus
   (:mod:`eagleflow.synthetic_data`), with ChatML markers and a chat template whose
   ``{% generation %}`` block gives ``return_assistant_tokens_mask`` the assistant tokens;
2. builds ``DeepseekV3ForCausalLM`` (``--layers`` decoder layers, the first dense, the rest
   with ``--experts`` routed experts, ``--experts-per-token`` active, plus one shared expert);
3. trains it for ``--train-steps`` steps of next-token prediction on that corpus, printing
   step, loss, tokens/s and ETA;
4. measures greedy next-token accuracy on held-out conversations and saves everything in
   bf16 (the dtype the hidden-state files use, DESIGN.md §3.2).

The same arguments give byte-identical files. The folder is built beside ``--out`` and
renamed into place, and it records its parameters in ``eagleflow_tiny_model.json`` (written
last), so a second call with the same parameters returns at once, and a killed build leaves
no half model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, model_validator

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_json
from sglang_patch.file_mode import published_file_mode
from eagleflow.progress import Progress, format_duration
from eagleflow.synthetic_data import corpus_text, generate_conversations

if TYPE_CHECKING:
    import torch

# Bump when the recipe changes (template, architecture defaults, training), so cached
# models made by an older recipe are rebuilt rather than reused.
RECIPE_VERSION = 3
RECORD_NAME = "eagleflow_tiny_model.json"

# speculators' default target layers are [2, n // 2, n - 3]; they are distinct only from 7 layers.
MIN_LAYERS = 7
# 256 byte tokens + the special tokens, and some room for merges.
MIN_VOCAB = 300

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML. The assistant's content and its closing <|im_end|> are the generation: the tokens
# the verifier produces, which the drafter is trained to predict (the loss mask).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The corpus streams are kept apart from the seeds make-dataset users pick (0, 1, …), so the
# verifier has not memorised the very rows it is asked about, and accuracy is measured on
# conversations it never saw.
CORPUS_SEED_OFFSET = 1_000_000
EVAL_SEED_OFFSET = 2_000_000

# One thread, always: the order of floating-point reductions depends on the thread count, so
# a fixed count makes the weights byte-identical run to run and machine to machine (same CPU
# kind); and on a shared 2-core machine two spinning OpenMP threads ran 6x slower than one.
TRAIN_THREADS = 1
# About 2 minutes on one free core; held-out greedy next-token accuracy ~72% (66% on assistant
# tokens), up from ~0% untrained.
DEFAULT_TRAIN_STEPS = 200


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
    batch_size: int = Field(16, description="sequences per training step")
    seq_len: int = Field(256, description="tokens per training sequence")
    lr: float = Field(3e-3, description="peak AdamW learning rate (linear warm-up, cosine decay)")
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


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(config: TinyModelConfig, out_dir: Path) -> Any:
    """Train the byte-level BPE tokenizer on the corpus, save it to ``out_dir`` and load it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = corpus_text(config.corpus_rows, seed=CORPUS_SEED_OFFSET + config.seed)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # One conversation per item, in order: the trainer's input is the same every run.
    backend.train_from_iterator(text.split("\n\n"), trainer=trainer)
    # A small corpus can run out of merges before --vocab; reserved tokens fill the rest (as
    # large models do), so the vocabulary is exactly --vocab and matches the embedding table.
    missing = config.vocab - backend.get_vocab_size()
    if missing > 0:
        backend.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    tokenizer.save_pretrained(str(out_dir))
    # Name the class every transformers version knows (4.x has no "TokenizersBackend"), so the
    # same folder also loads in an SGLang image with an older transformers.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config.pop("backend", None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["additional_special_tokens"] = tokenizer_config.pop("extra_special_tokens", [IM_START, IM_END])
    atomic_write_json(config_path, tokenizer_config)
    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    if len(loaded) != config.vocab or [loaded.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] != list(range(5)):
        raise RuntimeError(f"tokenizer came out with {len(loaded)} tokens, expected {config.vocab} with specials at 0-4")
    return loaded


def encode_conversations(tokenizer: Any, conversations: list[dict]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, assistant_mask)`` of each conversation under the chat template."""
    encoded = []
    for conversation in conversations:
        out = tokenizer.apply_chat_template(
            conversation["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        encoded.append((list(out["input_ids"]), list(out["assistant_masks"])))
    return encoded


# --------------------------------------------------------------------------- model


def build_model_config(config: TinyModelConfig, tokenizer: Any) -> Any:
    """A ``DeepseekV3Config`` with the real model's shape in miniature."""
    from transformers import DeepseekV3Config

    head_dim = config.hidden // config.heads
    return DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden,
        intermediate_size=2 * config.hidden,  # the dense first layer
        moe_intermediate_size=config.hidden,  # each routed expert and the shared one
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        # MLA: low-rank query and key/value projections, rope and no-rope parts of the head.
        q_lora_rank=config.hidden // 2,
        kv_lora_rank=config.hidden // 2,
        qk_rope_head_dim=head_dim,  # heads * head_dim = hidden: the drafter copies this head dim
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        n_routed_experts=config.experts,
        num_experts_per_tok=config.experts_per_token,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        # No multi-token-prediction layer is built or saved; say so rather than claim one.
        num_nextn_predict_layers=0,
        max_position_embeddings=4096,
        # speculators reads lm_head.weight from the safetensors file: keep it a separate tensor.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id],
    )


@contextlib.contextmanager
def fixed_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` intra-op threads, then restore the previous count.

    CPU kernels split reductions by thread count, so the count decides the rounding; with it
    fixed, training gives the same bits run after run (the tests check it). Deterministic
    algorithms are not switched on: they changed no bit here and made evaluation 3x slower.
    """
    import torch

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)


@contextlib.contextmanager
def no_hf_progress_bars() -> Iterator[None]:
    """Silence transformers' tqdm bars for the duration, then restore the previous setting."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def pack_tokens(encoded: list[tuple[list[int], list[int]]], seq_len: int) -> torch.Tensor:
    """Concatenate the conversations and cut them into ``[n, seq_len]`` windows (the tail is dropped)."""
    import torch

    stream = [token for ids, _ in encoded for token in ids]
    n = len(stream) // seq_len
    if n == 0:
        raise UserError(f"--corpus-rows gives {len(stream)} tokens, fewer than one --seq-len window of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Any, windows: torch.Tensor, config: TinyModelConfig) -> float:
    """Next-token training for ``config.train_steps`` steps; returns the mean loss of the last 10 steps."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.01)
    order_rng = torch.Generator().manual_seed(config.seed)
    order = torch.empty(0, dtype=torch.long)
    progress = Progress(config.train_steps, label="steps", every=max(1, config.train_steps // 20), interval=15.0)
    recent: list[float] = []
    tokens = 0
    start = time.monotonic()
    model.train()
    for step in range(config.train_steps):
        if len(order) < config.batch_size:  # a fresh seeded permutation per pass over the windows
            order = torch.cat([order, torch.randperm(len(windows), generator=order_rng)])
        batch, order = windows[order[: config.batch_size]], order[config.batch_size:]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config.train_steps, config.lr)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-10:]
        tokens += batch.numel()
        progress.advance(extra=f"loss {loss.item():.3f} {tokens / (time.monotonic() - start):.0f} tokens/s")
    model.eval()
    return sum(recent) / len(recent) if recent else float("nan")


def evaluate(model: Any, encoded: list[tuple[list[int], list[int]]], batch_size: int = 16) -> dict[str, float]:
    """Loss and greedy next-token accuracy over all tokens and over assistant tokens only.

    Conversations go through in batches of similar length, right-padded: with causal attention
    the padding after a conversation cannot change its logits.
    """
    import torch

    total = correct = assistant_total = assistant_correct = 0
    loss_sum = 0.0
    by_length = sorted(encoded, key=lambda pair: len(pair[0]))
    with torch.no_grad():
        for start in range(0, len(by_length), batch_size):
            batch = by_length[start:start + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            attention = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (ids, _) in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention[row, : len(ids)] = 1
            logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
            for row, (ids, mask) in enumerate(batch):
                predicted = logits[row, : len(ids) - 1]
                targets = input_ids[row, 1 : len(ids)]
                hits = predicted.argmax(-1) == targets
                target_is_assistant = torch.tensor(mask[1:], dtype=torch.bool)
                loss_sum += torch.nn.functional.cross_entropy(predicted, targets, reduction="sum").item()
                total += len(targets)
                correct += int(hits.sum())
                assistant_total += int(target_is_assistant.sum())
                assistant_correct += int(hits[target_is_assistant].sum())
    return {
        "eval_loss": round(loss_sum / max(total, 1), 4),
        "eval_accuracy": round(correct / max(total, 1), 4),
        "eval_assistant_accuracy": round(assistant_correct / max(assistant_total, 1), 4),
        "eval_tokens": total,
    }


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
        tokenizer = train_tokenizer(config, folder)
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
        # Saved and measured in bf16: the dtype of the real verifier and of the hidden states.
        model = model.to(torch.bfloat16)
        metrics = evaluate(model, held_out)
        with no_hf_progress_bars():  # a carriage-return bar would garble the task log
            model.save_pretrained(str(folder))
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
