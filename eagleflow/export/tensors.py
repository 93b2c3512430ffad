"""The tensors a drafter's config makes its class build, the one check of a weights file against
them, and the one writer of an exported weights file.

Each family owns its list, with shapes derived from the config (``hidden_size``, heads × ``head_dim``,
``num_key_value_heads``, ``intermediate_size``, the vocabularies, the layers, the aux layer count):
EAGLE-3's is :func:`eagleflow.drafters.eagle3.sglang_export.expected_eagle3_weights`, DFlash's
:func:`eagleflow.drafters.dflash.sglang_export.expected_dflash_weights` (SGLang's folder) and
:func:`~eagleflow.drafters.dflash.sglang_export.checkpoint_dflash_weights` (the checkpoint), each named
to the export by its family's :class:`CheckpointLayout`. What all
share is here: speculators' draft decoder layer (``transformers``' Llama and Qwen3 layers, as
speculators' ``model_definitions.py`` builds them) and its vocabulary tensors (``DraftVocabMixin``
in ``speculators/model.py``). Each entry names the config keys and values that decide it, so a
mismatch names the file, the tensor, both shapes and the key; :func:`check_tensors` is the one
comparison.

Why a checkpoint is checked against itself: nothing downstream does. SGLang's ``load_weights``
skips names it does not know and never reports a parameter it built but did not load, and
speculators (so vLLM) starts ``input_norm.weight``, ``d2t`` and ``t2d`` fresh when they are missing:
a checkpoint whose config and weights disagree loads everywhere and serves another function than
the one trained.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError, excerpt

# A weights file and its config that disagree: the words every refusal ends with.
DISAGREE = (
    "its config and weights disagree, so every engine would serve another function than the one trained "
    "(refused whatever --serve-with says); export another checkpoint (--checkpoint) or rerun training"
)
SHOWN_PROBLEMS = 4  # a checkpoint of another model disagrees everywhere: the first few say enough


class NotServable(ValueError):
    """A checkpoint SGLang would serve as another function than the one trained."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# What the export reads from every checkpoint's config.json, and what it says when one is missing.
COMMON_CONFIG_KEYS = {
    "transformer_layer_config": "the draft layer's config",
    "draft_vocab_size": "the draft vocabulary size",
}


@dataclass(frozen=True)
class Expected:
    """One tensor a config decides: its shape (None: the config says it is not there) and why."""

    shape: tuple[int, ...] | None
    why: str  # the config keys and values that decide it, e.g. "norm_before_fc true"
    optional: bool = False  # saved or not as the trainer chose (a frozen copy of the verifier's)


