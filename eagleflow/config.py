"""Typed step configurations and the one way they become command-line flags.

Each step declares its knobs once, as a pydantic model whose fields carry a description
(anchor: speculators ``train/config/schema.py``). :func:`add_model_arguments` derives the
``--flag`` of every field from it, and :func:`model_from_args` turns parsed flags back into
the model, so a flag, its type, its default and its help text live in one place;
:func:`schemas_of` shapes the same fields as the DAG's Airflow ``Param`` schemas.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, Field, ValidationError

from eagleflow.errors import UserError, excerpt_repr
from sglang_patch.layer_ids import validate_aux_layer_ids
from sglang_patch.mooncake_store import StoreAddress
from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HiddenStatesDtype

M = TypeVar("M", bound=BaseModel)

# Aux layer ids as every config declares them: the one rule (distinct, non-negative) checked
# on input, and said in the JSON schema too (the Params form refuses a repeated id at trigger
# time). The range needs the model's depth: eagleflow.verifier.config.resolve_aux_layer_ids.
AuxLayerIds = Annotated[
    list[Annotated[int, Field(ge=0)]],
    AfterValidator(validate_aux_layer_ids),
    Field(json_schema_extra={"uniqueItems": True}),
]

# The storage dtype of the hidden-state files, as every step that writes, checks or sizes them
# declares it, default included (the choices are sglang_patch.sample_format's).
StoredHiddenStatesDtype = Annotated[
    HiddenStatesDtype,
    Field(
        DEFAULT_HIDDEN_STATES_DTYPE,
        description="how hidden states are stored: bf16, or fp8 (float8_e4m3fn with one float32 scale per "
        "token, about half the disk; read by speculators 0.9's fp8 backend)",
    ),
]


def _store_address(text: str | None) -> str | None:
    if text:
        StoreAddress.from_json(text)  # a malformed address is refused naming the flag, not at the first sample
    return text


# The draft vocabulary's size, as vocabulary building and training declare it: one Param sets both.
SampleStoreAddress = Annotated[
    str | None,
    AfterValidator(_store_address),
    Field(
        None,
        description="the run's Mooncake Store as JSON ({master, admin, metadata_server, namespace}): samples are handed "
        "over through it instead of the dump folder (Param sample_transport mooncake)",
    ),
]
DraftVocabSize = Annotated[
    int,
    Field(
        32000, ge=1, title="Draft vocabulary size",
        description="target token ids the drafter can propose (the d2t/t2d mapping, built from the most frequent tokens if missing)",
    ),
]

# Which engine serves the verifier, and on how many GPUs, as the run and the evaluation declare them
# (untitled: the run's own Params give them their form labels).
EngineKind = Annotated[
    Literal["reference", "sglang"],
    Field(
        "reference",
        description="sglang: SGLang on a GPU node (with the capture hook for extraction, with the drafter for evaluation). "
        "reference: the transformers reference engine (CPU or GPU), for demos, tests and checking the hook",
    ),
]
# A finished step whose inputs did not change reuses its result (eagleflow.reuse); this forces the work again.
RedoFinished = Annotated[
    bool,
    Field(
        False,
        title="Redo finished steps",
        description="Build the draft vocabulary, export, evaluate and chart again even when a step's inputs (dataset, "
        "checkpoint, drafter, settings) are those its finished result was made from; off, such a step reuses its "
        "result at once (training: Restart training from scratch)",
    ),
]

# The chat template's switches, as every step that renders a conversation declares it (preparation,
# regeneration, evaluation's prompts): one Param, so a drafter is never trained in one mode and measured in another.
ChatTemplateKwargs = Annotated[
    dict[str, Any],
    Field(
        default_factory=dict,
        title="Chat template switches",
        description='Keyword arguments of the verifier\'s chat template, as SGLang\'s chat_template_kwargs: e.g. '
        '{"enable_thinking": true} (Qwen3), {"thinking": true} (Kimi-K2.5); preparation, regeneration and evaluation '
        "render every conversation with them",
    ),
]

# How the engines hand captured samples to extraction and online training (docs/design.md §3.4): one Param.
SampleTransport = Annotated[
    Literal["file", "mooncake"],
    Field(
        "file",
        title="Sample transport",
        description="file: each sample is a file in the engines' dump folder, which the workers must see. mooncake: "
        "samples go through a Mooncake Store (the store of sample_store_conn_id, else one the run starts on the engine "
        "node), so engine and trainer nodes need no shared filesystem; the store holds at most dump_queue_gb per engine",
        json_schema_extra={"section": "Engine"},
    ),
]
SampleStoreConnId = Annotated[
    str,
    Field(
        "",
        title="Sample store connection",
        description="sample_transport mooncake: an Airflow connection naming the Mooncake master (host, RPC port; extra: "
        "admin_port, metadata_server, namespace). Empty: the run starts a master and metadata server on its engine "
        "node, bound to 127.0.0.1 (engines and trainers on that node only)",
        json_schema_extra={"section": "Engine"},
    ),
]

TpSize = Annotated[
    int, Field(8, ge=1, description="SGLang --tp-size: GPUs per engine (the reference engine ignores it)")
]

# How long an engine may take to become ready, as every step that waits for one declares it
# (the readiness sensor, regeneration, evaluation's engines): seconds, like every duration.
WarmupTimeout = Annotated[
    float,
    Field(
        2700.0,
        gt=0,
        description="seconds an engine may take to become ready (SGLang warms a Kimi-K2.5 for about 9 minutes); "
        "past it the wait fails with the engine's log tail",
    ),
]


def flag_name(field: str) -> str:
    """``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + field.replace("_", "-")


