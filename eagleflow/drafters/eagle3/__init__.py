"""EAGLE-3 and EAGLE-3.1: a chain (or tree) of one-token draft steps, each fed the previous step's state.

Everything that is EAGLE-3's own, in one folder (the stages hold what every family shares):

- :mod:`~eagleflow.drafters.eagle3.flags`: speculators' train flags of each variant, SGLang's serving flags;
- :mod:`~eagleflow.drafters.eagle3.sglang_export`: SGLang's ``LlamaForCausalLMEagle3`` folder, the checkpoint's
  tensors, and the aux-id rule of each SGLang target;
- :mod:`~eagleflow.drafters.eagle3.draft_model`, :mod:`~eagleflow.drafters.eagle3.chain`,
  :mod:`~eagleflow.drafters.eagle3.tree`, :mod:`~eagleflow.drafters.eagle3.reference`: the reference engine's
  decoding with SGLang's semantics (a chain, or a tree with topk > 1).

The registry (:mod:`eagleflow.drafters.registry`) names these owners; nothing else imports a family.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "flags": ["VARIANT_FLAGS", "check_settings", "serving_flags", "train_flags"],
        "sglang_export": [
            "CHECKPOINT", "SINCE", "TARGET_CAPTURE_RULES", "captured_layer_ids", "draft_window_size", "expected_eagle3_weights",
            "export_eagle3_sglang", "minimum_sglang", "sglang_aux_layer_ids", "sglang_config", "sglang_features", "sglang_weights",
            "unserved_weights",
        ],
        "draft_model": ["Eagle3Drafter"],
        "chain": ["ChainDecoder"],
        "tree": ["TreeDecoder"],
        "reference": ["load_speculative_decoder", "speculative_decoder"],
    },
)
