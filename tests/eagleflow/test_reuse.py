"""A finished result is reused only when its files are still there as they were written.

Real files in a real folder: each fault is made on disk (a file deleted, cut short, rewritten,
touched) and the next run's decision and its one line are checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagleflow import reuse
from eagleflow.reuse import MadeFrom


def finished(tmp_path: Path) -> tuple[MadeFrom, Path]:
    """A result folder as export leaves it: a small manifest, a small file in a sub-folder, weights past the hash limit."""
    out = tmp_path / "drafter"
    (out / "sglang").mkdir(parents=True)
    (out / "export.json").write_text('{"sglang": {"path": "sglang"}}')
    (out / "sglang" / "config.json").write_text('{"hidden_size": 64}')
    with open(out / "sglang" / "model.safetensors", "wb") as weights:
        weights.truncate(reuse.HASHED_UP_TO + 1)  # sparse: no bytes written, still recorded by size and time
    made = MadeFrom("export", out, {"settings": {"a": 1}})
    made.save({"drafter": str(out)}, [out])
    return made, out


def test_an_intact_result_is_reused_even_when_its_small_files_were_copied_over(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made, out = finished(tmp_path)
    recorded = json.loads(made.record.read_text())["outputs"]
    assert [e["path"] for e in recorded] == ["export.json", "sglang/config.json", "sglang/model.safetensors"]
    assert "sha256" in recorded[0] and "mtime_ns" in recorded[2] and "sha256" not in recorded[2]
    (out / "export.json").write_text((out / "export.json").read_text())  # same bytes, new modification time
    (out / "notes.txt").write_text("a file the result does not consist of")
    assert made.reuse_or_none(redo=False) == {"drafter": str(out)}
    assert "export: reusing the finished result in" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda out: (out / "sglang" / "model.safetensors").unlink(), "sglang/model.safetensors is missing"),
        (lambda out: os.truncate(out / "sglang" / "model.safetensors", 100),
         f"sglang/model.safetensors has 100 bytes, {reuse.HASHED_UP_TO + 1} when it was made"),
        (lambda out: os.utime(out / "sglang" / "model.safetensors", ns=(1, 1)),
         "sglang/model.safetensors was rewritten since it was made (modification time changed)"),
        (lambda out: (out / "sglang" / "config.json").write_text('{"hidden_size": 32}'),
         "sglang/config.json has other content than when it was made"),
    ],
    ids=["deleted", "truncated", "rewritten-weights", "changed-config"],
)
def test_a_result_not_as_written_is_made_again_saying_what_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage, said: str) -> None:
    made, out = finished(tmp_path)
    damage(out)
    assert made.reuse_or_none(redo=False) is None
    assert capsys.readouterr().out.strip() == f"export: the finished result in {out} is not as it was made: {said}; making it again"


def test_several_files_gone_name_the_first_and_count_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made, out = finished(tmp_path)
    for name in ("export.json", "sglang/config.json"):
        (out / name).unlink()
    assert made.reuse_or_none(redo=False) is None
    assert "export.json is missing (and 1 more of its 3 files differ); making it again" in capsys.readouterr().out


def test_a_record_without_its_files_other_inputs_or_a_redo_are_not_reused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made, out = finished(tmp_path)
    assert MadeFrom("export", out, {"settings": {"a": 2}}).reuse_or_none(redo=False) is None
    assert capsys.readouterr().out == ""  # other inputs: the step just does its work
    record = json.loads(made.record.read_text())
    del record["outputs"]  # as an earlier eagleflow wrote it
    made.record.write_text(json.dumps(record))
    assert made.reuse_or_none(redo=False) is None
    assert "its record does not list the result's files (written by an earlier eagleflow)" in capsys.readouterr().out
    made.save({"drafter": str(out)}, [out])
    assert made.reuse_or_none(redo=True) is None and not made.record.exists()
