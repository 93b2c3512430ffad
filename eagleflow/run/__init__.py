"""The run: one DAG run's settings as a whole, and the engines it launches.

- :mod:`~eagleflow.run.pipeline`: :class:`PipelineConfig`, the run's Params checked as one config, and each
  step's config derived from it (the one place a Param becomes a step's flag);
- :mod:`~eagleflow.run.step_params`: which step flags the Params form offers, by section;
- :mod:`~eagleflow.run.drafters`: the ``drafters`` Param, and the run seen from one of its drafters;
- :mod:`~eagleflow.run.param_checks`: the path Params, checked before anything starts;
- :mod:`~eagleflow.run.form`: the trigger form's schema of each Param, its help in the form's labels;
- :mod:`~eagleflow.run.launch`: the capture engines a run launches and stops (``python -m eagleflow launch|stop``).

Above every stage and report (it composes their configs); only the operators, the DAG and the CLI sit above it.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "pipeline": ["PIPELINE_PARAMS", "PipelineConfig", "model_dir", "param_name", "param_schemas"],
        "form": ["form_schemas"],
        "launch": [
            "EngineElsewhere", "engine_command", "launch_engine", "revive_sample_store", "stop_engine",
            "store_namespace",
        ],
    },
)
