"""Plain greedy decoding with a ``transformers`` model: what a lossless speculative decoder must reproduce token for token."""

from __future__ import annotations

from typing import Any

import torch


def greedy(model: Any, ids: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding, one token per forward, up to and including the first stop token."""
    out: list[int] = []
    cache, step = None, list(ids)
    with torch.no_grad():
        while len(out) < max_new_tokens and not (out and out[-1] in stop_ids):
            result = model(input_ids=torch.tensor([step]), past_key_values=cache, use_cache=True)
            cache, step = result.past_key_values, [int(result.logits[0, -1].argmax())]
            out += step
    return out


def stop_ids(model: Any) -> set[int]:
    """The model's end-of-sequence ids (its generation config's)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])
