"""The evaluation stage: the exported drafter served and measured on held-out prompts.

- :mod:`~eagleflow.evaluate.step`: ``python -m eagleflow evaluate`` (engines with and without the drafter);
- :mod:`~eagleflow.evaluate.prompts`: the held-out prompts (rows training never saw);
- :mod:`~eagleflow.evaluate.engine_run`: one engine started, asked, stopped;
- :mod:`~eagleflow.evaluate.report`: accept length, speedup, the offline estimate, the chart.
"""

from eagleflow import lazy_exports

# What another stage uses of evaluation: the serving configs' rules (the drafters' settings are checked by them).
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "sweep": ["check_configs_param", "fastest_per_batch_size"],
        "charts": ["write_compare_chart"],
        "report": ["num"],
        "step": ["REPORT_FILE"],
        "config": ["EvaluateConfig"],
    },
)
