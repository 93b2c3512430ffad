"""The reference engine: a CPU/GPU stand-in for SGLang that captures hidden states.

SGLang cannot run on CPU machines, so the CPU path (and the GPU correctness oracle for the
SGLang hook) is a small HTTP server backed by ``transformers``, in three parts:

- its flags (``python -m eagleflow serve-reference``) are :mod:`eagleflow.engine.reference_config`'s, where the
  engine stage builds its command line;
- :mod:`~eagleflow.engine.reference.protocol`: the subset of SGLang's native API it speaks,
  with SGLang's field names, status codes and error bodies;
- :mod:`~eagleflow.engine.reference.runner`: the model, its forward passes and the capture;
- :mod:`~eagleflow.engine.reference.faults`: TEST ONLY faults injected for real, read from the
  ``EAGLEFLOW_TEST_FAULTS`` environment variable (never flags);
- :mod:`~eagleflow.engine.reference.server`: the HTTP app, the warmup and the process's life;
- :mod:`~eagleflow.engine.reference.speculative`: the greedy draft-and-verify loop every drafter family's
  decoder shares (each family's rounds are its own: ``eagleflow/drafters/<family>/``, found through
  :mod:`eagleflow.drafters`).
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "speculative": ["SpecStats", "SpeculativeDecoder", "crop_cache"],
    },
)
