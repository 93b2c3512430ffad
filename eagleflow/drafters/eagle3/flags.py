"""EAGLE-3 and EAGLE-3.1: a chain (or tree) of one-token draft steps, each fed the previous step's state.

What differs from the other families, for the two variants (:data:`VARIANT_FLAGS`): ``eagle3`` one
RMSNorm over the concatenated aux states before ``fc`` (``norm_before_fc``), ``eagle3.1`` one RMSNorm
per aux state (``fc_norm``, the EAGLE-3.1 paper's); both feed each draft step the normed state
(``norm_output``). speculators trains both (0.8.1 and 0.9.0 have ``--fc-norm``); SGLang serves
``fc_norm`` and ``norm_output`` from 0.5.13, ``norm_before_fc`` from 0.5.17
(:data:`eagleflow.drafters.eagle3.sglang_export.SINCE`). The export is :func:`eagleflow.drafters.eagle3.sglang_export.export_eagle3_sglang`,
the reference decoding :mod:`eagleflow.drafters.eagle3.reference` (a chain, or ``.tree``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagleflow.train import TrainConfig

# speculators train flags of each variant (speculators' EAGLE-3 defaults, said explicitly for eagle3).
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "eagle3": ("--norm-before-fc", "--norm-output"),
    "eagle3.1": ("--fc-norm", "--no-norm-before-fc", "--norm-output"),
}


def train_flags(cfg: TrainConfig, mask_token_id: int | None = None) -> list[str]:
    """speculators flags of an EAGLE-3 drafter: the draft vocabulary, the TTT unroll, the variant's norms.

    The mask token is passed only so speculators does not load the verifier's tokenizer: EAGLE-3 never uses it.
    """
    from eagleflow.sglang_rules import serving_target

    return [
        "--speculator-type", "eagle3",
        "--draft-vocab-size", str(cfg.draft_vocab_size),
        "--ttt-steps", str(cfg.ttt_steps),
        "--mask-token-id", str(0 if mask_token_id is None else mask_token_id),
        # What the serving engine's draft layer computes (eagleflow.sglang_rules.serving_targets).
        "--norm-before-residual" if serving_target(cfg.serve_with).norm_before_residual else "--no-norm-before-residual",
        *VARIANT_FLAGS[cfg.draft_algorithm],
    ]


def serving_flags(drafter_path: str, steps: int, topk: int = 1, draft_tokens: int | None = None, window: int | None = None) -> list[str]:
    """SGLang's flags serving an EAGLE-3 drafter: ``steps`` draft steps, a chain (topk 1, steps + 1 verified
    tokens) unless ``topk`` and ``draft_tokens`` ask for a tree; the draft window when it has one."""
    flags = [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", drafter_path,
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(draft_tokens or steps + 1),
    ]
    return flags + (["--speculative-draft-window-size", str(window)] if window is not None else [])


def check_settings(verifier: Path, aux_layer_ids: Sequence[int], settings: Mapping[str, Any]) -> None:
    """What SGLang would refuse of an EAGLE-3 drafter with these settings for ``verifier``, before any work: aux ids
    its target's capture rule cannot express (id 0 on Llama/Qwen targets). Served by vLLM (``serve_with``), none.

    :raises ValueError: the reason, as the export would give it.
    """
    from eagleflow.drafters.eagle3.sglang_export import TARGET_CAPTURE_RULES, sglang_aux_layer_ids
    from eagleflow.verifier import read_config

    architecture = (read_config(verifier).get("architectures") or ["?"])[0]
    if settings.get("serve_with", "sglang") == "sglang" and architecture in TARGET_CAPTURE_RULES:
        sglang_aux_layer_ids(aux_layer_ids, architecture)
