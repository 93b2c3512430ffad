"""DFlash: a block drafter — one draft pass proposes ``block_size - 1`` tokens after the bonus token.

speculators 0.9.0 trains it (``--speculator-type dflash``) from the same sample files as EAGLE-3: the
aux slots are its context layers, the final pre-norm state builds the targets through the verifier's
frozen norm and head. SGLang 0.5.23 serves it (``--speculative-algorithm DFLASH``); what it computes
is :mod:`eagleflow.drafters.dflash.sglang_rules`'s, the export :mod:`eagleflow.drafters.dflash.sglang_export`, the
reference decoding :mod:`eagleflow.drafters.dflash.reference`. What is trained here must be what SGLang
serves:

- the **full vocabulary**: SGLang argmaxes the target's own head, so a reduced draft vocabulary
  (``d2t``) would be served as another function (vllm-ascend#11374: 25 % → 1.7 % acceptance);
- the **mask token id** SGLang resolves for the verifier's tokenizer, passed explicitly
  (:func:`eagleflow.sglang_rules.choose_mask_token_id`: SGLang's resolution, else the pad token where SGLang
  could not embed its own), so training and serving embed the same row;
- the **target layer ids** passed explicitly (speculators' default ``[2, n//2, n-3]`` is EAGLE-3's, so
  one extraction feeds both families).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagleflow.train import TrainConfig



def train_flags(cfg: TrainConfig, mask_token_id: int | None = None) -> list[str]:
    """speculators flags of a DFlash drafter: block size, the resolved mask token, anchors per packed row.

    No ``--draft-vocab-size``: without it speculators trains the full vocabulary (and the train step
    refused a reduced one before starting).
    """
    if mask_token_id is None:
        raise ValueError("a block drafter is trained with the mask token id SGLang will resolve; resolve it first")
    return [
        "--speculator-type", "dflash",
        "--block-size", str(cfg.block_size),
        "--mask-token-id", str(mask_token_id),
        "--max-anchors", str(cfg.max_anchors),
    ]


def serving_flags(drafter_path: str, steps: int = 1, topk: int = 1, draft_tokens: int | None = None, window: int | None = None) -> list[str]:
    """SGLang's flags serving a DFlash drafter: the block verified per round is ``--speculative-num-draft-tokens``
    (steps and topk are 1: SGLang forces them); the draft's sliding windows are its config's, not a flag."""
    from eagleflow.sglang_rules import check_block_flags

    if draft_tokens is None:
        raise ValueError("a DFlash drafter is served with its block size as --speculative-num-draft-tokens")
    check_block_flags(draft_tokens, steps, topk)
    return [
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", drafter_path,
        "--speculative-num-draft-tokens", str(draft_tokens),
    ]


def check_settings(verifier: Path, aux_layer_ids: Sequence[int], settings: Mapping[str, Any]) -> None:
    """What SGLang would refuse of a DFlash drafter with these settings for ``verifier``, before any work: context
    layers it cannot capture (id 0, the final state, out of order) and a mask token it cannot embed (not below the
    verifier's vocabulary, or not the tokenizer's).

    :raises ValueError: the reason, as training or the export would give it.
    """
    from eagleflow.drafters.dflash.sglang_rules import sglang_target_layer_ids
    from eagleflow.sglang_rules import choose_mask_token_id, resolve_mask_token_id
    from eagleflow.verifier import config_int, load_tokenizer

    sglang_target_layer_ids(aux_layer_ids, config_int(verifier, "num_hidden_layers"))
    given = settings.get("mask_token_id")
    vocab = config_int(verifier, "vocab_size")
    if given is not None and not 0 <= int(given) < vocab:  # refused without the tokenizer's load
        resolve_mask_token_id(None, vocab, int(given))
    choose_mask_token_id(load_tokenizer(verifier), vocab, given)
