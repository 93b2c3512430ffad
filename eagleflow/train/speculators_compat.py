"""The speculators internals eagleflow patches, and the versions they are known to hold in.

:mod:`eagleflow.train.speculators_entry` points three device look-ups at the CPU and wraps
speculators' logging setup and model builder to capture metrics. Those are private names: a
release that renames one would make the CPU path crash mid-run or the metrics go silent. So
the entry refuses a speculators version not listed in :data:`KNOWN_VERSIONS`, by name, before
it patches anything, and checks that every name it patches is really there.
Supporting a new release: read its source, then add its version here.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from eagleflow.errors import UserError

# Versions whose internals were read and tested with the patches below.
KNOWN_VERSIONS = ("0.8.1",)

# module -> attributes eagleflow replaces or wraps (``Class.method`` for methods).
PATCHED_NAMES: dict[str, tuple[str, ...]] = {
    "speculators.train.trainer": ("get_local_rank", "Trainer.train_epoch"),
    "speculators.train.checkpointer": ("get_current_device",),
    "speculators.train.cli": ("setup_metric_logger", "setup_root_logger", "build_draft_model", "main"),
    "speculators.train.logger": ("IsRank0Filter",),
    "speculators.train.config": ("TrainConfig.resolve",),
}


def installed_version() -> str:
    """The installed speculators distribution's version (``"missing"`` when not installed)."""
    try:
        return metadata.version("speculators")
    except metadata.PackageNotFoundError:
        return "missing"


def check_speculators(version: str | None = None, check_names: bool = True) -> str:
    """Return the installed version when eagleflow knows it (and, with ``check_names``, every
    patched name exists: that imports speculators, so the step leaves it to its child); else UserError."""
    version = version or installed_version()
    if version not in KNOWN_VERSIONS:
        raise UserError(
            f"speculators {version} is not a version eagleflow knows (it knows {', '.join(KNOWN_VERSIONS)}): "
            "eagleflow patches speculators' device look-ups and logging setup, private names that change between "
            f"releases. Install speculators=={KNOWN_VERSIONS[-1]} (pip install --no-deps, see the README)"
        )
    if not check_names:
        return version
    missing = [f"{module}.{name}" for module, names in PATCHED_NAMES.items() for name in names if not _has(module, name)]
    if missing:
        raise UserError(f"speculators {version} lacks {', '.join(missing)}, which eagleflow patches: a modified install?")
    return version


def _has(module_name: str, dotted: str) -> bool:
    try:
        target: object = importlib.import_module(module_name)
    except ImportError:
        return False
    for part in dotted.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True
