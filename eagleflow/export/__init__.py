"""The export stage: a trained checkpoint as the drafter folders serving engines load.

- :mod:`~eagleflow.export.step`: ``python -m eagleflow export`` (SGLang and speculators folders), reading and
  checking the checkpoint; the SGLang folder is the checkpoint's family's (:mod:`eagleflow.drafters`);
- :mod:`~eagleflow.export.manifest`: ``export.json``, and :class:`ServedDrafter`, what an engine serving the drafter reads;
- :mod:`~eagleflow.export.tensors`: the tensors a config makes a family's class build, the one check against them,
  the one writer of a weights file, and what every family's checkpoint layout says;
- :mod:`~eagleflow.export.rotary`: the draft layers' rotary as trained, checked against SGLang's.

Nothing heavy is imported here: training, the engines and the Params form read the light modules.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "manifest": ["EXPORT_MANIFEST", "ServedDrafter"],
        "step": ["Checkpoint", "read_checkpoint", "ExportConfig"],
        "tensors": [
            "COMMON_CONFIG_KEYS", "CheckpointLayout", "Expected", "LayerShape", "NotServable", "check_tensors",
            "config_read_as", "decoder_layer", "layer_config", "save_weights", "tensor_problems", "vocabulary_tensors",
            "write_drafter_folder",
        ],
        "rotary": ["check_rotary"],
    },
)
