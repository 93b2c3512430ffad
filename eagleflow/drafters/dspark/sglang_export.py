"""SGLang's DSPARK draft model folder: the one place that knows what SGLang 0.5.23 reads from it.

Read from SGLang 0.5.23 (``srt/models/dspark.py`` ``DSparkDraftModel`` on ``srt/models/dflash.py``
``DFlashDraftModel``; ``srt/speculative/dspark_components/dspark_config.py`` ``parse_dspark_draft_config``
on ``dflash_utils.py`` ``parse_dflash_draft_config``). The backbone is DFlash's, and so is its export
(:mod:`eagleflow.drafters.dflash.sglang_export`: the flat Qwen3 config, ``dflash_config``, the tensors and
every refusal of a backbone SGLang would serve otherwise); what DSpark adds:

- ``architectures``: ``DSparkDraftModel`` (an ``EntryClass`` of ``models/dspark.py``; ``Qwen3DSparkModel``,
  DeepSpec's tag, is the same class);
- ``dflash_config.block_size`` is γ, the tokens **drafted** per round: the block ``[anchor, MASK × (γ − 1)]``
  drafts from every slot, the anchor's included (``sample_from_anchor``), so γ + 1 are verified;
- at the **top level**, where ``build_markov_head`` and ``build_confidence_head`` read them
  (``getattr(config, ...)``; ``parse_dspark_draft_config`` falls back to the top level too):
  ``markov_rank`` (> 0, else SGLang refuses), ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov`` (its default is ``markov_rank > 0``, not speculators' flag), and
  ``sample_from_anchor`` (read by ``get_dspark_sample_from_anchor``; its default True is written out);
- the tensors: DFlash's, plus ``markov_head.markov_w1.weight`` and ``markov_w2.weight``
  (``[vocab_size, markov_rank]`` each: SGLang sizes both by the target's vocabulary), ``gate_proj`` (gated)
  or ``joint_proj`` (rnn), and ``confidence_head.proj`` (``[1, hidden (+ markov_rank)]``, built outside the
  default ``static`` verify mode, where a missing one is refused, and skipped in it). A Markov tensor SGLang
  does not build is refused by its loader; one it builds and the file lacks stays uninitialised, silently,
  as every backbone tensor would: :func:`expected_dspark_weights` lists them all, each with its shape.

Refused, as SGLang would serve them as another function or not at all: ``sample_from_anchor`` False (every
slot would be served the token after the one it learnt), no Markov head (``markov_rank`` 0), no confidence
head (SGLang builds one whatever ``enable_confidence_head`` says, outside static mode), and everything
DFlash's export refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleflow.drafters.dflash.sglang_export import (
    CHECKPOINT as DFLASH_CHECKPOINT, REDUCED_VOCAB_TENSORS, block_manifest, checkpoint_dflash_weights, dflash_sglang_config,
    dflash_sglang_weights, expected_dflash_weights, write_sglang_folder,
)
from eagleflow.export import CheckpointLayout, Expected, LayerShape, NotServable, check_tensors, layer_config

if TYPE_CHECKING:
    from eagleflow.export import Checkpoint

DSPARK_ARCHITECTURE = "DSparkDraftModel"
DSPARK_ALGORITHM = "DSPARK"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # SUPPORTED_DSPARK_MARKOV_HEAD_TYPES
# The settings SGLang reads at the top level of the folder's config.json (build_markov_head, build_confidence_head).
DSPARK_SETTINGS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor")


def dspark_sglang_config(checkpoint_config: Mapping[str, Any], verifier_config: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``config.json`` for a speculators DSpark checkpoint config and the verifier's ``config.json``.

    :raises NotServable: what SGLang would serve as another function than the one trained, or not at all.
    """
    if checkpoint_config.get("speculators_model_type") != "dspark":
        raise NotServable(f"not a DSpark checkpoint (speculators_model_type {checkpoint_config.get('speculators_model_type')!r})")
    if not checkpoint_config.get("sample_from_anchor", True):
        raise NotServable(
            "trained with sample_from_anchor False: SGLang's DSPARK drafts from the anchor (bonus token) slot too, so "
            "every slot would be served the token after the one it was trained for"
        )
    rank, head_type = int(checkpoint_config.get("markov_rank") or 0), str(checkpoint_config.get("markov_head_type"))
    if rank <= 0:
        raise NotServable(
            f"markov_rank {rank}: SGLang's DSPARK requires the Markov head (markov_rank > 0), and a block drafted from "
            "the anchor slot without it is not what its DFLASH serves either"
        )
    if head_type not in MARKOV_HEAD_TYPES:
        raise NotServable(f"markov_head_type {head_type!r}: SGLang 0.5.23 serves {', '.join(MARKOV_HEAD_TYPES)}")
    if not checkpoint_config.get("enable_confidence_head", True):
        raise NotServable(
            "trained without the confidence head (enable_confidence_head False): outside its default static verify mode "
            "SGLang builds the head whatever the config says and refuses a folder without its weights"
        )
    # The backbone's rules are DFlash's. Its checks see the block SGLang verifies: γ + 1 tokens, the bonus token and
    # γ drafts, each drafted from a slot of its own (the anchor's rule, DFlash's only difference, is checked above).
    gamma = int(checkpoint_config["block_size"])
    backbone = {**checkpoint_config, "speculators_model_type": "dflash", "sample_from_anchor": False, "block_size": gamma + 1}
    config = dflash_sglang_config(backbone, verifier_config)
    config["dflash_config"]["block_size"] = gamma
    config.update(
        architectures=[DSPARK_ARCHITECTURE],
        markov_rank=rank,
        markov_head_type=head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=bool(checkpoint_config.get("confidence_head_with_markov", True)),
        sample_from_anchor=True,
    )
    return config


