"""SGLang's EAGLE-3 draft model folder: the one place that knows what SGLang reads from it.

Read from ``sglang/srt/models/llama_eagle3.py`` (0.5.20–0.5.23, unchanged in what it reads) and
each target model's ``set_eagle3_layers_to_capture``; ``tests/eagleflow/export/`` runs that real
source on what :func:`sglang_config` and :func:`sglang_weights` produce.

- The class is picked by ``architectures``: ``LlamaForCausalLMEagle3``. It reads the Llama layer
  config at the top level (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``intermediate_size``, ``hidden_act``, ``rms_norm_eps``, ``rope_parameters``,
  ``max_position_embeddings``, ``num_hidden_layers``, ``vocab_size``, ``tie_word_embeddings``),
  plus ``draft_vocab_size``, ``target_hidden_size``, ``norm_output``, ``fc_norm`` and, under
  ``eagle_config``, ``eagle_aux_hidden_state_layer_ids`` (their count sizes ``fc``) and
  ``norm_before_fc``. speculators nests the layer config under ``transformer_layer_config``.
- ``load_weights`` maps ``q/k/v_proj`` onto ``qkv_proj``, ``gate/up_proj`` onto ``gate_up_proj``,
  prefixes ``model.`` where needed, turns ``d2t`` into hot token ids (``d2t + arange``), ignores
  ``t2d`` and **silently skips any other name it does not know**. The draft's embedding is
  replaced by the target's at start (``set_embed``), so it is not exported.
- The draft layer is SGLang's Llama decoder layer: a checkpoint whose layer is another
  architecture (speculators' ``qwen3`` draft has q/k norms) would lose weights, so it is refused.
  SGLang builds q/k/v without bias (``llama_eagle3.py`` overrides ``qkv_proj``) and the MLP without
  bias, but ``o_proj`` with the config's ``attention_bias``: non-zero q/k/v or MLP biases are
  refused, an ``o_proj`` bias is served.
- Every tensor the class builds must be in the file with the shape its config gives it (it loads
  whatever shape it is handed into a parameter sized by the config, or skips it):
  :func:`expected_eagle3_weights` lists them, as speculators' ``Eagle3DraftModel`` saves them.
- Rotary settings: SGLang reads ``rope_parameters``, else ``rope_scaling`` with ``rope_theta``
  (:mod:`eagleflow.sglang_rules.rope`); the export writes ``rope_parameters`` either way, and
  :func:`eagleflow.export.rotary.check_rotary` refuses a drafter whose rotary SGLang computes otherwise.
- The draft's ``hidden_size`` must be the verifier's: speculators' EAGLE-3 ``fc`` reads aux states
  of the draft's own width and embeds with the verifier's embedding, while for a draft of another
  width SGLang sizes ``fc`` by ``target_hidden_size`` and keeps the draft's own embedding.
- The aux layer ids SGLang captures follow the *target's* rule, not the draft's: eagleflow's id k
  (the state entering layer k, as speculators counts) becomes k - 1 for Llama/Qwen targets, which
  add one back, and stays k for DeepSeek-V2/V3 and Kimi-K2.5, which take ids as given unless the
  first one is 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleflow.export import (
    COMMON_CONFIG_KEYS, CheckpointLayout, Expected, LayerShape, NotServable, decoder_layer, layer_config, vocabulary_tensors,
)
from eagleflow.sglang_rules import OLDEST_SGLANG
from eagleflow.verifier import config_int, read_config

if TYPE_CHECKING:
    from eagleflow.export import Checkpoint

SGLANG_DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
SGLANG_DRAFT_LAYER_TYPE = "llama"

# How a target model turns the draft config's aux ids into the layers whose input it captures.
PLUS_ONE = "plus_one"  # llama.py, qwen2.py, qwen3.py: layers_to_capture = [k + 1 for k in ids]
AS_GIVEN = "as_given_unless_first_is_1"  # deepseek_v2.py: ids as given, unless ids[0] == 1 (then + 1)
# target architecture -> (SGLang model file, capture rule); the source test checks each rule.
TARGET_CAPTURE_RULES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama.py", PLUS_ONE),
    "Qwen2ForCausalLM": ("qwen2.py", PLUS_ONE),
    "Qwen3ForCausalLM": ("qwen3.py", PLUS_ONE),
    "DeepseekV2ForCausalLM": ("deepseek_v2.py", AS_GIVEN),
    "DeepseekV3ForCausalLM": ("deepseek_v2.py", AS_GIVEN),
    # Kimi-K2.5 hands the ids to its language model, a DeepseekV3ForCausalLM (kimi_k25.py).
    "KimiK25ForConditionalGeneration": ("kimi_k25.py", AS_GIVEN),
}
# The SGLang release from which LlamaForCausalLMEagle3 reads each setting a drafter may use (the
# source test checks each against the wheels on both sides of the boundary). Older releases
# ignore the setting and serve another function, so an export records what it needs.
SINCE: dict[str, tuple[int, int, int]] = {
    "base": OLDEST_SGLANG,
    "aux_layer_count": (0, 5, 13),  # fc sized by the number of aux ids (before: always 3)
    "fc_norm": (0, 5, 13),
    "norm_output": (0, 5, 13),
    "norm_before_fc": (0, 5, 17),
}
# The draft layers speculators' EAGLE-3 builds (speculators/models/eagle3/model_definitions.py model_classes).
EAGLE3_LAYER_TYPES = ("llama", "qwen3")
# Checkpoint weights the SGLang folder leaves out, and why.
NOT_EXPORTED = {
    "embed_tokens.weight": "SGLang gives the draft the target's embedding (set_embed); speculators froze a copy of it",
    "t2d": "SGLang ignores t2d; d2t alone gives the hot token ids",
}
# speculators' plain Llama layers after the first: their input norm is SGLang's hidden_norm.
_LATER_INPUT_NORM = re.compile(r"^layers\.([1-9]\d*)\.input_layernorm\.weight$")
# Layer-config keys copied to the top level of SGLang's config (LlamaConfig fields it reads).
LAYER_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "num_hidden_layers", "rope_parameters",
    "attention_bias", "mlp_bias",
)
# Biases SGLang's draft layer never builds (it would drop them without a word).
_UNBUILT_BIAS = re.compile(r"^layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up|down)_proj)\.bias$")


def sglang_aux_layer_ids(aux_layer_ids: Sequence[int], target_architecture: str) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang capture the states entering layers ``aux_layer_ids``."""
    if target_architecture not in TARGET_CAPTURE_RULES:
        raise NotServable(
            f"the target architecture {target_architecture} is not one whose SGLang capture rule eagleflow has "
            f"checked ({', '.join(sorted(TARGET_CAPTURE_RULES))}); serve the speculators folder with vLLM"
        )
    ids = [int(k) for k in aux_layer_ids]
    rule = TARGET_CAPTURE_RULES[target_architecture][1]
    if rule == PLUS_ONE:
        if 0 in ids:
            raise NotServable(
                f"aux layer id 0 (the embedding output) cannot be captured by SGLang for {target_architecture}: "
                "it captures layer outputs only"
            )
        return [k - 1 for k in ids]
    if ids and ids[0] == 1:
        raise NotServable(
            f"aux layer ids starting with 1 cannot be expressed for {target_architecture}: SGLang adds one to "
            "every id when the first is 1 (deepseek_v2.py set_eagle3_layers_to_capture)"
        )
    return ids


