"""Whether a shard is already complete, and re-extracting one that is.

A shard is complete when its manifest says ``success`` for every one of its rows and every
row's ``hs_{row}`` file is still there with the bytes the manifest counted. Clearing such a
shard in Airflow would otherwise restart its engine to extract nothing: the operator asks
:func:`complete_shard` first and says so (:func:`already_complete_message`).

Re-extracting a complete shard (``--reextract-complete-shards``) never leaves it without a complete
set of files: its files are first moved aside, one rename each, into
``shards/previous/<name>.partial/``, which becomes ``shards/previous/<name>/`` by one rename once
all are there; the extraction then redoes every row, and the set aside is deleted only when the
new shard is complete (:func:`drop_previous_files`). An attempt that stops half-way resumes the
re-extraction (a retry does not set aside the new rows it already wrote); the old files stay in
``previous/`` until it completes.

Light on purpose (no torch): the Airflow worker asks it before any step starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from eagleflow.extract.manifest import SUCCESS, ShardManifest
from eagleflow.layout import RunLayout
from sglang_patch.sample_format import sample_file_name

PREVIOUS_DIR = "previous"  # beside the shard manifests
PARTIAL_SUFFIX = ".partial"


def complete_shard(manifest_path: Path, hidden_dir: Path, start: int, end: int) -> ShardManifest | None:
    """The manifest of the shard of rows ``start:end`` when the shard is complete, else None.

    Complete: the manifest reads, says ``success`` over exactly these rows with every row
    counted, and the rows' files exist with, together, the bytes it counted. Cheap (one stat
    per row, no file opened); the extractor still validates each file's header before it skips it.
    """
    try:
        manifest = ShardManifest.read(manifest_path)
    except (OSError, ValueError, TypeError):
        return None
    if manifest.state != SUCCESS or (manifest.start, manifest.end) != (start, end) or manifest.total_rows != end - start:
        return None
    size = 0
    for row in range(start, end):
        try:
            size += (hidden_dir / sample_file_name(row)).stat().st_size
        except OSError:
            return None
    return manifest if size == manifest.total_bytes else None


def incomplete_shards(layout: RunLayout, shards: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of the planned ``shards`` (plan_shards' ``{name, start, end}``) of run ``layout`` that are not complete."""
    return [
        str(s["name"]) for s in shards
        if complete_shard(layout.shard_manifest(str(s["name"])), layout.hidden_states, int(s["start"]), int(s["end"])) is None
    ]


def already_complete_message(manifest: ShardManifest, manifest_path: Path, hidden_dir: Path, param: str) -> str:
    """What a cleared, complete shard says it will do: nothing, and how to make it extract again."""
    first, last = sample_file_name(manifest.start), sample_file_name(manifest.end - 1)
    return (
        f"shard {manifest.name} already complete (rows {manifest.start}:{manifest.end}, files {first} … {last} in {hidden_dir}, "
        f"manifest {manifest_path}); nothing to extract — set {param} to re-extract cleared shards "
        "(a run's Params are set when it is triggered: trigger the run again with the same run_name)"
    )


def previous_files_dir(manifest_path: Path) -> Path:
    """Where a re-extraction keeps the shard's former files until the new ones are complete: ``shards/previous/<name>/``."""
    return manifest_path.parent / PREVIOUS_DIR / manifest_path.stem


def set_aside_complete_shard(manifest_path: Path, hidden_dir: Path, start: int, end: int) -> tuple[Path, int] | None:
    """Before a forced re-extraction: move the shard's files aside; ``(folder, files moved)``, or None when nothing was.

    Nothing is moved when the shard is not complete (an ordinary extraction resumes it) or when
    a re-extraction of it is already under way (its set-aside folder exists and the shard is not
    complete: the files in place are the new extraction's). A set-aside interrupted half-way
    (``<name>.partial`` exists) is finished. A set-aside folder left beside a complete shard is
    from a re-extraction that completed but stopped before deleting it: it is deleted first.
    """
    aside = previous_files_dir(manifest_path)
    partial = aside.with_name(aside.name + PARTIAL_SUFFIX)
    complete = complete_shard(manifest_path, hidden_dir, start, end) is not None
    if aside.exists():
        if not complete:
            return None
        shutil.rmtree(aside)
    if not complete and not partial.exists():
        return None
    partial.mkdir(parents=True, exist_ok=True)
    for row in range(start, end):
        source = hidden_dir / sample_file_name(row)
        if source.exists():
            os.replace(source, partial / source.name)  # one rename: the file is either here or there
    os.replace(partial, aside)  # the whole set is aside: from now on the shard's files are the new extraction's
    return aside, sum(1 for _ in aside.iterdir())


def drop_previous_files(manifest_path: Path) -> Path | None:
    """Once the re-extracted shard is complete: delete its former files; the folder deleted, or None."""
    aside = previous_files_dir(manifest_path)
    if not aside.exists():
        return None
    shutil.rmtree(aside)
    if not any(aside.parent.iterdir()):  # no other shard's re-extraction under way
        aside.parent.rmdir()
    return aside
