"""Facts about the verifier (base) model read from its folder, without loading weights.

The one place that reads a model's ``config.json``: the layer count, hidden size and
vocabulary every stage sizes itself by, and the aux layer ids a run captures.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError
from eagleflow.startup import collector_paused
from sglang_patch.layer_ids import default_aux_layer_ids, validate_aux_layer_ids

# Where multimodal wrappers nest their language model's config: Kimi-K2.5 (``text_config``),
# DeepSeek-VL2-style models (``language_config``). Plain causal LMs keep it at the top level.
NESTED_TEXT_CONFIG_KEYS = ("text_config", "language_config")
# A nested dict is the language model's config when it sizes the model.
_SIZE_KEYS = ("num_hidden_layers", "hidden_size", "vocab_size")


def model_folder_problem(model_dir: Path) -> str | None:
    """What keeps ``model_dir`` from being a model folder, in plain words; None when nothing does."""
    from eagleflow.files import path_problem

    why = path_problem(model_dir, "folder")
    if why == "is not a folder":
        return "is not a folder (give the model's folder: config.json, weights, tokenizer)"
    return why or (None if (model_dir / "config.json").is_file() else "has no config.json (is it a model folder?)")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The model folder's whole ``config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir} {model_folder_problem(Path(model_dir))}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from exc


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a parsed ``config.json`` (the nested one of a multimodal wrapper)."""
    for key in NESTED_TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and any(key in nested for key in _SIZE_KEYS):
            return nested
    return config


def text_config(model_dir: str | Path) -> dict[str, Any]:
    """The language-model part of ``<model_dir>/config.json``."""
    return text_config_of(read_config(model_dir))


def config_int(model_dir: str | Path, key: str) -> int:
    """An integer field of the text config, e.g. ``hidden_size``, ``num_hidden_layers`` or ``vocab_size``."""
    value = text_config(model_dir).get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{Path(model_dir) / 'config.json'} has no integer {key!r} (nor in its text_config)")
    return value


def config_float(model_dir: str | Path, key: str, default: float | None = None) -> float:
    """A number of the text config, e.g. ``rms_norm_eps``; ``default`` when absent (else an error)."""
    value = text_config(model_dir).get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{Path(model_dir) / 'config.json'} has no number {key!r} (nor in its text_config)")
    return float(value)


def resolve_aux_layer_ids(model_dir: str | Path, aux_layer_ids: Sequence[int] | None, name: str = "--aux-layer-ids") -> list[int]:
    """The aux ids a run captures: as given, else speculators' default for the model's depth.

    Checked against the model's layer count with the one rule
    (:func:`sglang_patch.layer_ids.validate_aux_layer_ids`); ``name`` is how the caller's user
    spelled the setting (a flag or a Param), and the error starts with it.
    """
    num_layers = config_int(model_dir, "num_hidden_layers")
    ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers)
    try:
        return validate_aux_layer_ids(ids, num_layers)
    except ValueError as exc:
        raise UserError(f"{name}: {exc}") from exc


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False) -> Any:
    """The verifier's tokenizer (transformers' ``AutoTokenizer``), as every step loads it.

    Without the cyclic collector: transformers' import and the tokenizer are start-up
    (:mod:`eagleflow.startup`). What it raises is the caller's to explain, with what it needed it for.
    """
    with collector_paused():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
