"""The DAG's Params form, derived from :class:`eagleflow.run.pipeline.PipelineConfig`."""

from __future__ import annotations

import os
from typing import Any

from eagleflow.deploy import DAG_ID, GPU_POOL, GPU_QUEUE, PLAN_DRAFTERS_TASK_ID  # noqa: F401  (re-exported for the DAG)

DEMO_DIR_ENV = "EAGLEFLOW_DEMO_DIR"
FORM_DEFAULTS_ENV = "EAGLEFLOW_FORM_DEFAULTS"


def pipeline_params(defaults: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``{name: Param kwargs}`` for every pipeline knob, with deployment ``defaults`` filled in (each a Param's:
    :func:`form_defaults` checks them).

    Each entry is a JSON schema (``default``, ``type``, ``title``, ``description``, bounds)
    that ``airflow.sdk.Param(**entry)`` accepts, so the trigger form shows titles and help.
    """
    from eagleflow.run import form_schemas

    schemas = form_schemas()
    for name, value in (defaults or {}).items():
        schemas[name]["default"] = value
    return schemas


def form_defaults() -> dict[str, Any]:
    """Defaults this deployment puts in the trigger form.

    With ``EAGLEFLOW_DEMO_DIR`` set (``make demo``, ``make airflow``): the CPU demo's inputs and
    2-core sizes, and ``make demo``'s drafters compared. Otherwise the run folders go under ``EAGLEFLOW_OUTPUT_ROOT`` and the model and
    dataset are left for the user to fill in; the rest are the seed's GPU values. Over either, the
    JSON object of Param values in the file ``EAGLEFLOW_FORM_DEFAULTS`` names (a cluster's own model folder, engine flags, sizes).
    """
    from eagleflow.deploy import OUTPUT_ROOT_ENV

    if os.environ.get(DEMO_DIR_ENV):
        from eagleflow.demo import form_params

        defaults = form_params(os.environ[DEMO_DIR_ENV])
    else:
        defaults = {"output_root": os.environ.get(OUTPUT_ROOT_ENV, "/opt/eagleflow/runs")}
    if os.environ.get(FORM_DEFAULTS_ENV):
        from eagleflow.run.form import form_schemas, read_form_defaults

        defaults.update(read_form_defaults(os.environ[FORM_DEFAULTS_ENV], form_schemas()))
    return defaults
