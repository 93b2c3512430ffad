"""DSpark: speculators' train flags and SGLang's serving flags.

speculators 0.9.0 trains it (``--speculator-type dspark``, ``speculators/models/dspark/``) from the same
sample files as DFlash, whose rules it keeps (:mod:`eagleflow.drafters.dflash.flags`): the **full
vocabulary** (SGLang's Markov head and base logits span the target's whole vocabulary: ``markov_w1``
and ``markov_w2`` are ``[vocab_size, markov_rank]`` there, and a reduced draft head would not even load)
and the **mask token id** SGLang resolves, passed explicitly. What is DSpark's own:

- the block: ``--block-size γ`` drafts γ tokens in one pass, the bonus token's slot included
  (``sample_from_anchor``, speculators' DSpark default, passed explicitly: SGLang 0.5.23's DSPARK
  worker proposes from the anchor row, so a checkpoint trained without it would be served shifted);
- the Markov head (``--markov-rank``, ``--markov-head-type``): each drafted token's logits get a
  low-rank bias from the token before it, the dataset's in training (teacher forcing, as DeepSpec's
  reference trainer does) and the draft's own when served, which under lossless verification is the
  same token on every accepted prefix;
- the confidence head, trained with speculators' BCE weight (``--confidence-head-alpha``) on the
  Markov embedding too (``--confidence-head-with-markov``): SGLang builds it outside its default
  ``static`` verify mode and requires its weights there, and calibrates it per position from
  ``--speculative-dspark-confidence-sts-path``.

Serving (``srt/arg_groups/speculative_hook.py`` ``_handle_dspark``): ``--speculative-algorithm DSPARK``,
``--speculative-dspark-block-size γ`` and ``--speculative-num-draft-tokens γ + 1`` (the verify window:
the bonus token and the γ drafts; SGLang refuses any other value beside the block size), steps and topk
1 (SGLang forces them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagleflow.train import TrainConfig

# speculators 0.9.0's DSpark recipe (train/config/schema.py DSparkArgs): what eagleflow passes rather than leaves to
# its defaults, so a later speculators default cannot change what SGLang is handed.
CONFIDENCE_HEAD_ALPHA = 1.0  # the weight of the confidence head's BCE term in the loss


def check_settings(verifier: Path, aux_layer_ids: Sequence[int], settings: Mapping[str, Any]) -> None:
    """What SGLang would refuse of a DSpark drafter with these settings for ``verifier``, before any work: DFlash's
    rules (its context layers, its mask token), which its backbone and SGLang's DSPARK worker share; the Markov
    settings are within what SGLang serves by their Params' own bounds.

    :raises ValueError: the reason, as training or the export would give it.
    """
    from eagleflow.drafters.dflash.flags import check_settings as dflash_check

    dflash_check(verifier, aux_layer_ids, settings)


def train_flags(cfg: TrainConfig, mask_token_id: int | None = None) -> list[str]:
    """speculators flags of a DSpark drafter: the block, the resolved mask token, anchors per packed row, the
    Markov head (rank, type) and the confidence head.

    No ``--draft-vocab-size``: without it speculators trains the full vocabulary (and the train step
    refused a reduced one before starting).
    """
    from eagleflow.drafters.dflash.flags import train_flags as dflash_flags

    if cfg.markov_rank is None or cfg.markov_head_type is None:
        raise ValueError("a DSpark drafter's markov_rank and markov_head_type are filled in by TrainConfig; got none")
    flags = dflash_flags(cfg, mask_token_id)  # its block size, mask token and anchors, as DFlash's
    flags[flags.index("--speculator-type") + 1] = "dspark"
    return flags + [
        "--sample-from-anchor",
        "--markov-rank", str(cfg.markov_rank),
        "--markov-head-type", cfg.markov_head_type,
        "--enable-confidence-head",
        "--confidence-head-with-markov",
        "--confidence-head-alpha", str(CONFIDENCE_HEAD_ALPHA),
    ]


def serving_flags(
    drafter_path: str,
    steps: int = 1,
    topk: int = 1,
    draft_tokens: int | None = None,
    window: int | None = None,
    calibration: str | None = None,
) -> list[str]:
    """SGLang's flags serving a DSpark drafter whose verify window is ``draft_tokens`` (γ + 1: the bonus token and
    γ drafts; the export's manifest ``block_size``), steps and topk 1 (SGLang forces them); ``calibration``: the
    per-position confidence temperatures (``--speculative-dspark-confidence-sts-path``), named only when given. The
    draft's sliding windows are its config's, not a flag (``window`` is ignored, as for DFlash)."""
    from eagleflow.sglang_rules import check_block_flags

    if draft_tokens is None:
        raise ValueError("a DSpark drafter is served with its verify window, block size + 1, as --speculative-num-draft-tokens")
    check_block_flags(draft_tokens, steps, topk)
    flags = [
        "--speculative-algorithm", "DSPARK",
        "--speculative-draft-model-path", drafter_path,
        # SGLang takes gamma from this flag first, else from the folder; num-draft-tokens must then be gamma + 1.
        "--speculative-dspark-block-size", str(draft_tokens - 1),
        "--speculative-num-draft-tokens", str(draft_tokens),
    ]
    if calibration is not None:
        flags += ["--speculative-dspark-confidence-sts-path", calibration]
    return flags
