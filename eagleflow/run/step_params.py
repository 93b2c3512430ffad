"""Which step flags the DAG's Params form offers: each such Param *is* that flag.

A step Param's type, default, bounds, title and description are the field of its step's own
pydantic config (:mod:`eagleflow.config`'s anchor: speculators ``train/config/schema.py``); a field
with a title (its form label) is offered, in its step's section of :data:`STEP_SECTIONS`. Offering
another existing flag in the form is one edit: its label.
:class:`~eagleflow.run.pipeline.PipelineConfig` gives each step its Params (:func:`param_feeds`).
"""

from __future__ import annotations

from pydantic import BaseModel, create_model

from eagleflow.data import DiskCheckConfig
from eagleflow.data import PrepareConfig
from eagleflow.data import RegenerateConfig
from eagleflow.evaluate import EvaluateConfig
from eagleflow.extract import ExtractConfig
from eagleflow.extract import VerifyCaptureConfig
from eagleflow.train import TrainConfig

# The steps whose flags the form offers, each with its form section. A field of theirs with a title
# (its label in the form) is a Param, unless an earlier step here owns it: offering another existing
# flag is one edit, its label. The run's own knobs (engine, tp_size, warmup_timeout) are untitled in
# the steps, titled where PipelineConfig declares them.
STEP_SECTIONS: tuple[tuple[type[BaseModel], str], ...] = (
    (PrepareConfig, "Data"),
    (DiskCheckConfig, "Extraction"),
    (ExtractConfig, "Extraction"),
    (VerifyCaptureConfig, "Extraction"),
    (TrainConfig, "Training"),
    (EvaluateConfig, "Evaluation"),
    (RegenerateConfig, "Regeneration"),
)
# Every step Param and the step config that declares it, in form order. A Param sets its step's flag,
# and the same flag of any other step that declares it alike (a shared field type: regeneration's
# skip_bad_rows is preparation's, build-vocab's draft_vocab_size training's).
STEP_PARAMS: dict[str, type[BaseModel]] = {}
for step, _ in STEP_SECTIONS:
    STEP_PARAMS.update({name: step for name, field in step.model_fields.items() if field.title and name not in STEP_PARAMS})
# (the step config, its Params, their form section)
STEP_PARAM_GROUPS: tuple[tuple[type[BaseModel], tuple[str, ...], str], ...] = tuple(
    (model, tuple(name for name, owner in STEP_PARAMS.items() if owner is model), section) for model, section in STEP_SECTIONS
)


def declared_alike(model: type[BaseModel], name: str, owner: type[BaseModel]) -> bool:
    """Whether ``model`` declares field ``name`` as ``owner`` does (type, default, bounds, description)."""
    field, owned = model.model_fields.get(name), owner.model_fields[name]
    return field is not None and (field.annotation, field.metadata, field.description, field.get_default(call_default_factory=True)) == (
        owned.annotation, owned.metadata, owned.description, owned.get_default(call_default_factory=True)
    )


def param_feeds(name: str, model: type[BaseModel]) -> bool:
    """Whether step Param ``name`` sets a flag of ``model``: its own step's, or one declared alike."""
    owner = STEP_PARAMS[name]
    return model is owner or declared_alike(model, name, owner)


# Checks every step Param without a run folder (as one model).
StepParams = create_model(  # type: ignore[call-overload]
    "StepParams", **{name: (model.model_fields[name].annotation, model.model_fields[name]) for name, model in STEP_PARAMS.items()}
)

# The trigger form's sections in the order it shows them (None: Airflow's "Run Parameters", what every run sets).
FORM_SECTIONS = (None, "Engine", "Data", "Extraction", "Training", "Evaluation", "Regeneration")