def captured_layer_ids(sglang_layer_ids: Sequence[int], target_architecture: str) -> list[int]:
    """The layers whose input an SGLang target captures for a draft config's ids (its ``layers_to_capture``)."""
    if target_architecture not in TARGET_CAPTURE_RULES:
        raise NotServable(f"no SGLang capture rule is known for target architecture {target_architecture}")
    ids = [int(k) for k in sglang_layer_ids]
    if TARGET_CAPTURE_RULES[target_architecture][1] == PLUS_ONE or (ids and ids[0] == 1):
        return [k + 1 for k in ids]
    return ids


def draft_window_size(layer_config: Mapping[str, Any]) -> int | None:
    """The sliding window SGLang must apply (``--speculative-draft-window-size``), or None for full attention.

    SGLang applies one window to every draft layer, so a mix of sliding and full layers is refused.
    """
    layer_types = list(layer_config.get("layer_types") or [])
    sliding = [t == "sliding_attention" for t in layer_types]
    if not any(sliding) or not layer_config.get("sliding_window"):
        return None
    if not all(sliding):
        raise NotServable(f"draft layers mix sliding and full attention ({layer_types}); SGLang applies one window to all")
    return int(layer_config["sliding_window"])


def sglang_config(checkpoint_config: Mapping[str, Any], target_architecture: str, target_hidden_size: int) -> dict[str, Any]:
    """SGLang's ``config.json`` for a speculators EAGLE-3 checkpoint config.

    :raises NotServable: trained as SGLang would not compute it, or a layer SGLang cannot load.
    """
    if checkpoint_config.get("speculators_model_type") != "eagle3":
        raise NotServable(f"not an EAGLE-3 checkpoint (speculators_model_type {checkpoint_config.get('speculators_model_type')!r})")
    if checkpoint_config.get("norm_before_residual", False):
        raise NotServable(
            "trained with norm_before_residual True: SGLang's draft layer keeps the pre-norm target state as its "
            "residual, so it would serve another function than the one trained (retrain with serve_with sglang, "
            "or serve the speculators folder with vLLM)"
        )
    layer = dict(checkpoint_config["transformer_layer_config"])
    if layer.get("model_type") != SGLANG_DRAFT_LAYER_TYPE:
        raise NotServable(
            f"the draft layer is a {layer.get('model_type')!r} layer; SGLang's {SGLANG_DRAFT_ARCHITECTURE} builds Llama "
            "layers and would silently drop the weights it does not know"
        )
    draft_hidden, trained_target = int(layer["hidden_size"]), checkpoint_config.get("target_hidden_size")
    if draft_hidden != target_hidden_size or (trained_target and int(trained_target) != target_hidden_size):
        raise NotServable(
            f"the draft's hidden_size {draft_hidden} (target_hidden_size {trained_target}) is not the verifier's "
            f"{target_hidden_size}: speculators' EAGLE-3 draft reads aux states of its own width and the verifier's "
            "embedding, while SGLang would size fc by target_hidden_size and keep the draft's own embedding "
            "(set_embed); a checkpoint of another verifier, or a shape speculators does not train"
        )
    config: dict[str, Any] = {key: layer[key] for key in LAYER_KEYS if key in layer}
    config["rope_parameters"] = rope_parameters(layer)
    eagle_config: dict[str, Any] = {
        "eagle_aux_hidden_state_layer_ids": sglang_aux_layer_ids(
            checkpoint_config["eagle_aux_hidden_state_layer_ids"], target_architecture
        ),
        "norm_before_fc": bool(checkpoint_config.get("norm_before_fc", False)),
        "use_aux_hidden_state": True,
    }
    config.update(
        architectures=[SGLANG_DRAFT_ARCHITECTURE],
        model_type=SGLANG_DRAFT_LAYER_TYPE,
        vocab_size=int(layer["vocab_size"]),  # the target's: SGLang sizes the embedding by it
        draft_vocab_size=int(checkpoint_config["draft_vocab_size"]),
        target_hidden_size=target_hidden_size,
        tie_word_embeddings=False,
        norm_output=bool(checkpoint_config.get("norm_output", False)),
        fc_norm=bool(checkpoint_config.get("fc_norm", False)),
        eagle_config=eagle_config,
        dtype=checkpoint_config.get("dtype") or checkpoint_config.get("torch_dtype") or "bfloat16",
    )
    return config


