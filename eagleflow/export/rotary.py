"""Does SGLang rotate the draft's queries and keys as training did? The export's rotary check.

speculators' Llama draft layer (EAGLE-3) takes its rotary embedding from transformers'
``LlamaRotaryEmbedding`` on the checkpoint's layer config, its Qwen3 DFlash layers from
``Qwen3RotaryEmbedding`` (frequencies and a cos/sin scale, ``attention_scaling``); both rotate
whole heads, neox style. SGLang computes its own from the exported
config (:func:`eagleflow.sglang_rules.rope.sglang_rotary`, which the reference drafter runs
too). The two are compared number by number; any difference (a rope type SGLang computes
otherwise, a key one side ignores, a partial rotary) refuses the SGLang folder by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagleflow.export.tensors import NotServable


def trained_rotary(layer: Mapping[str, Any], config_class: Any = None, rotary_class: Any = None) -> tuple[Any, float, int]:
    """``(inv_freq, attention_scaling, head_dim)`` of transformers' ``rotary_class`` built on ``config_class(**layer)``
    (``LlamaRotaryEmbedding`` on a ``LlamaConfig`` unless given: the EAGLE-3 draft layer's)."""
    if config_class is None or rotary_class is None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config_class, rotary_class = config_class or LlamaConfig, rotary_class or LlamaRotaryEmbedding
    config = config_class(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    rotary = rotary_class(config)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return rotary.inv_freq.float(), float(rotary.attention_scaling), head_dim


def check_rotary(layer: Mapping[str, Any], exported: Mapping[str, Any], config_class: Any = None, rotary_class: Any = None) -> None:
    """Refuse (:class:`NotServable`) when SGLang's rotary for ``exported`` differs from the trained one of ``layer``
    (``config_class`` and ``rotary_class``: the trained layer's, as for :func:`trained_rotary`)."""
    import torch

    from eagleflow.sglang_rules import UnsupportedRope, sglang_rotary

    settings = exported.get("rope_parameters")
    trainer = getattr(rotary_class, "__name__", "LlamaRotaryEmbedding")
    try:
        inv_freq, scale, head_dim = trained_rotary(layer, config_class, rotary_class)
    except (KeyError, ValueError, TypeError) as exc:
        raise NotServable(f"rotary settings {settings} are not ones transformers' {trainer} trains with ({exc})") from exc
    try:
        served = sglang_rotary(exported, head_dim)
    except UnsupportedRope as exc:
        raise NotServable(f"rotary settings {settings}: {exc}") from exc
    if served.rotary_dim != 2 * inv_freq.numel() or served.rotary_dim != head_dim or not served.neox:
        raise NotServable(
            f"rotary settings {settings}: SGLang would rotate {served.rotary_dim} of {head_dim} dims "
            f"({'neox' if served.neox else 'GPT-J'} style); training rotated {2 * inv_freq.numel()}, neox style"
        )
    if not torch.allclose(served.inv_freq, inv_freq, rtol=1e-5, atol=0) or abs(served.scale - scale) > 1e-6 * max(1.0, scale):
        worst = (served.inv_freq - inv_freq).abs().max().item()
        raise NotServable(
            f"rotary settings {settings}: SGLang computes other frequencies or scale than transformers trained with "
            f"(largest frequency difference {worst:.3g}; cos/sin scale {served.scale:.6g} served, {scale:.6g} trained)"
        )
