"""``export``: a trained checkpoint -> the drafter folders SGLang and vLLM serve.

``python -m eagleflow export --train-dir RUN/train --verifier MODEL --out RUN/drafter``

- ``OUT/sglang/``: what ``--speculative-algorithm EAGLE3 --speculative-draft-model-path`` loads
  (:mod:`eagleflow.export.sglang_drafter`): SGLang's ``config.json`` and the weights under the
  names its ``load_weights`` maps;
- ``OUT/speculators/``: the checkpoint's own format (config and weights, no optimizer state),
  which vLLM loads natively;
- ``OUT/export.json``: what was exported from where, the aux ids SGLang will capture, the draft
  window, and the serving flags.

A checkpoint SGLang would serve as another function than the one trained (``norm_before_residual``
True, a non-Llama draft layer, aux ids its target cannot capture) gets no SGLang folder: with
``--serve-with sglang`` that is an error naming the reason, with ``vllm`` the reason is recorded.
Each folder is assembled beside its target and renamed into place, so it is complete or absent.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.data.verifier import config_int, read_config
from eagleflow.errors import UserError
from eagleflow.export.sglang_drafter import (
    SINCE,
    NotServable,
    captured_layer_ids,
    draft_window_size,
    minimum_sglang,
    sglang_config,
    sglang_features,
    sglang_weights,
)
from eagleflow.export.targets import ServeWith
from eagleflow.files import atomic_folder, atomic_write_json
from eagleflow.layout import TrainLayout
from eagleflow.results import emit_result

EXPORT_MANIFEST = "export.json"
SPECULATORS_FILES = ("config.json", "config.py", "model.safetensors")


@dataclass(frozen=True)
class ServedDrafter:
    """What an engine needs to serve an exported drafter: SGLang's folder, the draft length, the window."""

    path: Path
    num_steps: int
    window: int | None = None
    minimum_sglang: str = ".".join(str(n) for n in SINCE["base"])

    @classmethod
    def from_export(cls, drafter_dir: str | Path, num_steps: int | None = None) -> ServedDrafter:
        """Read ``<drafter_dir>/export.json``; ``num_steps`` overrides the trained draft length."""
        manifest_path = Path(drafter_dir) / EXPORT_MANIFEST
        try:
            sglang = json.loads(manifest_path.read_text())["sglang"]
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"{manifest_path}: no export to serve ({exc}); run eagleflow export first") from exc
        if "path" not in sglang:
            raise UserError(f"{manifest_path}: the drafter has no SGLang folder: {sglang.get('refused')}")
        return cls(
            Path(sglang["path"]), int(num_steps or sglang["num_steps"]), sglang.get("draft_window_size"), sglang["minimum_sglang"]
        )


class ExportConfig(BaseModel):
    """Flags of ``python -m eagleflow export``."""

    verifier: Path = Field(description="the verifier model folder (its architecture decides the aux ids SGLang captures)")
    out: Path = Field(description="drafter folder: sglang/, speculators/, export.json")
    train_dir: Path | None = Field(None, description="training folder; its best checkpoint is exported (result.json)")
    checkpoint: Path | None = Field(None, description="a speculators checkpoint folder to export instead of --train-dir's best")
    serve_with: ServeWith = Field("sglang", description="sglang: the SGLang folder is required; vllm: only the speculators one")


def chosen_checkpoint(cfg: ExportConfig) -> Path:
    """``--checkpoint``, else the best checkpoint the training step recorded in ``--train-dir``."""
    if cfg.checkpoint is not None:
        return cfg.checkpoint.absolute()
    if cfg.train_dir is None:
        raise UserError("give --checkpoint or --train-dir")
    result = TrainLayout(cfg.train_dir).result
    try:
        return Path(json.loads(result.read_text())["best_checkpoint"])
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"--train-dir {cfg.train_dir}: no finished training ({result}: {exc})") from exc


def export_speculators(checkpoint: Path, target: Path) -> Path:
    """The checkpoint's config and weights, without optimizer or trainer state."""
    with atomic_folder(target) as staging:
        for name in SPECULATORS_FILES:
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, staging / name)
    return target


def export_sglang(checkpoint: Path, verifier: Path, target: Path) -> dict[str, Any]:
    """SGLang's folder for ``checkpoint``; returns what ``export.json`` says about it.

    :raises NotServable: SGLang would not compute what was trained.
    """
    from safetensors.torch import load_file, save_file

    checkpoint_config = json.loads((checkpoint / "config.json").read_text())
    architecture = (read_config(verifier).get("architectures") or ["?"])[0]
    config = sglang_config(checkpoint_config, architecture, config_int(verifier, "hidden_size"))
    window = draft_window_size(checkpoint_config["transformer_layer_config"])
    weights = sglang_weights(load_file(str(checkpoint / "model.safetensors")))
    with atomic_folder(target) as staging:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return {
        "path": str(target),
        "target_architecture": architecture,
        "eagle_aux_hidden_state_layer_ids": sglang_ids,
        "captures_layers": captured_layer_ids(sglang_ids, architecture),
        "draft_window_size": window,
        "num_steps": _proposal_steps(checkpoint_config),
        "minimum_sglang": minimum_sglang(config),
        "sglang_features": sglang_features(config),
        "weights": sorted(weights),
    }


def _proposal_steps(checkpoint_config: dict[str, Any]) -> int:
    """The draft length the drafter was trained for (its TTT steps), a natural --speculative-num-steps."""
    methods = (checkpoint_config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 3)


def export(cfg: ExportConfig) -> dict[str, Any]:
    """Write both folders and ``export.json``; return the manifest."""
    checkpoint = chosen_checkpoint(cfg)
    if not (checkpoint / "config.json").is_file() or not (checkpoint / "model.safetensors").is_file():
        raise UserError(f"{checkpoint} is not a speculators checkpoint (config.json + model.safetensors)")
    out = cfg.out.absolute()
    manifest: dict[str, Any] = {"checkpoint": str(checkpoint), "serve_with": cfg.serve_with}
    manifest["speculators"] = {"path": str(export_speculators(checkpoint, out / "speculators"))}
    try:
        manifest["sglang"] = export_sglang(checkpoint, cfg.verifier.absolute(), out / "sglang")
    except NotServable as exc:
        shutil.rmtree(out / "sglang", ignore_errors=True)
        if cfg.serve_with == "sglang":
            raise UserError(f"{checkpoint} cannot be served by SGLang: {exc.reason}") from exc
        manifest["sglang"] = {"refused": exc.reason}
    atomic_write_json(out / EXPORT_MANIFEST, manifest)
    sglang = manifest["sglang"]
    print(
        f"export: {checkpoint} -> {out}/speculators (vLLM)"
        + (
            f" and {out}/sglang (SGLang; aux ids {sglang['eagle_aux_hidden_state_layer_ids']} capture the input of "
            f"layers {sglang['captures_layers']} of the {sglang['target_architecture']} target)"
            if "path" in sglang
            else f"; no SGLang folder: {sglang['refused']}"
        ),
        flush=True,
    )
    return manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ExportConfig)


def main(args: argparse.Namespace) -> int:
    manifest = export(model_from_args(ExportConfig, args))
    emit_result({"drafter": str(Path(manifest["speculators"]["path"]).parent), "sglang": manifest["sglang"].get("path")})
    return 0