def parse_int_list(text: str) -> list[int]:
    """``"2,4,6"`` or ``"[2, 4, 6]"`` -> ``[2, 4, 6]``; used for layer ids."""
    text = text.strip().strip("[]")
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {excerpt_repr(text)}") from exc


def parse_json_object(text: str) -> dict[str, Any]:
    """``'{"enable_thinking": true}'`` -> ``{"enable_thinking": True}``: a flag that takes a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {excerpt_repr(text)} ({exc.msg})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {excerpt_repr(text)}")
    return value


def _strip_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``, and ``Annotated[X, ...]`` -> ``X``: the type a flag parses."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation = args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def add_model_arguments(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Add one ``--flag`` per field of ``model`` (required when the field has no default)."""
    for name, field in model.model_fields.items():
        annotation = _strip_optional(field.annotation)
        origin = typing.get_origin(annotation)
        kwargs: dict[str, Any] = {"dest": name, "help": field.description or ""}
        if field.is_required():
            kwargs["required"] = True
        else:
            kwargs["default"] = argparse.SUPPRESS  # the model fills its own default
            default = field.get_default(call_default_factory=True)
            kwargs["help"] += f" (default: {default})"
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is list:
            (item,) = typing.get_args(annotation)
            if typing.get_origin(item) is Annotated:
                item = typing.get_args(item)[0]
            kwargs["type"] = parse_int_list if item is int else (lambda s: [p for p in s.split(",") if p])
            kwargs["metavar"] = "A,B,…"
        elif origin is dict:
            kwargs["type"] = parse_json_object
            kwargs["metavar"] = "JSON"
        elif origin is typing.Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        elif annotation in (int, float, str, Path):
            kwargs["type"] = annotation
        else:
            kwargs["type"] = str
        parser.add_argument(flag_name(name), **kwargs)


def model_from_args(model: type[M], args: argparse.Namespace | dict[str, Any]) -> M:
    """Build ``model`` from parsed flags; a validation error names the flag and raises UserError."""
    values = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    return build_model(model, {k: v for k, v in values.items() if k in model.model_fields}, flag_name)


