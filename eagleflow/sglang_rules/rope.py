"""Rotary position embedding as SGLang's EAGLE-3 draft layer computes it.

Read from SGLang 0.5.17–0.5.23 (``models/llama.py``: ``LlamaDecoderLayer``, ``LlamaAttention``;
``layers/rotary_embedding/``: ``factory.get_rope``, ``base``, ``rope_variant``, ``yarn``):

- the settings are ``rope_parameters`` when the config has them, else ``rope_scaling`` (theta
  from the chosen dict's ``rope_theta``, else the top-level ``rope_theta``, else 10000); a
  top-level ``original_max_position_embeddings`` overrides the dict's;
- ``rotary_dim = int(partial_rotary_factor * head_dim)`` with the *top-level*
  ``partial_rotary_factor`` (default 1); the rest of each head passes unrotated;
- ``rope_is_neox_style`` (default True): rotate halves (neox) or interleaved pairs (GPT-J);
- the types ``default``, ``linear``, ``llama3`` and ``yarn`` (``mscale``/``mscale_all_dim``,
  ``attn_factor``, ``beta_fast``, ``beta_slow``, ``extrapolation_factor``, ``truncate``; YaRN
  multiplies cos and sin by its mscale). SGLang's other types (dynamic NTK, mrope, longrope, …)
  are refused by name: the reference drafter does not compute them.

The export compares this with what training computed (transformers' ``LlamaRotaryEmbedding``)
and refuses a drafter whose rotary SGLang would compute otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedRope(ValueError):
    """A rotary setting the reference drafter does not compute as SGLang would."""


def rope_settings(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` as SGLang's ``LlamaDecoderLayer`` reads them from a draft ``config``."""
    parameters = config.get("rope_parameters")
    if parameters is not None:
        theta, scaling = float(parameters.get("rope_theta", 10000)), dict(parameters)
    else:
        theta = float(config.get("rope_theta", 10000))
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") is not None else None
    if scaling is not None and config.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return theta, scaling


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The scaling type SGLang's ``get_rope`` picks (``rope_type``, else the legacy ``type``)."""
    if scaling is None:
        return "default"
    if "rope_type" in scaling:
        return str(scaling["rope_type"])
    if "type" in scaling:
        return str(scaling["type"])
    raise UnsupportedRope(f"rope settings {dict(scaling)} name no rope_type (SGLang refuses them too)")


@dataclass(frozen=True)
class Rotary:
    """The rotary embedding of one draft config: frequencies, cos/sin scale, rotated width, style."""

    inv_freq: torch.Tensor  # [rotary_dim // 2], float32
    scale: float  # multiplies cos and sin (YaRN's mscale; 1 otherwise)
    rotary_dim: int
    neox: bool

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[heads, T, head_dim]`` rotated at ``positions`` ``[T]`` (SGLang's ``forward_native``)."""
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos, sin = (angles.cos() * self.scale).to(x.dtype), (angles.sin() * self.scale).to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rotated = torch.cat((o1, o2), dim=-1) if self.neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1)


def sglang_rotary(config: Mapping[str, Any], head_dim: int) -> Rotary:
    """The :class:`Rotary` SGLang builds for a draft ``config`` (its ``config.json`` as a dict).

    :raises UnsupportedRope: a rope type the reference drafter does not compute.
    """
    theta, scaling = rope_settings(config)
    kind = rope_type(scaling)
    rotary_dim = int(float(config.get("partial_rotary_factor", 1) or 1) * head_dim)
    neox = bool(config.get("rope_is_neox_style", True))
    if scaling is not None and "mrope_section" in scaling:
        raise UnsupportedRope(f"mrope ({kind} with mrope_section) is not computed by the reference drafter")
    base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if kind == "default":
        return Rotary(base, 1.0, rotary_dim, neox)
    assert scaling is not None
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":  # LinearScalingRotaryEmbedding: positions / factor
        return Rotary(base / factor, 1.0, rotary_dim, neox)
    max_position = int(config.get("max_position_embeddings", 8192))
    original = int(scaling.get("original_max_position_embeddings", max_position))
    if kind == "llama3":
        return Rotary(_llama3(base, factor, float(scaling.get("low_freq_factor", 1.0)),
                              float(scaling.get("high_freq_factor", 4.0)), original), 1.0, rotary_dim, neox)
    if kind == "yarn":
        return _yarn(scaling, theta, factor, original, rotary_dim, neox)
    raise UnsupportedRope(
        f"rope_type {kind!r}: the reference drafter computes {', '.join(SUPPORTED_ROPE_TYPES)} as SGLang does, not {kind!r}"
    )


def _llama3(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """``Llama3RotaryEmbedding._compute_inv_freq``."""
    wave_len = 2 * math.pi / inv_freq
    smooth = (original / wave_len - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
    return torch.where(
        wave_len < original / high,
        inv_freq,
        torch.where(wave_len > original / low, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(scaling: Mapping[str, Any], theta: float, factor: float, original: int, rotary_dim: int, neox: bool) -> Rotary:
    """``YaRNScalingRotaryEmbedding``: its frequencies and mscale, from the keys ``get_rope`` passes it."""
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale is not None and mscale_all_dim is not None:
        scale = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    else:
        scale = _yarn_mscale(factor)
    scale *= float(scaling.get("attn_factor", 1))
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    mask = (1 - ramp) * float(scaling.get("extrapolation_factor", 1))
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    return Rotary(inv_freq, float(scale), rotary_dim, neox)
