"""Which step flags the DAG's Params form offers: each such Param *is* that flag.

A step Param's type, default, bounds, title and description are the field of its step's own
pydantic config (:mod:`eagleflow.config`'s anchor: speculators ``train/config/schema.py``); this
module only names them, by step, with the form section they appear in. Offering another existing
flag in the form is one edit: its name in :data:`STEP_PARAM_GROUPS`.
:class:`~eagleflow.pipeline.PipelineConfig` gives each step its Params (:func:`param_feeds`).
"""

from __future__ import annotations

from pydantic import BaseModel, create_model

from eagleflow.data.disk_check import DiskCheckConfig
from eagleflow.data.prepare import PrepareConfig
from eagleflow.data.regenerate import RegenerateConfig
from eagleflow.evaluate.config import EvaluateConfig
from eagleflow.extract.config import ExtractConfig
from eagleflow.extract.verify_config import VerifyCaptureConfig
from eagleflow.train.config import TrainConfig

# Training knobs offered in the Params form; their types, defaults and help are TrainConfig's.
TRAIN_PARAMS = (
    "epochs",
    "lr",
    "total_seq_len",
    "ttt_steps",
    "noise_std",
    "scheduler_type",
    "scheduler_warmup_ratio",
    "num_workers",
    "draft_vocab_size",
    "num_layers",
    "draft_config",
    "train_data_ratio",
    "device",
    "gpus",
    "restart",
    "train_nodes", "rendezvous_timeout",  # training on several nodes
    "serve_with",
    "draft_variant",
    "hidden_states_source",
    "online_prefetch",
    "online_cache_gb",
)

# Evaluation knobs offered in the Params form; their types, defaults and help are EvaluateConfig's.
EVAL_PARAMS = (
    "eval_sets", "eval_prompts", "eval_rows", "eval_max_new_tokens", "eval_configs", "eval_concurrency", "eval_rounds",
    "eval_server_extra_args",
)
# Regeneration knobs (used with regenerate_responses); RegenerateConfig's.
REGEN_PARAMS = ("regen_temperature", "regen_max_new_tokens", "regen_concurrency")
# The capture check's knob in the Params form; VerifyCaptureConfig's.
VERIFY_PARAMS = ("verify_rows",)

# Every Param that is a step's flag: (the step's config, the fields offered in the form, their form section).
# A Param sets its step's flag, and the same flag of any other step that declares it alike (a shared
# field type: regeneration's skip_bad_rows is preparation's, build-vocab's draft_vocab_size training's).
STEP_PARAM_GROUPS: tuple[tuple[type[BaseModel], tuple[str, ...], str], ...] = (
    (PrepareConfig, ("max_len", "skip_bad_rows"), "Data"),
    (DiskCheckConfig, ("disk_margin",), "Extraction"),
    (ExtractConfig, ("concurrency",), "Extraction"),
    (VerifyCaptureConfig, VERIFY_PARAMS, "Extraction"),
    (TrainConfig, TRAIN_PARAMS, "Training"),
    (EvaluateConfig, EVAL_PARAMS, "Evaluation"),
    (RegenerateConfig, REGEN_PARAMS, "Regeneration"),
)
# Every step Param and the step config that declares it.
STEP_PARAMS: dict[str, type[BaseModel]] = {name: model for model, names, _ in STEP_PARAM_GROUPS for name in names}


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
