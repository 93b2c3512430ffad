"""SGLang's DFLASH draft model folder: the one place that knows what SGLang reads from it.

Read from SGLang 0.5.23 (``srt/models/dflash.py`` ``DFlashDraftModel``, ``srt/speculative/dflash_utils.py``
``parse_dflash_draft_config``, ``dflash_worker_v2.py``); what it computes with what it reads is
:mod:`eagleflow.drafters.dflash.sglang_rules`'s, and the reference engine (:mod:`eagleflow.drafters.dflash.reference`)
serves this folder by those rules.

- The class is picked by ``architectures``: ``DFlashDraftModel``. It reads a **flat** Qwen3 config
  (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
  ``hidden_act``, ``rms_norm_eps``, the rotary settings, ``max_position_embeddings``,
  ``num_hidden_layers``, ``attention_bias``, ``layer_types``, ``sliding_window``) and ``dflash_config``
  (``block_size``, ``target_layer_ids``, ``mask_token_id``, ``num_target_layers``). speculators nests
  the layer config under ``transformer_layer_config`` as a *diff* against its config class's defaults,
  so it is rebuilt through that class and written whole: SGLang reads the defaults of nothing.
- ``load_weights`` maps ``q/k/v_proj`` onto ``qkv_proj`` and ``gate/up_proj`` onto ``gate_up_proj``,
  adds or strips ``model.``, **silently skips names it does not know and never reports a weight it
  built but did not load**: every tensor its class builds must be in the file with the shape the
  config gives it, and nothing else may be (it would be dropped). :func:`expected_dflash_weights`
  lists them (shapes from the config: hidden, heads × head_dim, kv heads, intermediate, layers, the
  aux layer count); :func:`checkpoint_dflash_weights` adds what speculators' ``DFlashDraftModel``
  saves beside them, so a checkpoint is checked against itself before anything is written.
- The draft borrows the *target's* embedding and ``lm_head`` (draft tokens are the argmax of the
  target's head over the draft's ``norm(hidden)``), so a reduced draft vocabulary cannot be served.
- Aux ids: SGLang's ``target_layer_ids`` are ours − 1 (:func:`eagleflow.sglang_rules.sglang_target_layer_ids`);
  without them SGLang picks other layers silently, so they are always written.
- Sliding layers: SGLang serves them causally with ``sliding_window - 1`` keys left of each query;
  speculators trains a fixed window before the anchor, the same function only while the window is
  longer than the context (``sglang_features`` records ``sliding_window``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleflow.export import (
    COMMON_CONFIG_KEYS, CheckpointLayout, Expected, LayerShape, NotServable, check_tensors, config_read_as, decoder_layer,
    layer_config, vocabulary_tensors, write_drafter_folder,
)

if TYPE_CHECKING:
    from eagleflow.export import Checkpoint

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_ALGORITHM = "DFLASH"
MINIMUM_SGLANG = "0.5.23"  # the release whose dflash.py and dflash_utils.py eagleflow read
# transformers' generic config fields: none of them is a setting SGLang's draft reads.
_NOISE = (
    "_name_or_path", "architectures", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
    "output_attentions", "output_hidden_states", "problem_type", "return_dict", "transformers_version", "dtype",
    "torch_dtype", "use_cache", "tie_word_embeddings",
)
# Checkpoint tensors the SGLang folder leaves out, and why.
NOT_EXPORTED = {
    "embed_tokens.weight": "SGLang embeds the block with the target's embedding",
    "verifier_lm_head.weight": "training's frozen copy of the verifier's head",
    "verifier_norm.weight": "training's frozen copy of the verifier's final norm",
}
# Tensors of a reduced draft vocabulary: SGLang argmaxes the target's full head and has no use for them.
REDUCED_VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d")


def dflash_sglang_config(checkpoint_config: Mapping[str, Any], verifier_config: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``config.json`` for a speculators DFlash checkpoint config and the verifier's ``config.json``.

    :raises NotServable: what SGLang would serve as another function than the one trained, or not at all.
    """
    from eagleflow.verifier import text_config_of
    from eagleflow.drafters.dflash import DFLASH_TARGETS, DFlashRuleError, layer_attention, sglang_target_layer_ids
    from eagleflow.sglang_rules import BlockRuleError, resolve_mask_token_id

    if checkpoint_config.get("speculators_model_type") != "dflash":
        raise NotServable(f"not a DFlash checkpoint (speculators_model_type {checkpoint_config.get('speculators_model_type')!r})")
    verifier = text_config_of(dict(verifier_config))
    architecture = (verifier_config.get("architectures") or ["?"])[0]
    if architecture not in DFLASH_TARGETS:
        raise NotServable(
            f"the target architecture {architecture} has no DFlash capture in SGLang (set_dflash_layers_to_capture: "
            f"{', '.join(sorted(DFLASH_TARGETS))}); serve the speculators folder with vLLM"
        )
    layer = layer_config(checkpoint_config["transformer_layer_config"])
    target_vocab, target_hidden, target_layers = int(verifier["vocab_size"]), int(verifier["hidden_size"]), int(verifier["num_hidden_layers"])
    if int(layer["vocab_size"]) != target_vocab:
        raise NotServable(f"the draft layer's vocab_size {layer['vocab_size']} is not the target's {target_vocab}: a checkpoint of another verifier")
    if int(checkpoint_config["draft_vocab_size"]) != target_vocab:
        raise NotServable(
            f"a reduced draft vocabulary (draft_vocab_size {checkpoint_config['draft_vocab_size']} of the target's "
            f"{target_vocab}): SGLang argmaxes the target's full head, so the drafter would be served as another "
            "function; train the full vocabulary"
        )
    if int(checkpoint_config["block_size"]) < 2:
        raise NotServable(f"block_size {checkpoint_config['block_size']}: a block holds the bonus token and at least one draft")
    if checkpoint_config.get("sample_from_anchor"):
        raise NotServable(
            "trained with sample_from_anchor True: SGLang's DFLASH proposes from the mask slots only (the anchor is "
            "the bonus token), so slot 0's training would go unused and every later slot would be shifted"
        )
    sliding = [i for i, kind in enumerate(layer.get("layer_types") or []) if kind == "sliding_attention"]
    if checkpoint_config.get("sliding_window_non_causal") and sliding:
        raise NotServable(
            f"trained with sliding_window_non_causal True: SGLang serves the sliding layers {sliding} causally "
            "within the block (no is_causal override reaches only them)"
        )
    if layer.get("hidden_act") != "silu":
        raise NotServable(f"hidden_act {layer.get('hidden_act')!r}: speculators' Qwen3 draft MLP trained with it, SGLang's DFlashMLP serves silu")
    draft_hidden, trained_target = int(layer["hidden_size"]), checkpoint_config.get("target_hidden_size")
    if trained_target is not None and int(trained_target) != draft_hidden:
        raise NotServable(f"target_hidden_size {trained_target} differs from the draft's hidden_size {draft_hidden}: SGLang sizes fc by hidden_size")
    if draft_hidden != target_hidden:
        raise NotServable(
            f"the draft's hidden_size {draft_hidden} is not the verifier's {target_hidden}: SGLang embeds the block "
            "with the target's embedding and sizes fc for aux states of the draft's width"
        )
    try:
        target_layer_ids = sglang_target_layer_ids(checkpoint_config["aux_hidden_state_layer_ids"], target_layers)
        mask = checkpoint_config.get("mask_token_id")
        if mask is None:
            raise DFlashRuleError("no mask_token_id: SGLang would resolve one from the tokenizer, not the one trained")
        mask_token_id = resolve_mask_token_id(None, target_vocab, int(mask))
        layer_attention(layer, int(layer["num_hidden_layers"]))  # each layer's attention is one SGLang serves
    except BlockRuleError as exc:
        raise NotServable(str(exc)) from exc
    rope = layer.get("rope_parameters") or {}
    if "rope_dim" in rope:
        raise NotServable(f"rotary settings {rope}: SGLang rotates rope_dim dims where transformers' Qwen3 draft rotated the whole head")
    config = {key: value for key, value in layer.items() if key not in _NOISE}
    config.update(
        architectures=[DFLASH_ARCHITECTURE],
        model_type="qwen3",
        vocab_size=target_vocab,
        tie_word_embeddings=False,
        dtype=checkpoint_config.get("dtype") or checkpoint_config.get("torch_dtype") or "bfloat16",
        dflash_config={
            "block_size": int(checkpoint_config["block_size"]),
            "target_layer_ids": target_layer_ids,
            "mask_token_id": mask_token_id,
            "num_target_layers": target_layers,
        },
    )
    return config