def rope_parameters(layer: Mapping[str, Any]) -> dict[str, Any]:
    """The layer's rotary settings as one ``rope_parameters`` dict (SGLang reads it first).

    A layer config written without ``rope_parameters`` (transformers before 5) keeps ``rope_theta``
    and ``rope_scaling`` at its top level; both are carried.
    """
    if layer.get("rope_parameters") is not None:
        return dict(layer["rope_parameters"])
    scaling = dict(layer.get("rope_scaling") or {})
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return {**scaling, "rope_type": kind, "rope_theta": float(layer.get("rope_theta", 10000.0))}


def expected_eagle3_weights(checkpoint_config: Mapping[str, Any]) -> dict[str, Expected]:
    """Every tensor speculators' ``Eagle3DraftModel`` saves for ``checkpoint_config``, with its shape
    (``speculators/models/eagle3/core.py``): what ``LlamaForCausalLMEagle3`` loads too, under the names
    :func:`sglang_weights` gives them. The variant is in the weights: ``norm_before_fc`` builds
    ``input_norm``, ``fc_norm`` one ``fc_norm.{i}`` per aux layer (``norm_output`` builds nothing).

    :raises ValueError: a config speculators would not build (both norms, a layer type it has not).
    """
    layer = layer_config(checkpoint_config["transformer_layer_config"])
    if layer["model_type"] not in EAGLE3_LAYER_TYPES:
        raise ValueError(f"transformer_layer_config model_type {layer['model_type']!r}: speculators' EAGLE-3 builds {', '.join(EAGLE3_LAYER_TYPES)} layers")
    d, ids = LayerShape.of(layer), checkpoint_config.get("eagle_aux_hidden_state_layer_ids")
    before_fc, fc_norm = bool(checkpoint_config.get("norm_before_fc", False)), bool(checkpoint_config.get("fc_norm", False))
    if before_fc and fc_norm:
        raise ValueError("norm_before_fc and fc_norm are both true: speculators builds one or the other")
    n = len(ids) if ids else 3  # speculators' default count
    aux = f"eagle_aux_hidden_state_layer_ids {ids}: {n} aux layers × {d.width}"
    out = {
        "fc.weight": Expected((d.hidden, n * d.hidden), aux),
        "input_norm.weight": Expected((n * d.hidden,) if before_fc else None, f"norm_before_fc {json.dumps(before_fc)}, {aux}"),
        "layers.0.hidden_norm.weight": Expected((d.hidden,), d.width),
        "norm.weight": Expected((d.hidden,), d.width),
        **{f"fc_norm.{i}.weight": Expected((d.hidden,) if fc_norm else None, f"fc_norm {json.dumps(fc_norm)}, {aux}") for i in range(n)},
        **vocabulary_tensors(d, int(checkpoint_config["draft_vocab_size"]), head_always_saved=True),
    }
    first = f"2 × {d.width}: the first layer reads the embedding beside the state"
    for i in range(d.layers):
        out.update(decoder_layer(i, d, 2 * d.hidden if i == 0 else d.hidden, first if i == 0 else d.width, layer["model_type"] == "qwen3"))
    return out


