"""The verifier's own tensors: where its embedding, final norm and ``lm_head`` live, read alone, and applied.

Beside :mod:`eagleflow.verifier.config` (its ``config.json``), the one place that knows the verifier's
weights: training builds speculators' head folder from them (:mod:`eagleflow.train.verifier_head`),
the capture check applies the final norm and ``lm_head`` to captured states
(:mod:`eagleflow.extract.verify_capture`), and :func:`rms_norm` is the norm both the check and the
reference engine's drafter compute. torch and safetensors are imported where they are used, so the
data stage stays light to import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagleflow.verifier.config import config_float, text_config
from eagleflow.errors import UserError

if TYPE_CHECKING:
    import torch

# The plain names speculators looks the three tensors up by.
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
NORM = "model.norm.weight"
VOCAB_CHUNK = 16384  # lm_head rows converted to float32 at a time (Kimi's is 163840 x 7168)


@dataclass(frozen=True)
class VerifierWeights:
    """Where the three tensors speculators needs live in a verifier folder."""

    embed_key: str
    lm_head_key: str | None  # None: tied to the embedding
    norm_key: str
    files: dict[str, str]  # key -> safetensors file name

    @property
    def plain(self) -> bool:
        """True when speculators finds every tensor under its exact name."""
        return self.embed_key == EMBED and self.lm_head_key in (LM_HEAD, None) and self.norm_key == NORM


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or the single ``model.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.exists():
        from sglang_patch.sample_header import read_header  # the header alone: no torch in the training step

        try:
            return dict.fromkeys(read_header(single).tensors, single.name)
        except ValueError as exc:
            raise UserError(f"--verifier {model_dir}: {exc}") from exc
    raise UserError(f"--verifier {model_dir} has neither model.safetensors nor model.safetensors.index.json")


def _shortest(keys: list[str]) -> str | None:
    return min(keys, key=len) if keys else None


def locate_weights(model_dir: Path) -> VerifierWeights:
    """Find the language model's embedding, LM head and final norm, whatever their prefix.

    The embedding is the shortest key ending in ``embed_tokens.weight`` outside the decoder
    layers and any vision tower; the final norm sits beside it (``…embed_tokens`` ->
    ``…norm``); the LM head is the shortest key ending in ``lm_head.weight`` (absent: tied).
    """
    names = weight_map(model_dir)

    def is_text(key: str) -> bool:
        return ".layers." not in key and not any(part in key for part in ("vision", "mm_projector", "visual"))

    embed = _shortest([k for k in names if k.endswith("embed_tokens.weight") and is_text(k)])
    if embed is None:
        raise UserError(f"--verifier {model_dir}: no '*embed_tokens.weight' tensor among {len(names)} tensors")
    norm = embed[: -len("embed_tokens.weight")] + "norm.weight"
    if norm not in names:
        raise UserError(f"--verifier {model_dir}: found {embed} but no final norm {norm} beside it")
    lm_head = _shortest([k for k in names if k.endswith("lm_head.weight") and is_text(k)])
    keys = [k for k in (embed, lm_head, norm) if k is not None]
    return VerifierWeights(embed, lm_head, norm, {k: names[k] for k in keys})


def read_weight(model_dir: Path, weights: VerifierWeights, key: str, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Tensor ``key`` of the verifier (one of ``weights``'), read alone from its safetensors file.

    :param rows: only these rows (e.g. the embedding rows of a prompt's tokens), each read on its own.
    """
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / weights.files[key]), framework="pt") as handle:
        if rows is None:
            return handle.get_tensor(key).contiguous()
        piece = handle.get_slice(key)
        return torch.cat([piece[row : row + 1] for row in rows]) if rows else piece[0:0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, computed in float32 as SGLang's and transformers' kernels do."""
    import torch

    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(dtype)


@dataclass
class VerifierHead:
    """The verifier's final norm and ``lm_head`` (plus its logit scaling, if any), applied in float32."""

    norm_weight: torch.Tensor
    lm_head: torch.Tensor
    eps: float
    logit_scale: float | None = None
    softcap: float | None = None

    def logits(self, states: torch.Tensor, apply_norm: bool = True) -> torch.Tensor:
        """``[T, V]`` float32 logits of ``states`` ``[T, H]``, with or without the final norm."""
        import torch

        x = states.float()
        if apply_norm:
            x = rms_norm(x, self.norm_weight.float(), self.eps)
        out = torch.empty(x.shape[0], self.lm_head.shape[0], dtype=torch.float32)
        for start in range(0, self.lm_head.shape[0], VOCAB_CHUNK):
            out[:, start : start + VOCAB_CHUNK] = x @ self.lm_head[start : start + VOCAB_CHUNK].float().T
        if self.logit_scale is not None:
            out *= self.logit_scale
        if self.softcap:
            out = self.softcap * torch.tanh(out / self.softcap)
        return out

    def normed_rms(self, states: torch.Tensor) -> torch.Tensor:
        """Per-row RMS of ``states`` with the norm weight divided out: all 1 for the norm's output."""
        weight = self.norm_weight.float()
        usable = weight.abs() > 1e-6
        return (states.float()[:, usable] / weight[usable]).pow(2).mean(-1).sqrt()


def load_verifier_head(model: str | Path) -> VerifierHead:
    """The verifier's final norm and ``lm_head`` (the embedding when tied), read alone from its safetensors."""
    model = Path(model)
    weights = locate_weights(model)
    config = text_config(model)
    return VerifierHead(
        norm_weight=read_weight(model, weights, weights.norm_key),
        lm_head=read_weight(model, weights, weights.lm_head_key or weights.embed_key),
        eps=config_float(model, "rms_norm_eps"),
        logit_scale=config.get("logit_scale"),
        softcap=config.get("final_logit_softcapping"),
    )