@dataclass(frozen=True)
class LayerShape:
    """A draft decoder layer's sizes, read from its whole layer config (:func:`layer_config`)."""

    hidden: int
    heads: int
    head_dim: int
    kv_heads: int
    intermediate: int
    layers: int
    vocab: int
    attention_bias: bool
    mlp_bias: bool  # Llama's MLP reads it; Qwen3's config has none

    @classmethod
    def of(cls, layer: Mapping[str, Any]) -> LayerShape:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        return cls(
            hidden=hidden, heads=heads, head_dim=int(layer.get("head_dim") or hidden // heads),
            kv_heads=int(layer.get("num_key_value_heads") or heads), intermediate=int(layer["intermediate_size"]),
            layers=int(layer["num_hidden_layers"]), vocab=int(layer["vocab_size"]),
            attention_bias=bool(layer.get("attention_bias")), mlp_bias=bool(layer.get("mlp_bias")),
        )

    @property
    def width(self) -> str:
        return f"hidden_size {self.hidden}"


@dataclass(frozen=True)
class CheckpointLayout:
    """What a family's speculators checkpoint holds: the config keys the export reads (key -> what it is, for
    the message when one is missing) and the tensors its config makes the family's class save."""

    config_keys: Mapping[str, str]
    tensors: Callable[[Mapping[str, Any]], dict[str, Expected]]


def layer_config(layer: Mapping[str, Any]) -> dict[str, Any]:
    """speculators' ``transformer_layer_config`` (a diff) as the whole config its class builds (as
    speculators' validator builds it: the class of its ``model_type``, Qwen3 by default)."""
    from transformers import AutoConfig

    settings = dict(layer)
    model_type = settings.pop("model_type", None) or "qwen3"
    return AutoConfig.for_model(model_type, **settings).to_dict()


def decoder_layer(index: int, d: LayerShape, in_features: int, in_why: str, qk_norm: bool) -> dict[str, Expected]:
    """The tensors of draft layer ``index``, whose attention reads ``in_features`` (``in_why`` says why)."""
    p, q, kv = f"layers.{index}.", d.heads * d.head_dim, d.kv_heads * d.head_dim
    heads, kv_heads = f"num_attention_heads {d.heads} × head_dim {d.head_dim}", f"num_key_value_heads {d.kv_heads} × head_dim {d.head_dim}"
    mlp = f"intermediate_size {d.intermediate}, {d.width}"
    out = {
        f"{p}input_layernorm.weight": Expected((d.hidden,), d.width),
        f"{p}post_attention_layernorm.weight": Expected((d.hidden,), d.width),
        f"{p}self_attn.q_proj.weight": Expected((q, in_features), f"{heads}, {in_why}"),
        f"{p}self_attn.k_proj.weight": Expected((kv, in_features), f"{kv_heads}, {in_why}"),
        f"{p}self_attn.v_proj.weight": Expected((kv, in_features), f"{kv_heads}, {in_why}"),
        f"{p}self_attn.o_proj.weight": Expected((d.hidden, q), f"{d.width}, {heads}"),
        f"{p}mlp.gate_proj.weight": Expected((d.intermediate, d.hidden), mlp),
        f"{p}mlp.up_proj.weight": Expected((d.intermediate, d.hidden), mlp),
        f"{p}mlp.down_proj.weight": Expected((d.hidden, d.intermediate), mlp),
    }
    if qk_norm:  # Qwen3's attention normalises each head's q and k
        out.update({f"{p}self_attn.{n}_norm.weight": Expected((d.head_dim,), f"head_dim {d.head_dim}") for n in "qk"})
    if d.attention_bias:
        out.update({f"{p}self_attn.{n}_proj.bias": Expected((size,), f"attention_bias true, {why}")
                    for n, size, why in (("q", q, heads), ("k", kv, kv_heads), ("v", kv, kv_heads), ("o", d.hidden, d.width))})
    if d.mlp_bias:
        out.update({f"{p}mlp.{n}_proj.bias": Expected((size,), f"mlp_bias true, {mlp}")
                    for n, size in (("gate", d.intermediate), ("up", d.intermediate), ("down", d.hidden))})
    return out


def vocabulary_tensors(d: LayerShape, draft_vocab: int, head_always_saved: bool) -> dict[str, Expected]:
    """speculators' vocabulary tensors: the draft head, the maps a reduced vocabulary needs (``d2t``,
    ``t2d``: without them it would be served as the first ``draft_vocab`` tokens), the frozen copies."""
    reduced = draft_vocab != d.vocab
    vocab = f"draft_vocab_size {draft_vocab} of vocab_size {d.vocab}"
    return {
        "embed_tokens.weight": Expected((d.vocab, d.hidden), f"vocab_size {d.vocab}, {d.width}", optional=True),
        "lm_head.weight": Expected((draft_vocab, d.hidden), f"{vocab}, {d.width}", optional=not (reduced or head_always_saved)),
        "verifier_lm_head.weight": Expected((draft_vocab, d.hidden), f"{vocab}, {d.width}", optional=True),
        "verifier_norm.weight": Expected((d.hidden,), d.width, optional=True),
        "d2t": Expected((draft_vocab,), vocab, optional=not reduced),
        "t2d": Expected((d.vocab,), vocab, optional=not reduced),
    }


def tensor_problems(expected: Mapping[str, Expected], tensors: Mapping[str, Any], config: str) -> list[str]:
    """What in ``tensors`` disagrees with ``expected``, each naming the tensors, both shapes and the
    ``config`` keys that decide them (tensors wrong the same way, such as every ``fc_norm.{i}``, in
    one); empty when they agree."""
    wrong: dict[tuple[str, str], list[str]] = {}  # (words before the names, words after) -> names
    for name, want in expected.items():
        have = list(tensors[name].shape) if name in tensors else None
        if want.shape is None and have is not None:
            wrong.setdefault(("holds ", f" {have}, which {config} does not build ({want.why})"), []).append(name)
        elif want.shape is not None and have is None and not want.optional:
            wrong.setdefault(("no ", f", which {config} makes {list(want.shape)} ({want.why})"), []).append(name)
        elif want.shape is not None and have is not None and have != list(want.shape):
            wrong.setdefault(("", f" is {have}, not {list(want.shape)} ({config}: {want.why})"), []).append(name)
    for name in sorted(set(tensors) - set(expected)):
        wrong.setdefault(("holds ", f" {list(tensors[name].shape)}, which nothing in {config} builds"), []).append(name)
    return [f"{before}{', '.join(names)}{after}" for (before, after), names in wrong.items()]


def check_tensors(expected: Mapping[str, Expected], tensors: Mapping[str, Any], weights: Path, config: Path) -> None:
    """Refuse (:class:`UserError`) ``weights``' ``tensors`` unless they are what ``config`` makes its class build."""
    problems = tensor_problems(expected, tensors, config.name if config.parent == weights.parent else str(config))
    if problems:
        more = f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        raise UserError(f"{weights}: {'; '.join(problems[:SHOWN_PROBLEMS])}{more}; {DISAGREE}")


@contextmanager
def config_read_as(config_path: Path, what: str) -> Iterator[None]:
    """Inside, reading ``config_path`` (a checkpoint's config) into what SGLang reads: a key missing or a value of
    the wrong kind is a :class:`UserError` naming the file as an unusable ``what``; :class:`NotServable` passes
    as it is (what SGLang would serve as another function has its own words)."""
    try:
        yield
    except NotServable:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{config_path}: unusable {what} ({type(exc).__name__}: {excerpt(exc)})") from exc


def write_drafter_folder(target: Path, weights: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """A drafter folder SGLang loads, made at ``target`` (inside the export's staging folder): the weights file and
    the ``config.json`` beside it."""
    target.mkdir(parents=True)
    save_weights(weights, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")  # how the Rust writer quotes the errno


def save_weights(tensors: Mapping[str, Any], path: Path) -> None:
    """Write ``tensors`` to ``path`` as safetensors; a full disk (or another OS failure) is an
    :class:`OSError` with its errno and ``path``, as Python's own writes raise it.

    safetensors' Rust writer raises ``SafetensorError`` for every failure, ENOSPC included; the
    export's :func:`eagleflow.export.step.write_failure` turns an ``OSError`` into what to do.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    try:
        save_file(contiguous, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        found = _OS_ERROR.search(str(exc))
        code = int(found.group(1) or found.group(2)) if found else None
        needed = sum(t.numel() * t.element_size() for t in contiguous.values())
        if code is None and shutil.disk_usage(path.parent).free < needed:
            code = errno.ENOSPC  # the message changed across releases; the disk says it
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from exc
