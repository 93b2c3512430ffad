"""What SGLang defines, and every drafter family obeys: one owner each, imported by the families and the stages.

- :mod:`~eagleflow.sglang_rules.rope`: the draft layers' rotary embedding as SGLang computes it;
- :mod:`~eagleflow.sglang_rules.draft_shape`: the rules of the draft-shape flags (chains, trees, blocks);
- :mod:`~eagleflow.sglang_rules.mask_token`: the mask token SGLang fills a drafted block with;
- :mod:`~eagleflow.sglang_rules.serving_targets`: what each serving engine (SGLang, vLLM) needs from training.

A rule only one family needs is that family's (``eagleflow/drafters/<family>/``). Light to import (torch
only inside ``rope``'s functions that compute).
"""

from eagleflow import lazy_exports

# The oldest SGLang release eagleflow reads and checks.
OLDEST_SGLANG: tuple[int, int, int] = (0, 5, 10)

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "rope": ["UnsupportedRope", "rope_settings", "sglang_rotary"],
        "draft_shape": ["check_block_flags", "check_tree_flags"],
        "mask_token": ["DEFAULT_MASK_TOKEN", "BlockRuleError", "choose_mask_token_id", "resolve_mask_token_id"],
        "serving_targets": ["SERVING_TARGETS", "ServeWith", "ServingEngine", "ServingTarget", "serving_target"],
    },
)
__all__ = sorted([*__all__, "OLDEST_SGLANG"])
