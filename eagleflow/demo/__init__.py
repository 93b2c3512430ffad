"""The CPU demo's scaffolding: a tiny trained verifier, synthetic conversations, the demo run.

Nothing in the product's stages imports this package; ``make demo``, ``make airflow``, the
Params form's demo defaults and the tests do.

- :mod:`~eagleflow.demo.run`: the demo's Params and inputs, and the summary of a finished run;
- :mod:`~eagleflow.demo.tiny_model` (with :mod:`~eagleflow.demo.tiny_tokenizer` and
  :mod:`~eagleflow.demo.tiny_training`): the tiny DeepSeek-V3 verifier;
- :mod:`~eagleflow.demo.synthetic_data`: structured synthetic conversations.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "run": [
            "DEMO_COMPARE_DRAFTERS", "DEMO_DFLASH_PARAMS", "DEMO_DSPARK_PARAMS", "DEMO_PARAMS", "DEMO_ROWS", "DEMO_RUN_NAME",
            "DEMO_THINKING_PARAMS", "demo_params", "demo_paths", "form_params", "make_demo_inputs", "make_thinking_inputs",
            "run_summary"
        ],
    },
)
