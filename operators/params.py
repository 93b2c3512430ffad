"""The DAG's Params form, derived from :class:`eagleflow.pipeline.PipelineConfig`."""

from __future__ import annotations

from typing import Any


def pipeline_params(defaults: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``{name: Param kwargs}`` for every pipeline knob, with deployment ``defaults`` filled in.

    Each entry is a JSON schema (``default``, ``type``, ``title``, ``description``, bounds)
    that ``airflow.sdk.Param(**entry)`` accepts, so the trigger form shows titles and help.
    """
    from eagleflow.pipeline import param_schemas
    from operators.train import train_param_schemas

    schemas = {**param_schemas(), **train_param_schemas()}
    for name, value in (defaults or {}).items():
        schemas[name]["default"] = value
    return schemas
