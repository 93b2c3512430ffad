"""Reading a verifier: what every stage knows about the model the drafter is trained for.

- :mod:`~eagleflow.verifier.config`: facts read from its ``config.json`` (a multimodal wrapper's text
  config too), the aux layer ids a run captures for its depth, whether a folder is a model folder, and
  its tokenizer;
- :mod:`~eagleflow.verifier.weights`: its embedding, final norm and ``lm_head`` (found whatever their
  prefix, read alone), the RMSNorm, and the head applied to hidden states.

Below every stage: preparation, the engines, extraction, training, export and evaluation all read the
verifier, none of them owns it. Light to import (torch and transformers only inside the functions that need them).
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "config": [
            "config_float", "config_int", "load_tokenizer", "model_folder_problem", "read_config",
            "resolve_aux_layer_ids", "text_config", "text_config_of",
        ],
        "weights": [
            "EMBED", "LM_HEAD", "NORM", "VerifierHead", "VerifierWeights", "load_verifier_head", "locate_weights",
            "read_weight", "rms_norm",
        ],
    },
)
