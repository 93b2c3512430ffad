"""The export stage: a trained checkpoint as the drafter folders serving engines load.

- :mod:`~eagleflow.export.step`: ``python -m eagleflow export`` (SGLang and speculators folders);
- :mod:`~eagleflow.export.sglang_drafter`: what SGLang's ``LlamaForCausalLMEagle3`` reads;
- :mod:`~eagleflow.export.targets`: what each serving engine needs from training.

Nothing heavy is imported here: training and the Params form read :mod:`~eagleflow.export.targets`.
"""
