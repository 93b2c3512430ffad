"""``export``: a trained checkpoint -> the drafter folders SGLang and vLLM serve.

``python -m eagleflow export --train-dir RUN/train --verifier MODEL --out RUN/drafter``

- ``OUT/sglang/``: what ``--speculative-algorithm … --speculative-draft-model-path`` loads, written by the
  checkpoint's family (its ``speculators_model_type``, looked up in :mod:`eagleflow.drafters`; EAGLE-3's
  :mod:`eagleflow.drafters.eagle3.sglang_export`, DFlash's :mod:`eagleflow.drafters.dflash.sglang_export`):
  SGLang's ``config.json`` and the weights under the names its ``load_weights`` maps;
- ``OUT/speculators/``: the checkpoint's own format (config and weights, no optimizer state),
  which vLLM loads natively;
- ``OUT/export.json``: what was exported from where, the aux ids SGLang will capture, the draft
  window, and the serving flags; its paths are relative to ``OUT``, so the folder can be moved or
  copied and serves its own files.

A checkpoint SGLang would serve as another function than the one trained (``norm_before_residual``
True, a non-Llama draft layer, aux ids its target cannot capture, a draft narrower or wider than
the verifier, q/k/v or MLP biases, rotary settings SGLang computes otherwise) gets no SGLang folder: with
``--serve-with sglang`` that is an error naming the reason, with ``vllm`` the reason is recorded.
The checkpoint is read and checked first (a torn config, truncated weights or a missing layer
config is an error naming the file), then checked against itself: every tensor its config makes
its family's class build must be there with the shape the config gives it, and nothing else
(:mod:`eagleflow.export.tensors`). An aux layer count ``fc`` was not trained for, the weights of
another variant (``fc_norm.*`` under ``norm_before_fc``) or a cut tensor would load in every engine
and serve another function, so such a checkpoint is refused whatever ``--serve-with`` says. The
whole of ``OUT`` is then built beside it, read back, fsynced and swapped in by one rename, so
``OUT`` holds the earlier export or the complete new one, never a mix; a failure (a full disk too,
which safetensors' writer reports as its own error: :func:`eagleflow.export.tensors.save_weights`)
leaves the earlier export untouched.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import RedoFinished, add_model_arguments, model_from_args
from eagleflow.errors import UserError, excerpt
from eagleflow.export.manifest import EXPORT_MANIFEST
from eagleflow.export.tensors import COMMON_CONFIG_KEYS, CheckpointLayout, NotServable, check_tensors
from eagleflow.files import atomic_folder, fsync_path
from eagleflow.layout import TrainLayout
from eagleflow.sglang_rules import ServingEngine
from eagleflow.results import emit_result

SPECULATORS_FILES = ("config.json", "config.py", "model.safetensors")


class ExportConfig(BaseModel):
    """Flags of ``python -m eagleflow export``."""

    verifier: Path = Field(description="the verifier model folder (its architecture decides the aux ids SGLang captures)")
    out: Path = Field(description="drafter folder: sglang/, speculators/, export.json")
    train_dir: Path | None = Field(None, description="training folder; its best checkpoint is exported (result.json)")
    checkpoint: Path | None = Field(None, description="a speculators checkpoint folder to export instead of --train-dir's best")
    serve_with: ServingEngine
    redo_finished: RedoFinished


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


@dataclass(frozen=True)
class Checkpoint:
    """A speculators checkpoint, read and checked before anything is written."""

    folder: Path
    config: dict[str, Any]
    weights: dict[str, Any]

    @property
    def config_path(self) -> Path:
        return self.folder / "config.json"


def checkpoint_layout(speculators_model_type: str) -> CheckpointLayout | None:
    """What a checkpoint of this ``speculators_model_type`` holds, its family's (:mod:`eagleflow.drafters`);
    None for a family eagleflow does not export (its refusal comes with the export)."""
    from eagleflow.drafters import family_of_checkpoint

    try:
        return family_of_checkpoint(speculators_model_type).owner("checkpoint")
    except ValueError:
        return None


def read_checkpoint(folder: Path) -> Checkpoint:
    """Read and check ``folder``'s ``config.json`` and ``model.safetensors``, and the one against the
    other; a damaged one is a :class:`UserError` naming the file and what is wrong, not a parser's traceback."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"{folder} is not a speculators checkpoint (config.json + model.safetensors)")
    damaged = "the checkpoint is damaged; export another checkpoint (--checkpoint) or rerun training"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise UserError(f"{config_path}: not readable JSON ({excerpt(exc)}); {damaged}") from exc
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: expected a JSON object, got {type(config).__name__}; {damaged}")
    layout = checkpoint_layout(str(config.get("speculators_model_type", "eagle3")))
    for key, what in (layout.config_keys if layout else COMMON_CONFIG_KEYS).items():
        if key not in config:
            raise UserError(f"{config_path}: no {key} ({what}); {damaged}")
    layer = config["transformer_layer_config"]
    if not isinstance(layer, dict) or "vocab_size" not in layer:
        raise UserError(f"{config_path}: transformer_layer_config is not a layer config with a vocab_size; {damaged}")
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"{weights_path}: not readable safetensors ({excerpt(exc)}); {damaged}") from exc
    checkpoint = Checkpoint(folder, config, weights)
    if layout is not None:
        try:
            expected = layout.tensors(config)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{config_path}: unusable draft config ({type(exc).__name__}: {excerpt(exc)}); {damaged}") from exc
        check_tensors(expected, weights, weights_path, config_path)
    return checkpoint


