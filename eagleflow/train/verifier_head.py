"""The verifier as speculators sees it: three tensors and a text config.

speculators reads from the verifier folder only ``config.json`` (through ``AutoConfig``; the
``text_config`` of a multimodal wrapper is used when present) and three tensors,
``embed_tokens``, ``lm_head`` and the final ``model.norm`` (``speculators.utils.loading``
``load_model_layers``). It finds tensors by exact name, then by the *shortest key ending with
the name*. A Kimi-K2.5 checkpoint stores them as ``language_model.model.embed_tokens.weight``,
``language_model.lm_head.weight`` and ``language_model.model.norm.weight`` beside a vision
tower, so speculators would find them only through that suffix fallback, would load a
multimodal ``kimi_k25`` config, and would record a 1 TB model folder in every checkpoint.

For such a verifier eagleflow writes a *verifier head* folder inside the training folder: a
plain text ``config.json`` (``deepseek_v3`` for Kimi, no remote code, no quantization block) and a
``model.safetensors`` holding exactly the three tensors under their plain names. speculators
is pointed at it, so checkpoints stay loadable wherever the training folder goes. A verifier
with plain names and a plain config is used as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagleflow.verifier import EMBED, LM_HEAD, NORM, VerifierWeights, locate_weights, read_config, read_weight, text_config_of
from eagleflow.errors import UserError
from eagleflow.files import atomic_folder

HEAD_MANIFEST = "eagleflow-verifier-head.json"
# Remote-code model types transformers maps onto a native config class.
_NATIVE_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}
# Config keys that describe the full model, not the three tensors of the head folder.
_DROPPED_KEYS = ("auto_map", "quantization_config", "_name_or_path")


def head_config(config: dict[str, Any]) -> dict[str, Any]:
    """The plain text config for the head folder: the nested text config if any, made native."""
    out = dict(text_config_of(config))
    for key in _DROPPED_KEYS:
        out.pop(key, None)
    model_type = out.get("model_type")
    out["model_type"] = _NATIVE_MODEL_TYPES.get(model_type, model_type)
    # The verifier's own architecture name stays on record (speculators copies it into the
    # checkpoint's verifier block); AutoConfig goes by model_type, not by this.
    out["architectures"] = config.get("architectures") or out.get("architectures") or []
    from transformers import CONFIG_MAPPING

    if out["model_type"] not in CONFIG_MAPPING:
        raise UserError(
            f"verifier text config has model_type {model_type!r}, which transformers does not know; "
            f"a head folder cannot be made for it"
        )
    return out


def needs_head(model_dir: Path) -> bool:
    """Whether speculators should get a head folder instead of ``model_dir`` itself."""
    config = read_config(model_dir)
    return text_config_of(config) is not config or "auto_map" in config or not locate_weights(model_dir).plain


def _source_signature(model_dir: Path, weights: VerifierWeights) -> dict[str, Any]:
    """What the head folder was made from: the source path and its files' sizes and mtimes."""
    files = sorted({"config.json", *weights.files.values()})
    return {
        "source": str(model_dir),
        "keys": {"embed": weights.embed_key, "lm_head": weights.lm_head_key, "norm": weights.norm_key},
        "files": {name: [(model_dir / name).stat().st_size, int((model_dir / name).stat().st_mtime)] for name in files},
    }


def prepare_verifier(model_dir: Path, head_dir: Path) -> Path:
    """The absolute verifier path to give speculators: ``model_dir``, or a head folder made from it.

    The head folder is rebuilt only when its manifest does not match the source files; it is
    assembled in a temporary sibling folder and renamed into place, so it is complete or absent.
    """
    model_dir = Path(model_dir).absolute()
    if not model_dir.is_dir():
        raise UserError(f"--verifier {model_dir} is not a folder")
    if not needs_head(model_dir):
        return model_dir
    head_dir = Path(head_dir).absolute()
    weights = locate_weights(model_dir)
    signature = _source_signature(model_dir, weights)
    manifest = head_dir / HEAD_MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()) == signature:
        print(f"verifier head {head_dir} is up to date (from {model_dir})", flush=True)
        return head_dir

    from safetensors.torch import save_file

    config = head_config(read_config(model_dir))
    config["tie_word_embeddings"] = weights.lm_head_key is None
    print(f"writing verifier head {head_dir} from {model_dir} (embedding, LM head, final norm)", flush=True)
    tensors = {}
    for plain, key in ((EMBED, weights.embed_key), (LM_HEAD, weights.lm_head_key), (NORM, weights.norm_key)):
        if key is None:
            continue  # tied LM head: speculators falls back to the embedding, as the verifier does
        tensors[plain] = read_weight(model_dir, weights, key)
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    if tuple(tensors[EMBED].shape) != (vocab, hidden):
        raise UserError(
            f"--verifier {model_dir}: {weights.embed_key} has shape {list(tensors[EMBED].shape)}, "
            f"but the text config says vocab_size {vocab} x hidden_size {hidden}"
        )

    with atomic_folder(head_dir) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (staging / HEAD_MANIFEST).write_text(json.dumps(signature, indent=2, sort_keys=True) + "\n")
    print(
        f"verifier head {head_dir}: {weights.embed_key}, {weights.lm_head_key or '(tied)'}, {weights.norm_key} "
        f"from {model_dir} under plain names; text config model_type {config['model_type']}",
        flush=True,
    )
    return head_dir
