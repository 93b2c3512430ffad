"""DFlash block drafting in the reference engine, computed as SGLang 0.5.23 computes it.

The drafter reads only the folder ``eagleflow export`` writes for ``--speculative-algorithm DFLASH``
(its ``config.json`` and ``model.safetensors``), as SGLang's ``DFlashDraftModel``
(``srt/models/dflash.py``) and its worker (``srt/speculative/dflash_worker_v2.py``) read it; what they
compute with it is :mod:`eagleflow.drafters.dflash.sglang_rules`'s. The config is read as SGLang holds it, through
transformers' class of its ``model_type`` (what the file leaves out takes that class's defaults), and
a weight its class builds that the file lacks is refused by name (SGLang would leave it uninitialised):

- **context**: each committed token's captured aux states ``[K * H]`` pass ``fc`` and ``hidden_norm``;
  every layer turns that one state into its keys (``k_proj``, ``k_norm``, rotary at the token's
  position) and values (``v_proj``) with no input norm (``kv_proj_only``), written once into the draft
  cache;
- **a block**: ``[bonus, MASK × (B − 1)]`` at positions ``p .. p + B − 1``, embedded with the *target's*
  embedding, passes Qwen3 layers (input norm, q/k/v with ``q_norm``/``k_norm`` and rotary, GQA,
  biases when ``attention_bias``, SiLU MLP) attending to the context before ``p`` and to the block as
  :func:`~eagleflow.sglang_rules.layer_attention` says per layer (both ways, or causal with
  ``sliding_window − 1`` keys to the left of each query); ``norm(hidden)`` through the *target's*
  ``lm_head`` gives the logits, whose argmax at slots 1 .. B − 1 are the drafts. The block is never
  cached: the verified tokens enter the context from the target's own aux states.

Greedy decoding (:class:`DFlashDecoder`): the target prefills the prompt and picks the bonus token; a
round drafts one block after it, the target verifies ``[bonus, d1 … d_{B−1}]`` in one pass, ``d_k`` is
accepted while it equals the target's choice at the slot before it, and the target's choice after the
last accepted draft is the next bonus. The tokens are greedy decoding's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from eagleflow.verifier import rms_norm
from eagleflow.engine.reference import SpecStats, SpeculativeDecoder, crop_cache
from eagleflow.errors import UserError, excerpt
from eagleflow.drafters.dflash.sglang_rules import captured_layer_ids, layer_attention
from eagleflow.sglang_rules import BlockRuleError, UnsupportedRope, sglang_rotary

if TYPE_CHECKING:
    from eagleflow.engine import ReferenceEngineConfig

DEFAULT_BLOCK_SIZE = 16  # DFlashDraftModel.resolve_block_size(default=16) for a config without one
# dflash_config settings of other DFlash variants that SGLang serves and the reference drafter does not compute.
OTHER_VARIANTS = ("conv_kernel_size", "selector_rank", "projector_type", "attention_sink_bias", "attention_value_scale")


def as_sglang_reads(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` as SGLang holds it: through transformers' config class of its ``model_type``
    (``AutoConfig``), which fills in what the file leaves out (``layer_types``, ``rope_parameters``) and
    drops ``sliding_window`` without ``use_sliding_window``; ``dflash_config`` rides along."""
    from transformers import AutoConfig

    settings = dict(config)
    return AutoConfig.for_model(settings.pop("model_type", "qwen3"), **settings).to_dict()


