"""Plain stand-ins shaped like SGLang's DeepSeek-V2/V3 code, for driving the capture hook on CPU.

They carry exactly the names the hook relies on, each checked against the real wheels by
test_sglang_source.py: ``DeepseekV3ForCausalLM.model`` (and Kimi-K2.5's
``language_model.model``) is a ``DeepseekV2Model`` with ``embed_tokens``, ``layers`` and
``norm``; a decoder layer has ``layer_id`` and ``config.num_hidden_layers``, is called as
``layer(positions, hidden_states, forward_batch, residual, zero_allocator, ...)`` and returns
``(hidden_states, residual, topk_indices)``; ``ForwardBatch`` has ``forward_mode``, ``rids``,
``input_ids`` and the ``extend_{seq,prefix}_lens[_cpu]`` fields.

The norms fold the residual add in place, the way SGLang's ``fused_add_rmsnorm`` does, so a
hook that kept references to a layer's tensors instead of summing them at once would read
overwritten values. The model also records SGLang's own aux capture
(``hidden_states + residual`` before layer k, the 0.5.10 ``layers_to_capture`` code) and the
pre-norm final state: the oracle the dumps are compared with.
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


class ForwardMode(enum.IntEnum):
    """The subset of SGLang's ForwardMode the hook consults, with the same method semantics."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY


@dataclass
class ForwardBatch:
    forward_mode: Any
    input_ids: torch.Tensor
    rids: list[str] | None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    positions: torch.Tensor | None = field(default=None)


def extend_batch(
    requests: dict[str, list[int]], prefix_lens: dict[str, int] | None = None, mode: Any = ForwardMode.EXTEND
) -> ForwardBatch:
    """One batch holding ``requests`` (rid -> the token ids of this pass), concatenated in order."""
    prefix_lens = prefix_lens or {}
    rids = list(requests)
    seq_lens = [len(requests[r]) for r in rids]
    prefixes = [prefix_lens.get(r, 0) for r in rids]
    ids = torch.tensor([t for r in rids for t in requests[r]], dtype=torch.int64)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, seq_lens)]) if rids else torch.empty(0)
    return ForwardBatch(
        forward_mode=mode,
        input_ids=ids,
        rids=rids,
        extend_seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefixes,
        extend_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        positions=positions,
    )


class RMSNorm(nn.Module):
    """``norm(x)`` or, with a residual, SGLang's fused add+norm that rewrites both tensors in place."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        x.copy_(self._norm(residual))
        return x, residual


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
        zero_allocator: Any,
        gemm_output_zero_allocator: Any = None,
        llama_4_scaling: Any = None,
        prev_topk_indices: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        if residual is None:  # SGLang's prepare_attn for the first layer: the residual aliases the input
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = torch.tanh(self.self_attn(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = torch.tanh(self.mlp(hidden_states))
        return hidden_states, residual, None


class DeepseekV2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size)
        self.oracle: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        self.oracle = {}
        for i, layer in enumerate(self.layers):
            self.oracle[i] = hidden_states.clone() if residual is None else hidden_states + residual
            hidden_states, residual, _ = layer(positions, hidden_states, forward_batch, residual, None, None, None, prev_topk_indices=None)
        self.oracle[len(self.layers)] = hidden_states + residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.model = DeepseekV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, positions, forward_batch))

    @property
    def oracle(self) -> dict[int, torch.Tensor]:
        return self.model.oracle


class KimiK25ForConditionalGeneration(nn.Module):
    """Kimi-K2.5's wrapper: a vision tower (with its own ``layers``) beside ``language_model``.

    :param alias_model: also register the text model as ``self.model``, as SGLang 0.5.10 does
        (``self.model = self.language_model.model``); later releases make ``model`` a property.
    """

    def __init__(self, config: Any, alias_model: bool = False) -> None:
        super().__init__()
        vision = SimpleNamespace(hidden_size=config.hidden_size, num_hidden_layers=2, vocab_size=8)
        self.vision_tower = nn.Module()
        self.vision_tower.model = nn.Module()
        self.vision_tower.model.layers = nn.ModuleList([DecoderLayer(vision, i) for i in range(2)])
        self.language_model = DeepseekV3ForCausalLM(config)
        if alias_model:
            self.model = self.language_model.model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, positions, forward_batch)

    @property
    def oracle(self) -> dict[int, torch.Tensor]:
        return self.language_model.oracle


def tiny_config(num_layers: int = 6, hidden: int = 16, vocab: int = 50) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=num_layers, hidden_size=hidden, vocab_size=vocab)


def build_model(kind: str = "deepseek", num_layers: int = 6, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """``kind``: "deepseek", "kimi", or "kimi-aliased" (SGLang 0.5.10's Kimi-K2.5 tree)."""
    torch.manual_seed(seed)
    config = tiny_config(num_layers)
    if kind == "deepseek":
        model: nn.Module = DeepseekV3ForCausalLM(config)
    else:
        model = KimiK25ForConditionalGeneration(config, alias_model=kind == "kimi-aliased")
    return model.to(dtype).eval()


def register_forward_hooks(model: nn.Module, hook_specs: list[dict[str, Any]], remove_duplicate: bool = True) -> list[str]:
    """What SGLang's hook_manager.register_forward_hooks does (checked against it in test_sglang_source).

    Resolves ``hook_factory`` ("module:attr"), calls it once with ``config``, registers the
    returned callable as a post forward hook on every module whose name matches a pattern.
    Returns the names hooked. ``remove_duplicate=False`` lists a module under each of its names
    (SGLang keeps torch's default, True), to show a module hooked twice is harmless.
    """
    hooked: list[str] = []
    for spec in hook_specs:
        module_name, attr = spec["hook_factory"].split(":", 1)
        hook = getattr(importlib.import_module(module_name), attr)(spec.get("config") or {})
        for name, module in dict(model.named_modules(remove_duplicate=remove_duplicate)).items():
            if any(fnmatch.fnmatch(name, pattern) for pattern in spec["target_modules"]):
                module.register_forward_hook(hook)
                hooked.append(name)
    return hooked


def run(model: nn.Module, batch: ForwardBatch) -> torch.Tensor:
    """One forward pass the way SGLang runs it: inference mode, the batch's tokens concatenated."""
    with torch.inference_mode():
        return model(batch.input_ids, batch.positions, batch)