def unserved_weights(tensors: Mapping[str, Any]) -> list[str]:
    """Names of non-zero biases SGLang's draft layer does not build (q/k/v, MLP): it would drop them."""
    return sorted(name for name, t in tensors.items() if _UNBUILT_BIAS.match(name) and bool(t.abs().max() > 0))


def sglang_features(config: Mapping[str, Any]) -> list[str]:
    """The :data:`SINCE` settings an exported ``config`` relies on."""
    eagle = config.get("eagle_config") or {}
    used = ["base"]
    if len(eagle.get("eagle_aux_hidden_state_layer_ids") or []) != 3:
        used.append("aux_layer_count")
    used += [name for name in ("fc_norm", "norm_output") if config.get(name)]
    if eagle.get("norm_before_fc"):
        used.append("norm_before_fc")
    return used


def minimum_sglang(config: Mapping[str, Any]) -> str:
    """The oldest SGLang that serves an exported ``config`` as trained, e.g. ``"0.5.17"``."""
    return ".".join(str(n) for n in max(SINCE[name] for name in sglang_features(config)))


def sglang_weights(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors under the names SGLang's ``load_weights`` maps (all but :data:`NOT_EXPORTED`
    and the zero biases SGLang never builds).

    One addition: in the layers after the first, SGLang normalises the layer input with
    ``hidden_norm`` (fusing the residual add) where speculators' plain Llama layer uses
    ``input_layernorm``; the same weight also goes under SGLang's name, or SGLang would keep its
    freshly initialised ``hidden_norm`` without a word. (The original name stays: SGLang builds
    that parameter too, unused.)
    """
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if name in NOT_EXPORTED or _UNBUILT_BIAS.match(name):  # zero biases (unserved_weights refuses others)
            continue
        out[name] = tensor
        match = _LATER_INPUT_NORM.match(name)
        if match:
            out[f"layers.{match.group(1)}.hidden_norm.weight"] = tensor.clone() if hasattr(tensor, "clone") else tensor
    return out


# What the export reads from an EAGLE-3 checkpoint and the tensors it holds (eagleflow.export.read_checkpoint).
CHECKPOINT = CheckpointLayout(
    {**COMMON_CONFIG_KEYS, "eagle_aux_hidden_state_layer_ids": "the verifier layers the drafter reads"}, expected_eagle3_weights
)


def export_eagle3_sglang(checkpoint: Checkpoint | Path, verifier: Path, target: Path) -> dict[str, Any]:
    """SGLang's folder for ``checkpoint`` written to ``target``; returns what ``export.json`` says about it
    (``path`` relative to the drafter folder, ``target``'s parent).

    :raises NotServable: SGLang would not compute what was trained.
    """
    # the reference engine needs none of these
    from eagleflow.export import check_rotary, config_read_as, read_checkpoint, write_drafter_folder

    if isinstance(checkpoint, Path):
        checkpoint = read_checkpoint(checkpoint)
    architecture = (read_config(verifier).get("architectures") or ["?"])[0]
    with config_read_as(checkpoint.config_path, "draft config"):
        config = sglang_config(checkpoint.config, architecture, config_int(verifier, "hidden_size"))
        window = draft_window_size(checkpoint.config["transformer_layer_config"])
        check_rotary(checkpoint.config["transformer_layer_config"], config)
        dropped = unserved_weights(checkpoint.weights)
        if dropped:
            raise NotServable(f"SGLang's draft layer builds no {', '.join(dropped)} (q/k/v and MLP without bias) and would drop them")
    weights = sglang_weights(checkpoint.weights)
    write_drafter_folder(target, weights, config)
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return {
        "path": target.name,
        "algorithm": "EAGLE3",
        "target_architecture": architecture,
        "eagle_aux_hidden_state_layer_ids": sglang_ids,
        "captures_layers": captured_layer_ids(sglang_ids, architecture),
        "draft_window_size": window,
        "num_steps": _proposal_steps(checkpoint.config),
        "minimum_sglang": minimum_sglang(config),
        "sglang_features": sglang_features(config),
        "weights": sorted(weights),
    }


def _proposal_steps(checkpoint_config: dict[str, Any]) -> int:
    """The draft length the drafter was trained for (its TTT steps), a natural --speculative-num-steps."""
    methods = (checkpoint_config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 3)
