"""DFlash: a block drafter — one draft pass proposes ``block_size - 1`` tokens after the bonus token.

Everything that is DFlash's own, in one folder (the stages hold what every family shares):

- :mod:`~eagleflow.drafters.dflash.flags`: speculators' train flags, SGLang's serving flags;
- :mod:`~eagleflow.drafters.dflash.sglang_rules`: what SGLang computes from a DFlash folder (layer ids, block attention);
- :mod:`~eagleflow.drafters.dflash.sglang_export`: SGLang's ``DFlashDraftModel`` folder and the checkpoint's tensors;
- :mod:`~eagleflow.drafters.dflash.reference`: the reference engine's block decoding with SGLang's semantics.

The registry (:mod:`eagleflow.drafters.registry`) names these owners; a family built on DFlash imports them.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "flags": ["check_settings", "serving_flags", "train_flags"],
        "sglang_rules": [
            "DFLASH_TARGETS", "BlockAttention", "DFlashRuleError", "captured_layer_ids", "layer_attention", "sglang_target_layer_ids",
        ],
        "sglang_export": [
            "CHECKPOINT", "DFLASH_ALGORITHM", "DFLASH_ARCHITECTURE", "checkpoint_dflash_weights", "dflash_sglang_config",
            "expected_dflash_weights", "export_dflash_sglang",
        ],
        "reference": ["DFlashDecoder", "DFlashDrafter", "dflash_decoder", "load_dflash_decoder", "load_drafter"],
    },
)