def head_tensors(hidden: int, vocab: int, draft_vocab: int, settings: Mapping[str, Any]) -> dict[str, Expected]:
    """The Markov head's and the confidence head's tensors for DSpark ``settings`` (``markov_rank``,
    ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``): ``markov_w1`` is indexed by
    the previous token (``vocab``), ``markov_w2`` biases the draft's logits (``draft_vocab``)."""
    rank, head_type = int(settings.get("markov_rank") or 0), settings.get("markov_head_type")
    out: dict[str, Expected] = {}
    if rank > 0:
        why = f"markov_rank {rank}"
        out["markov_head.markov_w1.weight"] = Expected((vocab, rank), f"vocab_size {vocab}, {why}")
        out["markov_head.markov_w2.weight"] = Expected((draft_vocab, rank), f"vocabulary {draft_vocab}, {why}")
        gated, rnn = head_type == "gated", head_type == "rnn"
        kind = f"markov_head_type {head_type!r}"
        for name, rows, columns, built in (("gate_proj", rank, hidden + rank, gated), ("joint_proj", 3 * rank, 2 * rank + hidden, rnn)):
            out[f"markov_head.{name}.weight"] = Expected((rows, columns) if built else None, f"{kind}, {why}, hidden_size {hidden}")
            out[f"markov_head.{name}.bias"] = Expected((rows,) if built else None, f"{kind}, {why}")
    if settings.get("enable_confidence_head", True):
        with_markov = bool(settings.get("confidence_head_with_markov", rank > 0))
        width = hidden + (rank if with_markov else 0)
        why = f"confidence_head_with_markov {with_markov}, hidden_size {hidden}" + (f", markov_rank {rank}" if with_markov else "")
        out["confidence_head.proj.weight"] = Expected((1, width), why)
        out["confidence_head.proj.bias"] = Expected((1,), "the confidence head")
    return out


def expected_dspark_weights(config: Mapping[str, Any]) -> dict[str, Expected]:
    """Every tensor SGLang's ``DSparkDraftModel`` builds for an exported ``config`` (the confidence head's
    outside the static verify mode), with the shape the config gives it."""
    d = LayerShape.of(config)
    return {**expected_dflash_weights(config), **head_tensors(d.hidden, d.vocab, d.vocab, config)}


def checkpoint_dspark_weights(checkpoint_config: Mapping[str, Any]) -> dict[str, Expected]:
    """Every tensor speculators' ``DSparkDraftModel`` saves for ``checkpoint_config``
    (``speculators/models/dspark/``): DFlash's and its two heads'."""
    d = LayerShape.of(layer_config(checkpoint_config["transformer_layer_config"]))
    heads = head_tensors(d.hidden, d.vocab, int(checkpoint_config["draft_vocab_size"]), checkpoint_config)
    return {**checkpoint_dflash_weights(checkpoint_config), **heads}


# What the export reads from a DSpark checkpoint and the tensors it holds (eagleflow.export.read_checkpoint).
CHECKPOINT = CheckpointLayout(
    {
        **DFLASH_CHECKPOINT.config_keys,
        "markov_rank": "the rank of the Markov head",
        "markov_head_type": "the kind of Markov head",
    },
    checkpoint_dspark_weights,
)


def check_dspark_weights(config: Mapping[str, Any], checkpoint: Checkpoint) -> None:
    """Refuse a reduced vocabulary (:class:`NotServable`), and (:class:`UserError`) tensors that are not what
    SGLang's class builds for ``config``: one missing, of another shape, or one it would drop or refuse."""
    reduced = [name for name in REDUCED_VOCAB_TENSORS if name in checkpoint.weights]
    if reduced:
        raise NotServable(f"a reduced draft vocabulary ({', '.join(reduced)}): SGLang argmaxes the target's full head")
    served = dflash_sglang_weights(checkpoint.weights)
    check_tensors(expected_dspark_weights(config), served, checkpoint.folder / "model.safetensors", checkpoint.config_path)


def export_dspark_sglang(checkpoint: Checkpoint | Path, verifier: Path, target: Path) -> dict[str, Any]:
    """SGLang's DSPARK folder for ``checkpoint`` written to ``target``; returns what ``export.json`` says about it
    (``path`` relative to the drafter folder, ``target``'s parent). Its ``block_size`` is what
    :class:`~eagleflow.export.ServedDrafter` reads as the tokens verified per round (γ + 1,
    ``--speculative-num-draft-tokens``), ``num_steps`` and ``dspark_block_size`` the tokens drafted (γ).

    :raises NotServable: SGLang would not compute what was trained.
    """
    config, weights, verifier_config = write_sglang_folder(
        checkpoint, verifier, target, "DSpark", dspark_sglang_config, check_dspark_weights
    )
    manifest, gamma = block_manifest(target, config, weights, verifier_config, DSPARK_ALGORITHM), config["dflash_config"]["block_size"]
    manifest.update(
        block_size=gamma + 1,  # the verify window: the bonus token and the γ drafts
        dspark_block_size=gamma,
        num_steps=gamma,
        sglang_features=["dspark", *manifest["sglang_features"][1:]],
        **{key: config[key] for key in ("markov_rank", "markov_head_type", "confidence_head_with_markov")},
    )
    return manifest
