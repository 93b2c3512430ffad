"""DSpark checkpoints built by speculators' own class, and what speculators computes with them.

:func:`random_dspark_checkpoint` is speculators' ``DSparkDraftModel`` of a verifier with every saved weight
random (``training_data.random_dflash_checkpoint``), its Markov head scaled up so that its bias decides drafted
tokens (a head left at speculators' ``std=0.01`` initialisation would leave every argmax to the backbone and
hide a chain computed wrong). :func:`speculators_forward` runs speculators' own training ``forward`` over the
verifier's aux states and returns the logits and confidence logits it hands to its loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from training_data import random_dflash_checkpoint

MARKOV_SCALE = 8.0  # random weights of std 0.8: the bias then moves logits by about as much as the backbone's


def random_dspark_checkpoint(
    verifier: Path, out: Path, aux_layer_ids: list[int], head_type: str = "vanilla", rank: int = 16, **settings: Any
) -> Path:
    """speculators' DSpark draft for ``verifier`` (full vocabulary, block ``block_size``), every saved weight random."""
    random_dflash_checkpoint(
        verifier, out, aux_layer_ids, dspark={"markov_rank": rank, "markov_head_type": head_type}, **settings
    )
    weights = load_file(str(out / "model.safetensors"))
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        weights[name] = weights[name] * MARKOV_SCALE
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@dataclass(frozen=True)
class SpeculatorsBlocks:
    """speculators' blocks with every position ``< T − γ`` an anchor: the model, its base (pre-Markov) logits and
    final-norm states ``[anchors, γ, …]``, and what its ``forward`` hands to its loss: the logits with the Markov
    bias of the dataset's tokens and the confidence logits ``[anchors, γ]``."""

    model: Any
    base: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


def speculators_forward(checkpoint: Path, verifier: Any, ids: torch.Tensor, attn: str = "sdpa") -> SpeculatorsBlocks:
    """speculators' ``DSparkDraftModel`` of ``checkpoint`` over the verifier's aux states of ``ids`` (captured at the
    trained layer ids), its own ``forward`` run with its loss replaced by a recorder."""
    import speculators.models.dspark.core as core
    from speculators.models.dspark import DSparkDraftModel

    from eagleflow.engine.capture import AuxStateCapture

    config = DSparkDraftModel.config_class.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = attn
    model = DSparkDraftModel.from_pretrained(str(checkpoint), config=config).float().eval()
    with torch.no_grad(), AuxStateCapture(verifier, config.aux_hidden_state_layer_ids) as hooks:
        verifier(input_ids=ids[None])
    aux, length, gamma = hooks.aux(), len(ids), model.block_size
    anchors = length - gamma
    inputs = (aux[None], ids[None], torch.ones(1, length), torch.zeros(1, length, config.transformer_layer_config.hidden_size),
              torch.zeros(1, length, dtype=torch.long))
    seen: dict[str, torch.Tensor] = {}

    def loss(logits: torch.Tensor, targets: torch.Tensor, confidence_logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.update(logits=logits, confidence=confidence_logits)
        return logits.sum() * 0, {}

    with torch.no_grad(), mock.patch.object(core, "compute_metrics", loss):
        model(*inputs, max_anchors=anchors)
        hidden, base, *_ = model._backbone_forward(*inputs, max_anchors=anchors)
    shape = (anchors, gamma, -1)
    return SpeculatorsBlocks(
        model, base[0].view(shape), hidden[0].view(shape), seen["logits"][0].view(shape), seen["confidence"][0].view(anchors, gamma)
    )


def speculators_chain(model: Any, base: torch.Tensor, hidden: torch.Tensor, previous: list[int]) -> torch.Tensor:
    """speculators' logits ``[γ, V]`` of one block along a chain of previous tokens (its Markov head's ``block_bias``
    over the first k + 1 of them for row k: the rnn head's state runs along the block)."""
    rows = []
    with torch.no_grad():
        for k in range(len(previous)):
            bias = model.markov_head.block_bias(
                prev_token_ids=torch.tensor([previous[: k + 1]]), hidden_states=hidden[None, : k + 1]
            )
            rows.append(base[k] + bias[0, k])
    return torch.stack(rows)
