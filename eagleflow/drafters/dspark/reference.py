"""DSpark block drafting in the reference engine, computed as SGLang 0.5.23 computes it at temperature 0.

The drafter reads only the folder ``eagleflow export`` writes for ``--speculative-algorithm DSPARK``
(:mod:`eagleflow.drafters.dspark.sglang_export`), as SGLang's ``DSparkDraftModel`` (``srt/models/dspark.py``)
and its worker (``srt/speculative/dspark_components/dspark_worker_v2.py``, ``dspark_draft.py``) read it. The
backbone is DFlash's (:mod:`eagleflow.drafters.dflash.reference`: the context, the block's layers and
attention); what DSpark adds:

- **the block** ``[anchor, MASK × (γ − 1)]`` at positions ``p .. p + γ − 1``: every row drafts, the anchor's
  (the bonus token's) included (``sample_from_anchor``), so one pass proposes γ tokens;
- **the base logits** of row k, ``lm_head(h_k)`` with the target's head over the final-``norm`` state ``h_k``,
  in the head's dtype;
- **the Markov chain** (``dspark_draft.py`` ``_draft_step``, ``markov_sample.py``'s torch reference), one row
  after the other: ``prev_0`` is the anchor and ``prev_k`` the token drafted at row k − 1; the bias is
  ``markov_w2(markov_w1[prev])`` (vanilla), gated by ``sigmoid(gate_proj([h_k; w1[prev]]))`` (gated), or
  ``markov_w2(tanh(o))`` of a recurrent state started at zeros each round (rnn); row k's logits are
  ``f32(base_k) + f32(bias_k)`` rounded to ``promote(base dtype, markov_w1 dtype)``, and its token their
  argmax, the lowest index on a tie. (SGLang's fused kernel for one greedy request with a vanilla head adds in
  float32 without the rounding: it differs only on near-ties, and not at all in float32.)
- **the confidence head** (``DSparkConfidenceHead.predict``): row k's raw logit is
  ``proj(f32([h_k; w1[prev_k]]))`` with the same ``prev_k``; SGLang computes it only outside its default
  ``static`` verify mode and turns it into ``sigmoid(raw / T_k)`` with the calibration's per-position
  temperatures.

Greedy decoding (:class:`DSparkDecoder`), SGLang's default ``static`` mode: the target verifies the whole
window ``[anchor, d_0 … d_{γ−1}]`` (γ + 1 rows), ``d_k`` is accepted while it equals the target's choice at
row k, the target's choice after the last accepted draft is the next anchor, and the target's states of the
anchor and the accepted drafts enter the draft context. The tokens are greedy decoding's; SGLang's accept
length is the tokens emitted per verify (the accepted drafts and the bonus token), its accept rate the
accepted drafts over γ per verify.

**Calibration data** (``--speculative-dspark-confidence-sts-path``): set :attr:`DSparkDecoder.sts_recorder`
to a :class:`eagleflow.drafters.dspark.calibration.StsRecorder` (or anything with its ``record(confidence_raw,
num_correct_drafts)``): after each verify it gets the round's raw confidence logits ``[γ]`` (float32, before
any temperature) and the number of drafts the target accepted, the full window's greedy count, as SGLang's
collector records them (``dspark_observability.py``: one row of its ``StsDataRecorder.record``'s batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from eagleflow.drafters.dflash.reference import DFlashCache, DFlashDecoder, DFlashDrafter, load_drafter
from eagleflow.errors import UserError

if TYPE_CHECKING:
    from eagleflow.engine import ReferenceEngineConfig

# Keys of the bundled DSpark format (a draft inside the target's checkpoint, DeepSeek-V4's), which SGLang reads
# before the dense draft's own; the reference drafter reads the dense format only.
BUNDLED_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_markov_head_type", "dspark_noise_token_id",
                "dspark_target_layer_ids", "dspark_config")


class ConfidenceRecorder(Protocol):
    """What the decoder hands each verify's confidence to (:class:`eagleflow.drafters.dspark.calibration.StsRecorder`)."""

    def record(self, confidence_raw: torch.Tensor, num_correct_drafts: int) -> Any: ...


@dataclass(frozen=True)
class DSparkBlock:
    """One round's drafting: the tokens, each row's logits after its Markov step (float ``[γ, V]``), the rows'
    final-``norm`` states ``[γ, H]`` and each row's previous token (the anchor, then the tokens drafted)."""

    tokens: list[int]
    logits: torch.Tensor
    hidden: torch.Tensor
    previous: list[int]


