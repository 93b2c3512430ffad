"""An EAGLE-3 drafter computed as SGLang computes it, from the folder ``eagleflow export`` writes.

Plain torch on the exported ``config.json`` and ``model.safetensors``, following
``sglang/srt/models/llama_eagle3.py`` and ``llama.py`` (0.5.17–0.5.23), not speculators' Python
class, so the reference engine serves exactly what SGLang would load:

- the target's aux states ``[T, n_aux * target_hidden]`` pass ``input_norm`` (``norm_before_fc``),
  the per-aux ``fc_norm`` (switched on by the config's ``fc_norm`` or legacy ``use_aux_norm``,
  as SGLang builds it, never by the weights' presence) and ``fc``; a draft decode step passes the
  draft's own hidden state instead;
- the token embedding is the *target's* (SGLang's ``set_embed``), unless ``target_hidden_size``
  differs from ``hidden_size``: ``set_embed`` then keeps the draft's own ``embed_tokens``;
- the input layer keeps the **pre-norm** state as its residual, normalises it with
  ``hidden_norm`` and the embedding with ``input_layernorm``, and attends over their
  concatenation; later layers fold the residual in with ``hidden_norm``; attention is Llama's
  with q/k/v built without bias (SGLang overrides ``qkv_proj``), an ``o_proj`` bias when the
  config has ``attention_bias`` (or ``bias``), GQA, an optional sliding window, and the rotary
  embedding of :mod:`~eagleflow.sglang_rules.rope`; the MLP has no bias;
- ``norm(hidden, residual)`` gives the logits over the draft vocabulary and, for the next step,
  the pre-norm state (the normed one with ``norm_output``); draft ids map to target ids by
  ``d2t + arange`` (SGLang's hot token ids).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eagleflow.verifier import rms_norm
from eagleflow.sglang_rules import UnsupportedRope, sglang_rotary
from eagleflow.errors import UserError, excerpt

# Names older EAGLE-3 exports use; SGLang maps them too (load_weights legacy_name_map).
LEGACY_NAMES = {"midlayer.": "layers.0.", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


@dataclass
class DraftCache:
    """Keys and values of every draft layer for positions ``0 .. length-1``."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else int(self.keys[0].shape[1])

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on (drafts the target rejected)."""
        self.keys = [k[:, :length] if k is not None else None for k in self.keys]
        self.values = [v[:, :length] if v is not None else None for v in self.values]


class Eagle3Drafter:
    """The draft model of an exported SGLang EAGLE-3 folder.

    :param folder: the ``drafter/sglang`` folder (config.json, model.safetensors).
    :param embed_tokens: the target's token embedding (SGLang gives the draft the target's).
    :param dtype: compute dtype (the target's).
    """

    def __init__(self, folder: str | Path, embed_tokens: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            self.config: dict[str, Any] = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"{folder / 'config.json'}: cannot load the drafter's config ({excerpt(exc)})") from exc
        try:
            weights = load_file(str(folder / "model.safetensors"), device=str(device))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{folder / 'model.safetensors'}: cannot load the drafter's weights ({excerpt(exc)})") from exc
        for legacy, name in LEGACY_NAMES.items():
            weights = {k.replace(legacy, name): v for k, v in weights.items()}
        self.weights = {k.removeprefix("model."): (v if k == "d2t" else v.to(dtype)) for k, v in weights.items()}
        self.dtype = dtype
        c = self.config
        self.hidden = int(c["hidden_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.heads)
        self.layers = int(c["num_hidden_layers"])
        self.eps = float(c["rms_norm_eps"])
        eagle = c.get("eagle_config") or {}
        self.norm_before_fc = bool(eagle.get("norm_before_fc", c.get("norm_before_fc", False)))
        self.fc_norm = bool(c.get("fc_norm") or c.get("use_aux_norm", False))
        self.norm_output = bool(c.get("norm_output", False))
        self.num_aux = len(eagle.get("eagle_aux_hidden_state_layer_ids") or [None] * 3)
        self.attention_bias = bool(c.get("attention_bias", False) or c.get("bias", False))
        self.fc_bias = bool(c.get("bias", False))
        try:
            self.rotary = sglang_rotary(c, self.head_dim)
        except UnsupportedRope as exc:
            raise UserError(f"{folder / 'config.json'}: {exc}") from exc
        self.own_embedding = "target_hidden_size" in c and int(c["target_hidden_size"]) != self.hidden
        self.embed_tokens = self._own_embedding(folder) if self.own_embedding else embed_tokens
        self._check_weights(folder)
        self.window: int | None = None  # set by the engine from --speculative-draft-window-size
        d2t = self.weights.get("d2t")
        self.hot_token_ids = (d2t + torch.arange(d2t.shape[0], device=d2t.device)) if d2t is not None else None

    def _own_embedding(self, folder: Path) -> torch.nn.Module:
        """The draft's own embedding, which SGLang's ``set_embed`` keeps when the hidden sizes differ."""
        weight = self.weights.get("embed_tokens.weight")
        if weight is None or tuple(weight.shape) != (int(self.config["vocab_size"]), self.hidden):
            raise UserError(
                f"{folder}: target_hidden_size {self.config['target_hidden_size']} differs from hidden_size {self.hidden}, "
                f"so SGLang keeps the draft's own embed_tokens, but the folder has no [vocab_size, {self.hidden}] embed_tokens.weight"
            )
        return torch.nn.Embedding.from_pretrained(weight, freeze=True)

    def _check_weights(self, folder: Path) -> None:
        """Every weight this config makes SGLang build must be in the folder (SGLang would serve garbage)."""
        needed = ["fc.weight", "norm.weight", "lm_head.weight"]
        needed += ["input_norm.weight"] if self.norm_before_fc else []
        needed += [f"fc_norm.{i}.weight" for i in range(self.num_aux)] if self.fc_norm else []
        needed += ["fc.bias"] if self.fc_bias else []
        for layer in range(self.layers):
            p = f"layers.{layer}."
            needed += [p + name for name in ("hidden_norm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                                             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
            needed += [p + "input_layernorm.weight"] if layer == 0 else []
            needed += [p + "self_attn.o_proj.bias"] if self.attention_bias else []
        missing = [name for name in needed if name not in self.weights]
        if missing:
            raise UserError(f"{folder / 'model.safetensors'}: no {', '.join(missing)}, which its config.json makes SGLang build")

    def new_cache(self) -> DraftCache:
        return DraftCache(keys=[None] * self.layers, values=[None] * self.layers)

    def target_token(self, draft_id: int) -> int:
        """The target vocabulary id of draft id ``draft_id``."""
        return int(self.hot_token_ids[draft_id]) if self.hot_token_ids is not None else int(draft_id)

    # ---- the forward pass --------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over ``T`` new positions; returns ``(draft-vocab logits [T, V_d], hidden [T, H])``.

        :param input_ids: ``[T]`` target-vocabulary token ids (the token after each position).
        :param hidden_states: ``[T, n_aux * target_hidden]`` target aux states, or ``[T, H]`` draft states.
        :param positions: ``[T]`` absolute positions, continuing ``cache``.
        :param mask: ``[T, cached + T]`` keys each position may attend to, instead of every key at or
            before its position (tree drafts: each branch sees the prefix and its own row only).
        """
        w = self.weights
        embeds = self.embed_tokens(input_ids).to(self.dtype)
        hidden = hidden_states.to(self.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:
            if self.norm_before_fc:
                hidden = rms_norm(hidden, w["input_norm.weight"], self.eps)
            if self.fc_norm:
                chunks = hidden.chunk(self.num_aux, dim=-1)
                hidden = torch.cat([rms_norm(x, w[f"fc_norm.{i}.weight"], self.eps) for i, x in enumerate(chunks)], -1)
            hidden = F.linear(hidden, w["fc.weight"], w.get("fc.bias") if self.fc_bias else None)
        residual: torch.Tensor | None = None
        for layer in range(self.layers):
            p = f"layers.{layer}."
            if layer == 0:
                residual = hidden  # the pre-norm state: SGLang's input layer never reads norm_before_residual
                x = torch.cat([rms_norm(embeds, w[p + "input_layernorm.weight"], self.eps),
                               rms_norm(hidden, w[p + "hidden_norm.weight"], self.eps)], dim=-1)
            else:
                residual = hidden + residual
                x = rms_norm(residual, w[p + "hidden_norm.weight"], self.eps)
            attn = self._attention(layer, x, positions, cache, mask)
            residual = attn + residual
            x = rms_norm(residual, w[p + "post_attention_layernorm.weight"], self.eps)
            gate, up = F.linear(x, w[p + "mlp.gate_proj.weight"]), F.linear(x, w[p + "mlp.up_proj.weight"])
            hidden = F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        pre_norm = hidden + residual
        normed = rms_norm(pre_norm, w["norm.weight"], self.eps)
        logits = F.linear(normed, w["lm_head.weight"]).float()
        return logits, (normed if self.norm_output else pre_norm)

    def _attention(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor, cache: DraftCache, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        w, p = self.weights, f"layers.{layer}.self_attn."
        steps = x.shape[0]
        q = F.linear(x, w[p + "q_proj.weight"]).view(steps, self.heads, self.head_dim).transpose(0, 1)
        k = F.linear(x, w[p + "k_proj.weight"]).view(steps, self.kv_heads, self.head_dim).transpose(0, 1)
        v = F.linear(x, w[p + "v_proj.weight"]).view(steps, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = self.rotary.apply(q, positions), self.rotary.apply(k, positions)
        if cache.keys[layer] is not None:
            k = torch.cat([cache.keys[layer], k], dim=1)
            v = torch.cat([cache.values[layer], v], dim=1)
        cache.keys[layer], cache.values[layer] = k, v
        key_positions = torch.arange(k.shape[1], device=x.device)
        if mask is not None:
            allowed = mask
        else:
            allowed = key_positions[None, :] <= positions[:, None]
            if self.window is not None:
                allowed &= key_positions[None, :] > positions[:, None] - self.window
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
        scores = (q.float() @ k.float().transpose(1, 2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = (scores.softmax(-1) @ v.float()).to(x.dtype)
        bias = w[p + "o_proj.bias"] if self.attention_bias else None  # SGLang builds o_proj with the config's bias
        return F.linear(out.transpose(0, 1).reshape(steps, self.heads * self.head_dim), w[p + "o_proj.weight"], bias)