@dataclass
class DFlashCache:
    """Each draft layer's keys ``[kv_heads, T, head_dim]`` and values of the context tokens, and their positions."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.positions is None else int(self.positions.numel())


class DFlashDrafter:
    """The draft model of an exported SGLang DFLASH folder.

    :param folder: the ``drafter/sglang`` folder (config.json, model.safetensors).
    :param embed_tokens: the target's token embedding (SGLang embeds the block with it).
    :param lm_head: the target's head (SGLang argmaxes it over the draft's normed states).
    :param dtype: compute dtype (the target's).
    """

    def __init__(
        self, folder: str | Path, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        config_path = folder / "config.json"
        try:
            self.config: dict[str, Any] = as_sglang_reads(json.loads(config_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"{config_path}: cannot load the drafter's config ({excerpt(exc)})") from exc
        try:
            weights = load_file(str(folder / "model.safetensors"), device=str(device))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{folder / 'model.safetensors'}: cannot load the drafter's weights ({excerpt(exc)})") from exc
        # SGLang's load_weights adds or strips "model." as its parameters need.
        self.weights = {k.removeprefix("model."): v.to(dtype) for k, v in weights.items()}
        self.embed_tokens, self.lm_head, self.dtype = embed_tokens, lm_head, dtype
        try:
            self._read_config(config_path)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{config_path}: not a DFLASH draft config SGLang serves ({type(exc).__name__}: {excerpt(exc)})") from exc
        self._check_weights(folder)

    def _read_config(self, path: Path) -> None:
        c = self.config
        dflash = dict(c.get("dflash_config") or {})
        other = [key for key in OTHER_VARIANTS if dflash.get(key)] + (["use_gemma_norm"] if c.get("use_gemma_norm") else [])
        if other or c.get("has_embed_tokens"):
            raise UserError(f"{path}: {', '.join(other) or 'has_embed_tokens'}: a DFlash variant the reference drafter does not compute")
        self.hidden = int(c["hidden_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.heads)
        self.layers = int(c["num_hidden_layers"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.attention_bias = bool(c.get("attention_bias", False))
        if c.get("hidden_act", "silu") != "silu":
            raise UserError(f"{path}: hidden_act {c.get('hidden_act')!r}: the reference drafter computes SGLang's silu MLP only")
        target_layer_ids = dflash.get("target_layer_ids", c.get("target_layer_ids"))
        if not target_layer_ids:
            raise UserError(f"{path}: no dflash_config.target_layer_ids: SGLang would pick its own layers (build_target_layer_ids)")
        self.target_layer_ids = [int(k) for k in target_layer_ids]
        mask = dflash.get("mask_token_id", c.get("mask_token_id"))
        if mask is None:
            raise UserError(f"{path}: no dflash_config.mask_token_id (SGLang would resolve it from the tokenizer; export writes it)")
        self.mask_token_id = int(mask)
        self.block_size = int(dflash.get("block_size", c.get("block_size")) or DEFAULT_BLOCK_SIZE)
        try:
            self.attention = layer_attention(c, self.layers)
            rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
            if "rope_dim" in rope:
                raise UnsupportedRope("rope_dim (a rotary narrower than the head) is not computed by the reference drafter")
            self.rotary = sglang_rotary(c, self.head_dim)
        except (BlockRuleError, UnsupportedRope) as exc:
            raise UserError(f"{path}: {exc}") from exc

    def _check_weights(self, folder: Path) -> None:
        """Every tensor SGLang's class builds must be in the folder: it never says one was not loaded."""
        from eagleflow.drafters.dflash import expected_dflash_weights

        missing = [name for name in expected_dflash_weights(self.config) if name not in self.weights]
        if missing:
            raise UserError(f"{folder / 'model.safetensors'}: no {', '.join(missing)}, which its config.json makes SGLang build")
        fc = tuple(self.weights["fc.weight"].shape)
        if fc != (self.hidden, len(self.target_layer_ids) * self.hidden):
            raise UserError(
                f"{folder / 'model.safetensors'}: fc.weight is {list(fc)}, not [{self.hidden}, {len(self.target_layer_ids)} x "
                f"{self.hidden}] for the {len(self.target_layer_ids)} target_layer_ids (SGLang refuses it)"
            )

    def new_cache(self) -> DFlashCache:
        return DFlashCache(keys=[None] * self.layers, values=[None] * self.layers)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[f"{name}.weight"], self.weights[f"{name}.bias"] if self.attention_bias else None)

    def _heads(self, x: torch.Tensor, count: int, norm: str | None) -> torch.Tensor:
        """``[T, count * head_dim]`` -> ``[count, T, head_dim]``, each head RMS-normed by ``norm`` (q_norm, k_norm)."""
        x = x.view(x.shape[0], count, self.head_dim)
        if norm is not None:
            x = rms_norm(x, self.weights[norm], self.eps)
        return x.transpose(0, 1)

    @torch.no_grad()
    def add_context(self, aux: torch.Tensor, positions: torch.Tensor, cache: DFlashCache) -> None:
        """Write the keys and values of committed tokens (their target aux states ``[T, K * H]`` at ``positions``)."""
        ctx = rms_norm(F.linear(aux.to(self.dtype), self.weights["fc.weight"]), self.weights["hidden_norm.weight"], self.eps)
        positions = positions.to(ctx.device)
        for layer in range(self.layers):
            p = f"layers.{layer}.self_attn."
            k = self._heads(self._linear(ctx, p + "k_proj"), self.kv_heads, p + "k_norm.weight")
            k = self.rotary.apply(k, positions)
            v = self._heads(self._linear(ctx, p + "v_proj"), self.kv_heads, None)
            old_k, old_v = cache.keys[layer], cache.values[layer]
            cache.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=1)
            cache.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=1)
        cache.positions = positions if cache.positions is None else torch.cat([cache.positions, positions])

    @torch.no_grad()
    def block_logits(self, bonus: int, position: int, block_size: int, cache: DFlashCache) -> torch.Tensor:
        """``[B, V]`` float logits of the block ``[bonus, MASK × (B − 1)]`` at ``position ..``; the cache is unchanged."""
        return self.head_logits(self.block_hidden(bonus, position, block_size, cache)).float()

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The target's ``lm_head`` over the draft's normed states, in the head's dtype (SGLang's matmul)."""
        return self.lm_head(normed.to(self.lm_head.weight.dtype))

    @torch.no_grad()
    def block_hidden(self, bonus: int, position: int, block_size: int, cache: DFlashCache) -> torch.Tensor:
        """``[B, H]`` final-``norm`` states of the block ``[bonus, MASK × (B − 1)]`` at ``position ..`` (what SGLang
        projects through the target's head); the cache is unchanged."""
        device = self.weights["fc.weight"].device
        ids = torch.tensor([bonus] + [self.mask_token_id] * (block_size - 1), device=device)
        positions = torch.arange(position, position + block_size, device=device)
        hidden = self.embed_tokens(ids).to(self.dtype)
        w = self.weights
        for layer in range(self.layers):
            p = f"layers.{layer}."
            x = rms_norm(hidden, w[p + "input_layernorm.weight"], self.eps)
            hidden = hidden + self._attention(layer, x, positions, cache)
            x = rms_norm(hidden, w[p + "post_attention_layernorm.weight"], self.eps)
            gate, up = F.linear(x, w[p + "mlp.gate_proj.weight"]), F.linear(x, w[p + "mlp.up_proj.weight"])
            hidden = hidden + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return rms_norm(hidden, w["norm.weight"], self.eps)

    def _attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor, cache: DFlashCache) -> torch.Tensor:
        p = f"layers.{layer}.self_attn."
        q = self.rotary.apply(self._heads(self._linear(x, p + "q_proj"), self.heads, p + "q_norm.weight"), positions)
        k = self.rotary.apply(self._heads(self._linear(x, p + "k_proj"), self.kv_heads, p + "k_norm.weight"), positions)
        v = self._heads(self._linear(x, p + "v_proj"), self.kv_heads, None)
        rule = self.attention[layer]
        # Block keys: both ways, or causal; context keys: those before the block.
        allowed = torch.ones(len(positions), len(positions), dtype=torch.bool, device=x.device)
        if not rule.bidirectional:
            allowed = allowed.tril()
        key_positions = positions
        if cache.keys[layer] is not None:
            assert cache.positions is not None
            k, v = torch.cat([cache.keys[layer], k], dim=1), torch.cat([cache.values[layer], v], dim=1)
            before = (cache.positions < positions[0])[None, :].expand(len(positions), -1)
            allowed = torch.cat([before, allowed], dim=1)
            key_positions = torch.cat([cache.positions, positions])
        if rule.window_left is not None:  # window_left keys to the left of each query (SGLang's sliding_window_size)
            allowed &= key_positions[None, :] >= positions[:, None] - rule.window_left
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
        scores = (q.float() @ k.float().transpose(1, 2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = (scores.softmax(-1) @ v.float()).to(x.dtype)
        return self._linear(out.transpose(0, 1).reshape(len(positions), self.heads * self.head_dim), p + "o_proj")


class DFlashDecoder(SpeculativeDecoder):
    """Greedy block drafting and verification for one target model and one DFlash drafter.

    :param target: the ``transformers`` causal LM.
    :param drafter: the exported drafter, computed as SGLang does.
    :param capture: returns a context manager recording the target's aux states (``aux()``: ``[T, K * H]``).
    :param block_size: tokens verified per round (``--speculative-num-draft-tokens``): the bonus and B − 1 drafts.
    """

    def __init__(self, target: Any, drafter: DFlashDrafter, capture: Callable[[], Any], block_size: int) -> None:
        super().__init__(target, drafter, capture, block_size - 1)  # type: ignore[arg-type]
        self.drafter: DFlashDrafter = drafter
        self.block_size = block_size

    @property
    def draft_tokens_per_round(self) -> int:
        return self.block_size - 1

    def draft(self, bonus: int, position: int, cache: DFlashCache) -> list[int]:
        """One round's drafts after ``bonus`` at ``position``: the argmax of the block's slots 1 .. B − 1."""
        block = self.drafter.block_logits(bonus, position, self.block_size, cache)
        return [int(t) for t in torch.argmax(block[1:], dim=-1)]

    def verified(self, accepted: int) -> None:
        """Told after each verify how many of the round's drafts the target accepted (a family that records per
        round, such as DSpark's confidence, overrides it)."""

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: set[int],
        ignore_eos: bool,
        between_rounds: Callable[[], None] = lambda: None,
    ) -> tuple[list[int], dict[str, Any], SpecStats]:
        """Greedy tokens after ``input_ids`` (up to ``max_new_tokens``), the finish reason, the stats."""
        stats = SpecStats(draft_tokens_per_round=self.draft_tokens_per_round)
        logits, aux, target_cache = self._target(input_ids, None)
        bonus = int(torch.argmax(logits[-1]))
        output = [bonus]
        committed = len(input_ids)  # positions in both caches: the prompt, then verified tokens
        if self._finished(output, max_new_tokens, stop_ids, ignore_eos):
            return self._result(output, max_new_tokens, stop_ids, ignore_eos, stats)
        draft_cache = self.drafter.new_cache()
        self.drafter.add_context(aux, torch.arange(committed, device=self.device), draft_cache)
        while True:
            between_rounds()
            drafts = self.draft(bonus, committed, draft_cache)
            verify_logits, verify_aux, target_cache = self._target([bonus, *drafts], target_cache)
            choices = [int(t) for t in torch.argmax(verify_logits, dim=-1)]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
                accepted += 1
            self.verified(accepted)
            kept = accepted + 1  # the bonus and the accepted drafts: their target KV stays, their aux joins the context
            crop_cache(target_cache, committed + kept)
            stats.verify_ct += 1
            stats.correct_drafts += accepted
            output += [*drafts[:accepted], choices[accepted]]
            if self._finished(output, max_new_tokens, stop_ids, ignore_eos):
                return self._result(output, max_new_tokens, stop_ids, ignore_eos, stats)
            self.drafter.add_context(verify_aux[:kept], torch.arange(committed, committed + kept, device=self.device), draft_cache)
            committed += kept
            bonus = choices[accepted]


def dflash_decoder(model: Any, config: ReferenceEngineConfig) -> DFlashDecoder:
    """The DFLASH decoder of ``--speculative-draft-model-path`` for ``model``, its block
    ``--speculative-num-draft-tokens`` (or ``--speculative-dflash-block-size``; else the export's)."""
    block = config.speculative_num_draft_tokens or config.speculative_dflash_block_size
    return load_dflash_decoder(model, config.speculative_draft_model_path, block)


def load_dflash_decoder(model: Any, folder: Path | None, block_size: int | None) -> DFlashDecoder:
    """The DFlash decoder of the exported SGLang drafter ``folder`` for ``model``, capturing what SGLang's
    target captures for its ``target_layer_ids``; ``block_size`` None: the export's ``dflash_config.block_size``."""
    drafter, capture = load_drafter(model, folder)
    block = int(block_size or drafter.block_size)
    if block < 2:
        raise UserError(f"DFLASH block size {block}: a block holds the bonus token and at least one draft (2 or more)")
    return DFlashDecoder(model, drafter, capture, block)


def load_drafter(model: Any, folder: Path | None, kind: type[DFlashDrafter] = DFlashDrafter) -> tuple[Any, Callable[[], Any]]:
    """The exported SGLang drafter ``folder`` for ``model`` as a ``kind`` (DFlash's, or a family's built on it),
    checked against the target (its mask token, its context layers), and the capture of what SGLang's target
    captures for its ``target_layer_ids``."""
    from eagleflow.engine import AuxStateCapture, decoder_layers_and_norm

    if folder is None or not (Path(folder) / "config.json").is_file():
        raise UserError(f"--speculative-draft-model-path: {folder} has no config.json (run eagleflow export first)")
    device = next(model.parameters()).device
    drafter = kind(Path(folder), model.get_input_embeddings(), model.get_output_embeddings(), model.dtype, device)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if not 0 <= drafter.mask_token_id < vocab:
        raise UserError(f"{folder}: mask_token_id {drafter.mask_token_id} is not below the target's vocab size {vocab}")
    layers = captured_layer_ids(drafter.target_layer_ids)
    depth = len(decoder_layers_and_norm(model)[0])
    if max(layers) >= depth or min(layers) < 1:
        raise UserError(
            f"--speculative-draft-model-path {folder}: target_layer_ids {drafter.target_layer_ids}: SGLang captures the input "
            f"of layers {layers}, which the {depth}-layer target does not all have"
        )
    return drafter, lambda: AuxStateCapture(model, layers)
