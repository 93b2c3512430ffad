"""export under faults: a damaged checkpoint or a full disk leaves the earlier export as it was.

Each fault is real: a config.json cut in half, weights truncated on disk, a layer config taken
out of the checkpoint, a tmpfs too small for a second copy, or one where the speculators folder
fits and SGLang's does not (safetensors' Rust writer reports that as its own error, not an OSError). The drafter folder is compared file
by file (inode, mtime, bytes) before and after, and no staging folder may be left beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.errors import UserError
from eagleflow.export.step import ExportConfig, export
from eagleflow.export.manifest import ServedDrafter

from training_data import folder_snapshot as snapshot
from training_data import random_speculators_checkpoint
from training_data import staging_leftovers as leftovers

AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def checkpoint(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_speculators_checkpoint(random_tiny_model, tmp_path_factory.mktemp("ck") / "checkpoint", False, AUX, 256)


def damaged_copy(checkpoint: Path, dest: Path, fault: str) -> Path:
    shutil.copytree(checkpoint, dest)
    if fault == "torn config.json":
        config = dest / "config.json"
        os.truncate(config, config.stat().st_size // 2)
    elif fault == "truncated weights":
        weights = dest / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    elif fault == "missing layer config":
        config = json.loads((dest / "config.json").read_text())
        del config["transformer_layer_config"]
        (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_damaged_checkpoint_is_named_and_the_earlier_export_is_untouched(
    checkpoint: Path, random_tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run" / "drafter"
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out))
    before = snapshot(out)
    faults = {
        "torn config.json": "config.json: not readable JSON",
        "truncated weights": "model.safetensors: not readable safetensors",
        "missing layer config": "config.json: no transformer_layer_config",
    }
    for fault, message in faults.items():
        damaged = damaged_copy(checkpoint, tmp_path / fault.replace(" ", "-"), fault)
        with pytest.raises(UserError, match=message) as caught:
            export(ExportConfig(checkpoint=damaged, verifier=random_tiny_model, out=out))
        assert str(damaged) in str(caught.value) and "damaged" in str(caught.value)
        assert snapshot(out) == before, fault
        assert leftovers(out) == [], fault
    # What the user sees from the step: one line naming the file, exit 2, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "eagleflow", "export", "--checkpoint", str(tmp_path / "truncated-weights"),
         "--verifier", str(random_tiny_model), "--out", str(out)], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"{tmp_path / 'truncated-weights' / 'model.safetensors'}: not readable" in proc.stderr
    assert snapshot(out) == before and leftovers(out) == []
    # The retry with a good checkpoint replaces the folder whole, and clears the staging folder
    # an export killed earlier left (its pid is gone).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (out.parent / f".drafter.staging-{dead}" / "sglang").mkdir(parents=True)
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out))
    assert set(snapshot(out)) == set(before) and leftovers(out) == []


PAGE = 4096  # tmpfs hands out whole pages


def exported_then_filled(disk: Path, checkpoint: Path, verifier: Path, room: dict[str, float]) -> tuple[Path, Path]:
    """An export in ``disk/drafter``, then a filler file leaving free ``room[sub]`` times the pages of
    each of its subfolders (``""``: the whole export), plus a few pages; returns the drafter and the filler."""
    out = disk / "drafter"
    export(ExportConfig(checkpoint=checkpoint, verifier=verifier, out=out))
    pages = {sub: sum(-(-p.stat().st_size // PAGE) * PAGE for p in (out / sub).rglob("*") if p.is_file()) for sub in room}
    left = int(sum(share * pages[sub] for sub, share in room.items())) + 4 * PAGE
    filler = disk / "filler"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * max(shutil.disk_usage(disk).free - left, 0))
    return out, filler


def test_disk_full_during_export_says_no_space_keeps_the_earlier_export_and_the_retry_completes(
    checkpoint: Path, random_tiny_model: Path, small_tmpfs
) -> None:
    disk = small_tmpfs("4m")
    # Leave room for half a second copy: the new folder is built beside the earlier one.
    out, filler = exported_then_filled(disk, checkpoint, random_tiny_model, {"": 0.5})
    before, free = snapshot(out), shutil.disk_usage(disk).free
    with pytest.raises(UserError) as caught:
        export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out))
    message = str(caught.value)
    assert message.startswith(f"no space left on the device of {disk}") and f"an earlier export in {out} is untouched" in message
    assert snapshot(out) == before and leftovers(out) == []
    assert shutil.disk_usage(disk).free == free  # nothing half-written holds the space
    filler.unlink()
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out))
    assert set(snapshot(out)) == set(before) and leftovers(out) == []


def test_disk_full_while_writing_the_sglang_folder_says_no_space_not_a_safetensors_error(
    checkpoint: Path, random_tiny_model: Path, small_tmpfs
) -> None:
    disk = small_tmpfs("4m")
    # Room for the speculators folder and half of SGLang's weights: the Rust writer runs out mid-file.
    out, _ = exported_then_filled(disk, checkpoint, random_tiny_model, {"speculators": 1, "sglang": 0.5})
    before, free = snapshot(out), shutil.disk_usage(disk).free
    proc = subprocess.run(
        [sys.executable, "-m", "eagleflow", "export", "--checkpoint", str(checkpoint), "--verifier", str(random_tiny_model),
         "--out", str(out)], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "SafetensorError" not in proc.stderr, proc.stderr[-2000:]
    assert f"no space left on the device of {disk} (writing {out / 'sglang' / 'model.safetensors'}): " in proc.stderr
    assert "bytes free, the export needs about" in proc.stderr and f"an earlier export in {out} is untouched" in proc.stderr
    assert snapshot(out) == before and leftovers(out) == []
    assert shutil.disk_usage(disk).free == free  # the half-written folder is gone


def test_a_moved_drafter_folder_serves_its_own_files(checkpoint: Path, random_tiny_model: Path, tmp_path: Path) -> None:
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=tmp_path / "a" / "drafter"))
    manifest = json.loads((tmp_path / "a" / "drafter" / "export.json").read_text())
    assert (manifest["sglang"]["path"], manifest["speculators"]["path"]) == ("sglang", "speculators")
    shutil.copytree(tmp_path / "a" / "drafter", tmp_path / "b" / "drafter")
    shutil.rmtree(tmp_path / "a")
    served = ServedDrafter.from_export(tmp_path / "b" / "drafter")
    assert served.path == tmp_path / "b" / "drafter" / "sglang" and (served.path / "model.safetensors").is_file()
    # A manifest of the wrong shape is an error naming it, not a traceback.
    (tmp_path / "b" / "drafter" / "export.json").write_text('{"sglang": []}')
    with pytest.raises(UserError, match="export.json: no export to serve"):
        ServedDrafter.from_export(tmp_path / "b" / "drafter")