def expected_dflash_weights(config: Mapping[str, Any]) -> dict[str, Expected]:
    """Every tensor SGLang's ``DFlashDraftModel`` builds for an exported ``config`` (none is reported
    missing), with the shape the config gives it."""
    ids = list((config.get("dflash_config") or {}).get("target_layer_ids") or [])
    return _dflash_tensors(LayerShape.of(config), f"dflash_config.target_layer_ids {ids}", len(ids))


def checkpoint_dflash_weights(checkpoint_config: Mapping[str, Any]) -> dict[str, Expected]:
    """Every tensor speculators' ``DFlashDraftModel`` saves for ``checkpoint_config``
    (``speculators/models/dflash/core.py``): SGLang's (:func:`expected_dflash_weights`) and the
    vocabulary's (a reduced one's head and maps; the frozen copies it may keep)."""
    d, ids = LayerShape.of(layer_config(checkpoint_config["transformer_layer_config"])), list(checkpoint_config["aux_hidden_state_layer_ids"])
    vocabulary = vocabulary_tensors(d, int(checkpoint_config["draft_vocab_size"]), head_always_saved=False)
    return {**_dflash_tensors(d, f"aux_hidden_state_layer_ids {ids}", len(ids)), **vocabulary}


def _dflash_tensors(d: LayerShape, aux: str, aux_layers: int) -> dict[str, Expected]:
    out = {
        "fc.weight": Expected((d.hidden, aux_layers * d.hidden), f"{aux}: {aux_layers} aux layers × {d.width}"),
        "hidden_norm.weight": Expected((d.hidden,), d.width),
        "norm.weight": Expected((d.hidden,), d.width),
    }
    qwen3 = replace(d, mlp_bias=False)  # speculators' and SGLang's draft layer is Qwen3's: q/k norms, no MLP bias
    for i in range(d.layers):
        out.update(decoder_layer(i, qwen3, d.hidden, d.width, qk_norm=True))
    return out


