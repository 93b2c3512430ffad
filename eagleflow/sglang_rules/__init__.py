"""What SGLang computes when it serves a drafter: one owner, imported by the export, the evaluation and the reference engine.

- :mod:`~eagleflow.sglang_rules.rope`: the draft layers' rotary embedding as SGLang computes it;
- :mod:`~eagleflow.sglang_rules.draft_shape`: the rules of the draft-shape flags (chains, trees, blocks);
- :mod:`~eagleflow.sglang_rules.dflash`: DFlash's layer ids, block attention and mask token.

Light to import (torch only inside ``rope``'s functions that compute).
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "rope": ["UnsupportedRope", "rope_settings", "sglang_rotary"],
        "draft_shape": ["check_block_flags", "check_tree_flags"],
        "dflash": [
            "DEFAULT_MASK_TOKEN", "DFLASH_TARGETS", "BlockAttention", "DFlashRuleError", "captured_layer_ids",
            "layer_attention", "resolve_mask_token_id", "sglang_target_layer_ids",
        ],
    },
)