class DSparkDrafter(DFlashDrafter):
    """The draft model of an exported SGLang DSPARK folder: DFlash's backbone, the Markov head, the confidence head.

    :param folder: the ``drafter/sglang`` folder (config.json, model.safetensors).
    :param embed_tokens: the target's token embedding; ``lm_head``: the target's head; ``dtype``: the target's.
    """

    def _read_config(self, path: Path) -> None:
        super()._read_config(path)
        c = self.config
        bundled = [key for key in BUNDLED_KEYS if c.get(key) is not None]
        if bundled:
            raise UserError(f"{path}: {', '.join(bundled)}: a bundled DSpark draft, which the reference drafter does not read")
        # build_markov_head and build_confidence_head read the top level of the config, and nothing else.
        self.markov_rank = int(c.get("markov_rank") or 0)
        if self.markov_rank <= 0:
            raise UserError(f"{path}: markov_rank {self.markov_rank}: SGLang's DSPARK requires a Markov head (markov_rank > 0)")
        head_type = c.get("markov_head_type")
        if head_type is None:
            raise UserError(f"{path}: no markov_head_type: SGLang's DSPARK refuses a Markov head without its type")
        self.markov_head_type = str(head_type).lower()
        if self.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise UserError(f"{path}: markov_head_type {head_type!r} is not one SGLang serves (vanilla, gated, rnn)")
        if not c.get("sample_from_anchor", True):
            raise UserError(f"{path}: sample_from_anchor False: the reference drafter computes DSpark's anchor-slot block only")
        self.confidence_with_markov = bool(c.get("confidence_head_with_markov", self.markov_rank > 0))

    def _check_weights(self, folder: Path) -> None:
        """DFlash's backbone, then the heads: SGLang's loader refuses a Markov (or confidence) tensor it does not build or
        of another shape, and outside its static mode a missing confidence tensor; a missing Markov one it leaves
        uninitialised. Each is refused by name here."""
        from eagleflow.drafters.dspark.sglang_export import head_tensors
        from eagleflow.export import tensor_problems

        super()._check_weights(folder)
        heads = {name: t for name, t in self.weights.items() if name.startswith(("markov_head.", "confidence_head."))}
        expected = head_tensors(self.hidden, int(self.config["vocab_size"]), int(self.config["vocab_size"]), self.config)
        problems = tensor_problems(expected, heads, "its config.json")
        if problems:
            raise UserError(f"{folder / 'model.safetensors'}: {'; '.join(problems)}: SGLang's DSPARK refuses these heads, or serves them uninitialised")

    def _bias(self, prev: int, hidden: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One row's Markov bias ``[V]`` from the previous token and the row's state ``hidden`` (``step_bias``), and
        the recurrent state the next row reads (rnn)."""
        w = self.weights
        emb = w["markov_head.markov_w1.weight"][prev]
        if self.markov_head_type == "vanilla":
            return F.linear(emb, w["markov_head.markov_w2.weight"]), state
        if self.markov_head_type == "gated":
            gate = torch.sigmoid(F.linear(torch.cat([hidden, emb]), w["markov_head.gate_proj.weight"], w["markov_head.gate_proj.bias"]))
            return F.linear(gate.to(emb.dtype) * emb, w["markov_head.markov_w2.weight"]), state
        assert state is not None
        z = torch.cat([state, emb, hidden])
        gate_raw, candidate_raw, output_raw = F.linear(z, w["markov_head.joint_proj.weight"], w["markov_head.joint_proj.bias"]).chunk(3)
        gate = torch.sigmoid(gate_raw)
        return F.linear(torch.tanh(output_raw), w["markov_head.markov_w2.weight"]), gate * state + (1.0 - gate) * torch.tanh(candidate_raw)

    def _state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The recurrent state a round starts from: zeros for rnn (``init_state``), none otherwise."""
        return hidden.new_zeros(self.markov_rank) if self.markov_head_type == "rnn" else None

    def _step(self, base: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Row logits: ``f32(base) + f32(bias)`` rounded to the step dtype (``MarkovSampleStep``), as float."""
        step_dtype = torch.promote_types(base.dtype, self.weights["markov_head.markov_w1.weight"].dtype)
        return (base.float() + bias.float()).to(step_dtype).float()

    @torch.no_grad()
    def markov_logits(self, hidden: torch.Tensor, previous: Sequence[int]) -> torch.Tensor:
        """``[γ, V]`` row logits of a block whose rows' previous tokens are ``previous`` (given, as in training's
        teacher forcing: the dataset's tokens), from the rows' final-``norm`` states ``hidden``."""
        base, state, rows = self.head_logits(hidden), self._state(hidden), []
        for k, prev in enumerate(previous):
            bias, state = self._bias(int(prev), hidden[k], state)
            rows.append(self._step(base[k], bias))
        return torch.stack(rows)

    @torch.no_grad()
    def draft_block(self, anchor: int, position: int, gamma: int, cache: DFlashCache) -> DSparkBlock:
        """One round: the block ``[anchor, MASK × (γ − 1)]`` at ``position ..`` in one pass, then the Markov chain row by
        row, each row's previous token the one drafted before it (the anchor for row 0); the cache is unchanged."""
        hidden = self.block_hidden(anchor, position, gamma, cache)
        base, state = self.head_logits(hidden), self._state(hidden)
        previous, tokens, rows = [anchor], [], []
        for k in range(gamma):
            bias, state = self._bias(previous[-1], hidden[k], state)
            rows.append(self._step(base[k], bias))
            tokens.append(int(torch.argmax(rows[-1])))  # the first index of the largest value
            previous.append(tokens[-1])
        return DSparkBlock(tokens, torch.stack(rows), hidden, previous[:-1])

    @torch.no_grad()
    def confidence_logits(self, hidden: torch.Tensor, previous: Sequence[int]) -> torch.Tensor:
        """``[γ]`` raw confidence logits (float32) of the rows' states and previous tokens (``DSparkConfidenceHead``)."""
        w = self.weights
        features = hidden
        if self.confidence_with_markov:
            emb = w["markov_head.markov_w1.weight"][torch.tensor(list(previous), device=hidden.device)]
            features = torch.cat([hidden, emb.to(hidden.dtype)], dim=-1)
        # SGLang's proj is float32 whatever the model's dtype.
        return F.linear(features.float(), w["confidence_head.proj.weight"].float(), w["confidence_head.proj.bias"].float()).squeeze(-1)


class DSparkDecoder(DFlashDecoder):
    """Greedy DSpark drafting and verification (SGLang's static mode) for one target model and one DSpark drafter.

    :param target: the ``transformers`` causal LM.
    :param drafter: the exported drafter, computed as SGLang does.
    :param capture: returns a context manager recording the target's aux states (``aux()``: ``[T, K * H]``).
    :param gamma: tokens drafted per round (``--speculative-dspark-block-size``); γ + 1 are verified.

    :attr:`sts_recorder`: None, or what records each verify's raw confidence logits and accepted drafts for the
    calibration (see the module's docstring).
    """

    def __init__(self, target: Any, drafter: DSparkDrafter, capture: Any, gamma: int) -> None:
        super().__init__(target, drafter, capture, gamma + 1)  # the verify window: the anchor and the γ drafts
        self.drafter: DSparkDrafter = drafter
        self.gamma = gamma
        self.sts_recorder: ConfidenceRecorder | None = None
        self._confidence: torch.Tensor | None = None

    def draft(self, bonus: int, position: int, cache: DFlashCache) -> list[int]:
        """One round's γ drafts after ``bonus`` (the anchor) at ``position``: the block, then the Markov chain."""
        block = self.drafter.draft_block(bonus, position, self.gamma, cache)
        if self.sts_recorder is not None:
            self._confidence = self.drafter.confidence_logits(block.hidden, block.previous)
        return block.tokens

    def verified(self, accepted: int) -> None:
        """Hand the round's raw confidence and its accepted drafts to :attr:`sts_recorder`, as SGLang's collector does."""
        if self.sts_recorder is not None and self._confidence is not None:
            self.sts_recorder.record(self._confidence.cpu(), accepted)
            self._confidence = None


def dspark_decoder(model: Any, config: ReferenceEngineConfig) -> DSparkDecoder:
    """The DSPARK decoder of ``--speculative-draft-model-path`` for ``model``: γ from ``--speculative-dspark-block-size``,
    else ``--speculative-num-draft-tokens`` − 1, else the export's ``block_size`` (SGLang's order); recording each
    verify's confidence where SGLang's collector variable names a file, as SGLang's engine does."""
    import os

    from eagleflow.drafters.dspark.calibration import COLLECT_ENV, StsRecorder

    window = config.speculative_num_draft_tokens
    gamma = config.speculative_dspark_block_size or (window - 1 if window else None)
    decoder = load_dspark_decoder(model, config.speculative_draft_model_path, gamma)
    if recording := os.environ.get(COLLECT_ENV):
        # SGLang's calibration collector (SGLANG_DSPARK_STS_COLLECT_PATH): every verify's raw confidence and accepted
        # drafts, for the engine's life (one whole flushed line each; eagleflow's JSONL, which calibration.py reads).
        decoder.sts_recorder = StsRecorder(recording, decoder.gamma)
    return decoder


def load_dspark_decoder(model: Any, folder: Path | None, gamma: int | None) -> DSparkDecoder:
    """The DSpark decoder of the exported SGLang drafter ``folder`` for ``model``, capturing what SGLang's target
    captures for its ``target_layer_ids``; ``gamma`` None: the export's ``dflash_config.block_size``."""
    drafter, capture = load_drafter(model, folder, DSparkDrafter)
    gamma = int(gamma or drafter.block_size)
    if gamma < 1:
        raise UserError(f"DSPARK block size {gamma}: a round drafts at least one token")
    return DSparkDecoder(model, drafter, capture, gamma)
