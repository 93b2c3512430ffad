"""``<drafter>/export.json``, the export's manifest, and what a serving engine takes from it.

:mod:`eagleflow.export.step` writes the manifest; :class:`ServedDrafter` is how the engines that
serve the drafter (evaluation's, the launch commands of :mod:`eagleflow.run.launch` and
:mod:`eagleflow.engine.sglang_serving`) read it back. Light (no torch): the engine stage imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagleflow.errors import UserError, excerpt
from eagleflow.sglang_rules import OLDEST_SGLANG

EXPORT_MANIFEST = "export.json"


@dataclass(frozen=True)
class ServedDrafter:
    """What an engine needs to serve an exported drafter: SGLang's folder, the draft length, the window,
    the algorithm (``EAGLE3``, or a block drafter's, ``DFLASH``, ``DSPARK``, whose ``block_size`` is the tokens
    verified per round: SGLang's ``--speculative-num-draft-tokens``)."""

    path: Path
    num_steps: int
    window: int | None = None
    minimum_sglang: str = ".".join(str(n) for n in OLDEST_SGLANG)
    algorithm: str = "EAGLE3"  # manifests written before DFlash say nothing: they are EAGLE-3's
    block_size: int | None = None

    @classmethod
    def from_export(cls, drafter_dir: str | Path, num_steps: int | None = None) -> ServedDrafter:
        """Read ``<drafter_dir>/export.json``; ``num_steps`` overrides the trained draft length.

        The SGLang folder's path is taken relative to ``drafter_dir`` (an absolute one, as exports
        before relocatable folders wrote, is used as written).
        """
        manifest_path = Path(drafter_dir) / EXPORT_MANIFEST
        try:
            sglang = json.loads(manifest_path.read_text(encoding="utf-8"))["sglang"]
            if not isinstance(sglang, dict):
                raise TypeError(f"'sglang' is a {type(sglang).__name__}, not an object")
            if "path" not in sglang:
                raise UserError(f"{manifest_path}: the drafter has no SGLang folder: {sglang.get('refused')}")
            block_size = sglang.get("block_size")
            served = cls(
                Path(drafter_dir).absolute() / sglang["path"], int(num_steps or sglang["num_steps"]),
                sglang.get("draft_window_size"), str(sglang["minimum_sglang"]), str(sglang.get("algorithm", "EAGLE3")),
                int(block_size) if block_size is not None else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{manifest_path}: no export to serve ({excerpt(exc)}); run eagleflow export first") from exc
        if not (served.path / "config.json").is_file():
            raise UserError(f"{manifest_path}: its SGLang folder {served.path} has no config.json; run eagleflow export again")
        return served
