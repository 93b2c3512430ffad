"""``check-disk``: fail before any extraction when the hidden states cannot fit."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.progress import format_bytes, format_table
from eagleflow.results import emit_result


class DiskCheckConfig(BaseModel):
    """Flags of ``python -m eagleflow check-disk``."""

    folder: Path = Field(description="where the hidden states go (created if missing)")
    needed_bytes: int = Field(ge=0, description="estimated bytes of all hidden states (dataset-stats)")
    disk_margin: float = Field(
        1.1, ge=1.0, title="Disk margin", description="fail early unless free space >= needed bytes × this"
    )


class NotEnoughDisk(UserError):
    """Free space below what the hidden states need; fields say how much of each."""

    def __init__(self, folder: Path, free: int, required: int) -> None:
        self.folder, self.free, self.required = folder, free, required
        super().__init__(
            f"not enough disk for the hidden states in {folder}: {format_bytes(free)} free "
            f"({free:,} bytes), {format_bytes(required)} required ({required:,} bytes incl. margin); "
            "free space or choose another output root"
        )


def bytes_present(folder: Path) -> int:
    """Bytes of the hidden-state files already there (a resumed run needs only the rest)."""
    return sum(p.stat().st_size for p in folder.glob("hs_*.safetensors")) if folder.exists() else 0


def check_disk(cfg: DiskCheckConfig) -> dict[str, Any]:
    """Compare free space with what is still to be written × margin; raise :class:`NotEnoughDisk`."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    present = bytes_present(cfg.folder)
    remaining = max(cfg.needed_bytes - present, 0)
    required = int(remaining * cfg.disk_margin)
    free = shutil.disk_usage(cfg.folder).free
    print(
        format_table(
            [
                ("folder", str(cfg.folder)),
                ("estimated total", format_bytes(cfg.needed_bytes)),
                ("already written", format_bytes(present)),
                (f"required (× {cfg.disk_margin})", format_bytes(required)),
                ("free", format_bytes(free)),
            ]
        ),
        flush=True,
    )
    if free < required:
        raise NotEnoughDisk(cfg.folder, free, required)
    return {"folder": str(cfg.folder), "free_bytes": free, "required_bytes": required, "present_bytes": present}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, DiskCheckConfig)


def main(args: argparse.Namespace) -> int:
    emit_result(check_disk(model_from_args(DiskCheckConfig, args)))
    return 0
