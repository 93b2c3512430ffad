"""The model's context length, and what a request may ask for inside it, as SGLang rules it.

Read from the SGLang wheels (0.5.10 and 0.5.23, the ends of the range the hook supports):

- **The length.** ``ModelConfig.context_len`` is ``--context-length`` when given (never more than
  the derived length unless an env var allows it), else ``get_context_length`` of the verifier's
  text config: the first of :data:`CONTEXT_LENGTH_KEYS` present, times the rope-scaling
  ``factor`` unless the scaling names ``original_max_position_embeddings`` or is ``llama3``;
  2048 when no key is there. SGLang's ``/model_info`` does not report it; its OpenAI
  ``GET /v1/models`` does, as ``data[0].max_model_len`` (:func:`context_length_of_model_list`).
- **The checks** (``TokenizerManager._validate_one_request``): a prompt of ``context_len``
  tokens or more is refused ("The input (N tokens) is longer than the model's context
  length"); so is ``prompt + max_new_tokens >= context_len`` in 0.5.10 and ``> context_len`` in
  0.5.23 ("Requested token count exceeds the model's maximum context length"), only when the
  request names ``max_new_tokens``. :func:`max_new_tokens_left` keeps to the stricter rule, so
  what it allows every supported release accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# SGLang's hf_transformers CONTEXT_LENGTH_KEYS, in its order: the first one set wins.
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
DEFAULT_CONTEXT_LENGTH = 2048  # SGLang's when the config names none of the keys


def _field(config: Mapping[str, Any] | Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def derived_context_length(text_config: Mapping[str, Any] | Any) -> int:
    """SGLang's ``get_context_length`` of a text config (a parsed ``config.json`` dict or a ``PretrainedConfig``)."""
    # transformers 5 names the rope settings rope_parameters; SGLang reads rope_scaling.
    scaling = _field(text_config, "rope_scaling") or _field(text_config, "rope_parameters")
    factor: float = 1
    if isinstance(scaling, Mapping):
        factor = scaling.get("factor", 1) or 1
        if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
            factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        value = _field(text_config, key)
        if value is not None:
            return int(factor * value)
    return DEFAULT_CONTEXT_LENGTH


def max_new_tokens_left(context_length: int, prompt_tokens: int) -> int:
    """The most ``max_new_tokens`` a prompt of ``prompt_tokens`` may ask for; below 1: the prompt leaves no room.

    One token short of the context: 0.5.10 refuses ``prompt + max_new_tokens == context_len``.
    """
    return context_length - prompt_tokens - 1


def context_length_of_model_list(answer: Any) -> int | None:
    """``max_model_len`` of the first model card in a ``GET /v1/models`` answer; None when it has none."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
        return None
    value = cards[0].get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_list(served_model_name: str, context_length: int, created: int) -> dict[str, Any]:
    """SGLang's ``GET /v1/models`` answer (its ``ModelList`` of one ``ModelCard``) for one served model."""
    card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "sglang",
            "root": served_model_name, "parent": None, "max_model_len": context_length}
    return {"object": "list", "data": [card]}
