"""What SGLang computes when it serves a DFlash block drafter: layer ids and attention masks.

Read from SGLang 0.5.23 (``srt/models/dflash.py``, ``srt/speculative/dflash_utils.py``,
``dflash_worker_v2.py`` and each target's ``set_dflash_layers_to_capture``); the export writes by
these rules, the reference engine serves by them and the evaluation names them, each importing
this module, so none of them can drift from the others.

- **Layer ids.** SGLang's ``dflash_config.target_layer_ids`` k is the *output* of target layer k
  (HF style); every target that serves DFlash captures the input of layer ``k + 1``
  (``layers_to_capture = [val + 1 for val in layer_ids]``: llama, qwen3, qwen3_moe, deepseek_v2 and
  Kimi-K2.5 through it). eagleflow's id k is the state entering layer k, so SGLang's id is ours − 1.
  Our id 0 (the embedding output) and our id n (the final pre-norm state, the input of a layer that
  does not exist) can never be captured. Without ``target_layer_ids`` SGLang picks other layers,
  silently (``build_target_layer_ids``), so the export always writes them.
- **Attention in the block.** ``layer_types[i]`` ``full_attention``: the block attends to every
  committed token and to itself both ways (``ENCODER_ONLY``); ``sliding_attention``: causal, with
  ``sliding_window - 1`` keys to the left of each query (HF windows count the query itself); the
  config's ``is_causal`` overrides the direction of both. **No ``layer_types``: every layer
  bidirectional, no window.**
- **Mask token.** resolved as for every block drafter (:mod:`eagleflow.sglang_rules.mask_token`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagleflow.sglang_rules import BlockRuleError

# Targets whose SGLang model class implements set_dflash_layers_to_capture (each with the + 1 rule);
# qwen2 does not, so SGLang cannot serve a DFlash drafter for it.
DFLASH_TARGETS: dict[str, str] = {
    "LlamaForCausalLM": "llama.py",
    "Qwen3ForCausalLM": "qwen3.py",
    "Qwen3MoeForCausalLM": "qwen3_moe.py",
    "DeepseekV2ForCausalLM": "deepseek_v2.py",
    "DeepseekV3ForCausalLM": "deepseek_v2.py",
    "KimiK25ForConditionalGeneration": "kimi_k25.py",
}


class DFlashRuleError(BlockRuleError):
    """A DFlash setting SGLang would serve differently from how it was trained, or not at all."""


def sglang_target_layer_ids(aux_layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """SGLang's ``target_layer_ids`` for eagleflow's aux ids (ours − 1), refusing what it cannot capture."""
    ids = [int(k) for k in aux_layer_ids]
    if not ids:
        raise DFlashRuleError("a DFlash drafter needs at least one context layer (aux layer ids)")
    if 0 in ids:
        raise DFlashRuleError("aux layer id 0 (the embedding output) cannot be a DFlash context layer: SGLang captures layer outputs only")
    if num_target_layers in ids:
        raise DFlashRuleError(
            f"aux layer id {num_target_layers} is the final pre-norm state of the {num_target_layers}-layer target: SGLang "
            "captures the input of layer id + 1, which does not exist, so it can never be a DFlash context layer"
        )
    outside = [k for k in ids if not 0 < k < num_target_layers]
    if outside:
        raise DFlashRuleError(f"aux layer ids {outside} are not layers of the {num_target_layers}-layer target")
    if ids != sorted(set(ids)):
        raise DFlashRuleError(
            f"aux layer ids {ids} are not in increasing order: SGLang concatenates the captured states in layer "
            "order, so fc would read them in another order than it was trained on"
        )
    return [k - 1 for k in ids]


def captured_layer_ids(target_layer_ids: Sequence[int]) -> list[int]:
    """The layers whose input an SGLang target captures for ``dflash_config.target_layer_ids`` (our ids)."""
    return [int(k) + 1 for k in target_layer_ids]


@dataclass(frozen=True)
class BlockAttention:
    """How one draft layer's block attends: both ways or causally, and how far back (None: no window)."""

    bidirectional: bool
    window_left: int | None


def layer_attention(config: Mapping[str, Any], num_layers: int) -> list[BlockAttention]:
    """Each draft layer's :class:`BlockAttention` for an exported ``config.json`` (``_get_dflash_layer_attention_params``)."""
    layer_types = config.get("layer_types")
    is_causal = config.get("is_causal")
    if layer_types is None:
        return [BlockAttention(True, None)] * num_layers
    if isinstance(layer_types, str) or len(layer_types) < num_layers:
        raise DFlashRuleError(f"layer_types {layer_types!r} must name each of the {num_layers} draft layers")
    out = []
    for i, kind in enumerate(list(layer_types)[:num_layers]):
        if kind == "full_attention":
            out.append(BlockAttention(True if is_causal is None else not is_causal, None))
        elif kind == "sliding_attention":
            window = config.get("sliding_window")
            if window is None:
                raise DFlashRuleError("sliding_attention layers need sliding_window")
            out.append(BlockAttention(False if is_causal is None else not is_causal, int(window) - 1))
        else:
            raise DFlashRuleError(f"layer_types[{i}] = {kind!r} is not a DFlash layer type SGLang serves")
    return out
