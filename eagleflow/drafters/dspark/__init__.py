"""DSpark: a DFlash block drafter with a Markov head and a confidence head (DeepSeek, arXiv 2607.05147).

Everything that is DSpark's own, in one folder (built on :mod:`eagleflow.drafters.dflash`, as speculators'
``DSparkDraftModel`` and SGLang's ``DSparkDraftModel`` are built on their DFlash classes):

- :mod:`~eagleflow.drafters.dspark.flags`: speculators' train flags, SGLang's serving flags;
- :mod:`~eagleflow.drafters.dspark.sglang_export`: SGLang's ``DSparkDraftModel`` folder and the checkpoint's tensors;
- :mod:`~eagleflow.drafters.dspark.reference`: the reference engine's DSpark decoding with SGLang's semantics
  (and the confidence logits its calibration records).
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "flags": ["serving_flags", "train_flags"],
        "sglang_export": [
            "CHECKPOINT", "DSPARK_ALGORITHM", "DSPARK_ARCHITECTURE", "checkpoint_dspark_weights", "dspark_sglang_config",
            "expected_dspark_weights", "export_dspark_sglang", "head_tensors",
        ],
        "reference": ["ConfidenceRecorder", "DSparkBlock", "DSparkDecoder", "DSparkDrafter", "dspark_decoder", "load_dspark_decoder"],
    },
)