def dflash_sglang_weights(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors SGLang loads: all but :data:`NOT_EXPORTED` and a reduced vocabulary's."""
    return {name: t for name, t in tensors.items() if name not in NOT_EXPORTED and name not in REDUCED_VOCAB_TENSORS}


# What the export reads from a DFlash checkpoint and the tensors it holds (eagleflow.export.read_checkpoint).
CHECKPOINT = CheckpointLayout(
    {
        **COMMON_CONFIG_KEYS,
        "aux_hidden_state_layer_ids": "the verifier layers the drafter reads",
        "block_size": "the tokens of one draft block",
    },
    checkpoint_dflash_weights,
)


def check_dflash_weights(config: Mapping[str, Any], checkpoint: Checkpoint) -> None:
    """Refuse a reduced vocabulary (:class:`NotServable`), and (:class:`UserError`) tensors that are not
    what SGLang's class builds for ``config``: one missing, of another shape, or one it would drop."""
    reduced = [name for name in REDUCED_VOCAB_TENSORS if name in checkpoint.weights]
    if reduced:
        raise NotServable(f"a reduced draft vocabulary ({', '.join(reduced)}): SGLang argmaxes the target's full head")
    served = dflash_sglang_weights(checkpoint.weights)
    check_tensors(expected_dflash_weights(config), served, checkpoint.folder / "model.safetensors", checkpoint.config_path)


def dflash_features(config: Mapping[str, Any]) -> list[str]:
    """What an exported ``config`` relies on: ``layer_types`` (attention per layer) and ``sliding_window``
    (sliding layers: SGLang counts the window per query, training before the anchor)."""
    used = ["dflash"]
    if config.get("layer_types"):
        used.append("layer_types")
    if "sliding_attention" in (config.get("layer_types") or []):
        used.append("sliding_window")
    return used


def trained_block_size(checkpoint_folder: Path) -> int | None:
    """The block size the training that wrote ``checkpoint_folder`` (``<train>/checkpoints/<epoch>``) ran with, from
    its record (``<train>/.made-from.json``, eagleflow's train step); None where no record says."""
    from eagleflow.reuse import RECORD

    record = checkpoint_folder.parent.parent / RECORD
    try:
        settings = json.loads(record.read_text(encoding="utf-8"))["inputs"]["settings"]
        return None if settings.get("block_size") is None else int(settings["block_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_trained_block_size(checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint whose config's ``block_size`` is not the one its weights were trained with (an edited
    config.json): SGLang would serve blocks of another size than the drafter learnt, and the export would replace
    a good one. Whatever ``--serve-with`` says, as the checkpoint's other self-checks.

    :raises UserError: naming the file, both sizes and the record.
    """
    from eagleflow.errors import UserError
    from eagleflow.reuse import RECORD

    trained = trained_block_size(checkpoint.folder)
    stated = checkpoint.config.get("block_size")
    if trained is not None and stated != trained:
        raise UserError(
            f"{checkpoint.config_path}: block_size {stated} is not the block size its weights were trained with "
            f"({trained}, recorded by the training in {checkpoint.folder.parent.parent / RECORD}); export the checkpoint "
            "as it was trained"
        )


def export_dflash_sglang(checkpoint: Checkpoint | Path, verifier: Path, target: Path) -> dict[str, Any]:
    """SGLang's DFLASH folder for ``checkpoint`` written to ``target``; returns what ``export.json`` says about it
    (``path`` relative to the drafter folder, ``target``'s parent).

    :raises NotServable: SGLang would not compute what was trained.
    """
    config, weights, verifier_config = write_sglang_folder(
        checkpoint, verifier, target, "DFlash", dflash_sglang_config, check_dflash_weights
    )
    return block_manifest(target, config, weights, verifier_config, DFLASH_ALGORITHM)


def write_sglang_folder(
    checkpoint: Checkpoint | Path,
    verifier: Path,
    target: Path,
    family: str,
    config_of: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]],
    check_weights: Callable[[Mapping[str, Any], Checkpoint], None],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The SGLang folder of a drafter on DFlash's backbone written to ``target``: ``config_of`` builds the config SGLang
    reads from the checkpoint's and the verifier's (refusing, :class:`NotServable`, what SGLang would serve
    otherwise), the rotary is checked against the trained one, ``check_weights`` checks the tensors against the
    config; returns that config, the weights written and the verifier's config."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from eagleflow.verifier import read_config
    from eagleflow.export import check_rotary
    from eagleflow.export import read_checkpoint

    if isinstance(checkpoint, Path):
        checkpoint = read_checkpoint(checkpoint)
    check_trained_block_size(checkpoint)
    verifier_config = read_config(verifier)
    with config_read_as(checkpoint.config_path, f"{family} config"):
        config = config_of(checkpoint.config, verifier_config)
        check_rotary(layer_config(checkpoint.config["transformer_layer_config"]), config, Qwen3Config, Qwen3RotaryEmbedding)
        check_weights(config, checkpoint)
    weights = dflash_sglang_weights(checkpoint.weights)
    write_drafter_folder(target, weights, config)
    return config, weights, verifier_config


def block_manifest(
    target: Path, config: Mapping[str, Any], weights: Mapping[str, Any], verifier_config: Mapping[str, Any], algorithm: str
) -> dict[str, Any]:
    """What ``export.json`` says about a DFlash-backbone folder: where it is, what it captures, its block."""
    from eagleflow.drafters.dflash import captured_layer_ids

    dflash = config["dflash_config"]
    return {
        "path": target.name,
        "algorithm": algorithm,
        "target_architecture": (verifier_config.get("architectures") or ["?"])[0],
        "target_layer_ids": dflash["target_layer_ids"],
        "captures_layers": captured_layer_ids(dflash["target_layer_ids"]),
        "block_size": dflash["block_size"],
        "num_steps": dflash["block_size"] - 1,
        "mask_token_id": dflash["mask_token_id"],
        "draft_window_size": None,  # the draft's sliding windows are its config's, not a flag
        "minimum_sglang": MINIMUM_SGLANG,
        "sglang_features": dflash_features(config),
        "weights": sorted(weights),
    }
