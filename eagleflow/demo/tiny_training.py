"""Building and training the tiny verifier: its DeepSeek-V3 config, the training loop, the evaluation.

Seeded and single-threaded (:data:`~eagleflow.demo.tiny_model.TRAIN_THREADS`), so the same
parameters give the same bits; :mod:`eagleflow.demo.tiny_model` drives it and caches the folder.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from eagleflow.demo.tiny_tokenizer import IM_END
from eagleflow.errors import UserError
from eagleflow.progress import Progress

if TYPE_CHECKING:
    import torch

    from eagleflow.demo.tiny_model import TinyModelConfig


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
