"""The export stage: a trained checkpoint as the drafter folders serving engines load.

- :mod:`~eagleflow.export.step`: ``python -m eagleflow export`` (SGLang and speculators folders);
- :mod:`~eagleflow.export.manifest`: ``export.json``, and :class:`ServedDrafter`, what an engine serving the drafter reads;
- :mod:`~eagleflow.export.sglang_drafter`: what SGLang's ``LlamaForCausalLMEagle3`` reads;
- :mod:`~eagleflow.export.dflash_drafter`: what SGLang's ``DFlashDraftModel`` reads;
- :mod:`~eagleflow.export.tensors`: the tensors a config makes each family's class build, and the one check against them;
- :mod:`~eagleflow.export.targets`: what each serving engine needs from training.

Nothing heavy is imported here: training, the engines and the Params form read the light modules.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "manifest": ["EXPORT_MANIFEST", "ServedDrafter"],
        "targets": ["ServeWith", "ServingEngine", "serving_target"],
        "sglang_drafter": ["NotServable", "captured_layer_ids"],
        "dflash_drafter": ["DFLASH_ARCHITECTURE", "dflash_sglang_config", "expected_dflash_weights", "export_dflash_sglang"],
    },
)