def export_speculators(checkpoint: Checkpoint, target: Path) -> None:
    """The checkpoint's config and weights into ``target``, without optimizer or trainer state."""
    target.mkdir()
    for name in SPECULATORS_FILES:
        if (checkpoint.folder / name).is_file():
            shutil.copyfile(checkpoint.folder / name, target / name)
            if (target / name).stat().st_size != (checkpoint.folder / name).stat().st_size:
                raise OSError(f"{target / name}: copy is shorter than {checkpoint.folder / name}")


def check_written(folder: Path) -> None:
    """Read back every ``config.json`` and safetensors header under ``folder`` and fsync each file,
    so the folder swapped in is complete and durable."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
            elif path.suffix == ".safetensors":
                with safe_open(str(path), "pt") as handle:
                    handle.keys()
        except (ValueError, SafetensorError) as exc:
            raise UserError(f"{path}: written but not readable back ({excerpt(exc)})") from exc
        fsync_path(path)
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        fsync_path(sub)


def export_family(checkpoint: Checkpoint) -> Callable[[Checkpoint, Path, Path], dict[str, Any]]:
    """The SGLang export of the checkpoint's family (:mod:`eagleflow.drafters`, by ``speculators_model_type``).

    :raises NotServable: a family eagleflow does not export (its reason).
    """
    from eagleflow.drafters import family_of_checkpoint

    try:
        return family_of_checkpoint(str(checkpoint.config.get("speculators_model_type", "eagle3"))).owner("export")
    except ValueError as exc:
        raise NotServable(str(exc)) from exc


def build_drafter(checkpoint: Checkpoint, cfg: ExportConfig, folder: Path) -> dict[str, Any]:
    """Write ``speculators/``, ``sglang/`` (when servable) and ``export.json`` into ``folder``; return the manifest.

    Paths in the manifest are relative to the drafter folder, so a copied or moved folder serves its own files.
    """
    manifest: dict[str, Any] = {"checkpoint": str(checkpoint.folder), "serve_with": cfg.serve_with}
    export_speculators(checkpoint, folder / "speculators")
    manifest["speculators"] = {"path": "speculators"}
    try:
        manifest["sglang"] = export_family(checkpoint)(checkpoint, cfg.verifier.absolute(), folder / "sglang")
    except NotServable as exc:
        shutil.rmtree(folder / "sglang", ignore_errors=True)
        if cfg.serve_with == "sglang":
            raise UserError(f"{checkpoint.folder} cannot be served by SGLang: {exc.reason}") from exc
        manifest["sglang"] = {"refused": exc.reason}
    (folder / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    check_written(folder)
    return manifest


def export(cfg: ExportConfig) -> dict[str, Any]:
    """Build the whole drafter folder beside ``--out`` and swap it in once everything is written and read back.

    A failure of any kind (a damaged checkpoint, a full disk) leaves an earlier export in ``--out``
    exactly as it was and no staging folder behind; returns the manifest.
    """
    checkpoint = read_checkpoint(chosen_checkpoint(cfg))
    out = cfg.out.absolute()
    try:
        with atomic_folder(out) as staging:
            manifest = build_drafter(checkpoint, cfg, staging)
    except OSError as exc:
        raise UserError(write_failure(exc, out, checkpoint.folder)) from exc
    sglang = manifest["sglang"]
    print(
        f"export: {checkpoint.folder} -> {out}/speculators (vLLM)"
        + (
            f" and {out}/sglang (SGLang {sglang.get('algorithm', 'EAGLE3')}; aux ids "
            f"{sglang.get('eagle_aux_hidden_state_layer_ids', sglang.get('target_layer_ids'))} capture the input of "
            f"layers {sglang['captures_layers']} of the {sglang['target_architecture']} target)"
            if "path" in sglang
            else f"; no SGLang folder: {sglang['refused']}"
        ),
        flush=True,
    )
    return manifest


def write_failure(exc: OSError, out: Path, checkpoint: Path) -> str:
    """What a failed write of the drafter folder tells its user: which folder, how much space, what is kept."""
    kept = f"an earlier export in {out} is untouched" if out.exists() else f"nothing was left in {out.parent}"
    written = out_path(Path(exc.filename), out) if exc.filename else out
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(out.parent).free
        needed = sum(p.stat().st_size for p in checkpoint.glob("*") if p.is_file())
        return (
            f"no space left on the device of {out.parent} (writing {written}): {free} bytes free, the export needs about "
            f"{2 * needed} bytes beside any earlier export (two copies of {checkpoint}'s weights); {kept}. Free space and export again"
        )
    return f"cannot write the drafter folder {out}: {exc.strerror or exc} ({written}); {kept}"


def out_path(path: Path, out: Path) -> Path:
    """``path`` inside the staging folder of ``out`` as the path it was to have in ``out`` (staging is gone by now)."""
    for parent in path.parents:
        if parent.parent == out.parent and parent.name.startswith(f".{out.name}.staging-"):
            return out / path.relative_to(parent)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, ExportConfig)


def main(args: argparse.Namespace) -> int:
    from eagleflow.reuse import MadeFrom, file_identities, settings_of

    cfg = model_from_args(ExportConfig, args)
    out = cfg.out.absolute()
    checkpoint = chosen_checkpoint(cfg)
    made = MadeFrom("export", out, {"settings": settings_of(cfg, "out", "redo_finished"), "checkpoint": str(checkpoint),
                                    "files": file_identities([checkpoint, cfg.verifier / "config.json"])})
    result = made.reuse_or_none(cfg.redo_finished)
    if result is None:
        manifest = export(cfg)
        result = {"drafter": str(out), "sglang": str(out / manifest["sglang"]["path"]) if "path" in manifest["sglang"] else None}
        made.save(result, [out])  # export.json, sglang/, speculators/: checked before a reuse
    emit_result(result)
    return 0