def build_model(model: type[M], values: dict[str, Any], name: Callable[[str], str]) -> M:
    """``model(**values)``; a validation error becomes a :class:`UserError` naming each bad field
    the way its user knows it (``name``: a flag, a Param)."""
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{name(str(err['loc'][0])) if err['loc'] else model.__name__}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise UserError(problems) from exc


def model_to_argv(config: BaseModel) -> list[str]:
    """The flags that rebuild ``config`` through :func:`add_model_arguments` (an argv list, no shell)."""
    argv: list[str] = []
    for name, value in config.model_dump().items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            argv.append(f"{flag_name(name)}={json.dumps(value)}")
        elif isinstance(value, list):
            # --flag=value: a value that starts with "-" would otherwise read as another flag
            argv.append(f"{flag_name(name)}={','.join(str(v) for v in value)}")
        else:
            argv.append(f"{flag_name(name)}={value}")
    return argv


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def bounds_text(bounds: dict[str, float]) -> str:
    """A number's bounds as the form's help says them: ``At least 1.``, ``From 0 to 1.``, ``Above 0 and below 1.``"""
    low = [f"{word} {bounds[key]:g}" for key, word in (("minimum", "at least"), ("exclusiveMinimum", "above")) if key in bounds]
    high = [f"{word} {bounds[key]:g}" for key, word in (("maximum", "at most"), ("exclusiveMaximum", "below")) if key in bounds]
    if "minimum" in bounds and "maximum" in bounds:
        text = f"from {bounds['minimum']:g} to {bounds['maximum']:g}"
    else:
        text = " and ".join(low + high)
    return f"{text[:1].upper()}{text[1:]}."


def schemas_of(model: type[BaseModel], names: tuple[str, ...], section: str | None = None) -> dict[str, dict[str, Any]]:
    """JSON schemas of ``model``'s fields ``names``, shaped for Airflow ``Param(**schema)``.

    A field with a default also takes null: Airflow's form marks a field required unless its type
    allows null, and a run can start without any of these (:meth:`PipelineConfig.from_params`
    reads null as the default).
    """
    schema = model.model_json_schema()
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        prop = dict(schema["properties"][name])
        if "anyOf" in prop:  # Optional[X] -> type [X, "null"], with X's own keywords (items, uniqueItems, bounds)
            variants = prop.pop("anyOf")
            prop["type"] = [v.get("type") for v in variants if "type" in v]
            for variant in variants:
                prop.update({key: value for key, value in variant.items() if key not in ("type", "enum")})
            if any("enum" in v for v in variants):
                prop["enum"] = [e for v in variants for e in v.get("enum", [])] + [None]
        if "format" in prop and prop["format"] == "path":
            prop.pop("format")
        field = model.model_fields[name]
        if field.default_factory is not None:
            prop["default"] = field.default_factory()
        elif field.is_required():
            prop.setdefault("default", None)
        if not field.is_required() and isinstance(prop.get("type"), str):
            prop["type"] = [prop["type"], "null"]
            if "enum" in prop:
                prop["enum"] = [*prop["enum"], None]
        if bounds := {key: prop.pop(key) for key in BOUNDS if key in prop}:
            # Airflow's trigger form hands a top-level minimum/maximum to its number field, which clamps a typed
            # value into them when it loses focus, silently; under allOf the value stays as typed and the trigger
            # refuses it, naming the Param (jsonschema applies allOf's bounds the same way). The form checks no bound
            # itself (only required fields, arrays' JSON, durations) and shows the refusal above its first field: the
            # help under the field says the range, where the value is typed.
            prop["allOf"] = [bounds]
            said = prop.get("description", "").rstrip()
            prop["description"] = f"{said}{'' if not said or said.endswith('.') else '.'} {bounds_text(bounds)}".lstrip()
        if section is not None:
            prop.setdefault("section", section)
        out[name] = prop
    return out
