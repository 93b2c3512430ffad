"""Facts about the verifier (base) model read from its folder, without loading weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError


def text_config(model_dir: str | Path) -> dict[str, Any]:
    """The language-model part of ``config.json``.

    Multimodal wrappers such as Kimi-K2.5 nest it under ``text_config``; plain causal LMs
    (DeepSeek-V3, the tiny verifier) keep it at the top level.
    """
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise UserError(f"{model_dir} has no config.json (is it a model folder?)")
    config = json.loads(path.read_text())
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and "hidden_size" in nested else config


def config_int(model_dir: str | Path, key: str) -> int:
    """An integer field of the text config, e.g. ``hidden_size`` or ``vocab_size``."""
    value = text_config(model_dir).get(key)
    if not isinstance(value, int):
        raise UserError(f"{Path(model_dir) / 'config.json'} has no integer {key!r}")
    return value
