"""The sample store: DESIGN.md §3.2 files written atomically, validated with reasons, read by speculators."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagleflow.extract.sample_store import SampleState, load_sample, publish_dump, sample_path, validate, write_sample

SEQ, SLOTS, HIDDEN = 7, 4, 16


def make_sample(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq)
    states = torch.randn(seq, SLOTS, HIDDEN, generator=generator).to(torch.bfloat16)
    return states, torch.arange(100, 100 + seq, dtype=torch.int64)


def test_round_trip_keeps_tensors_and_format(tmp_path: Path) -> None:
    states, ids = make_sample()
    path = write_sample(tmp_path, 3, states, ids)
    assert path == tmp_path / "hs_3.safetensors"
    loaded = load_sample(path)
    assert set(loaded) == {"hidden_states", "token_ids"}
    assert loaded["hidden_states"].dtype == torch.bfloat16 and loaded["token_ids"].dtype == torch.int64
    assert torch.equal(loaded["hidden_states"], states) and torch.equal(loaded["token_ids"], ids)
    check = validate(path, ids.tolist(), SLOTS, HIDDEN)
    assert check.state is SampleState.COMPLETE and check.num_tokens == SEQ and check.num_bytes == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["hs_3.safetensors"]  # no temp file left


def test_float_states_are_stored_as_bf16(tmp_path: Path) -> None:
    states, ids = make_sample()
    path = write_sample(tmp_path, 0, states.float(), ids.int())
    assert validate(path, ids, SLOTS, HIDDEN).ok


def test_missing_file(tmp_path: Path) -> None:
    check = validate(sample_path(tmp_path, 9), [1, 2], SLOTS, HIDDEN)
    assert check.state is SampleState.MISSING


def _write_raw(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("truncated", "unreadable"),
        ("garbage", "unreadable"),
        ("wrong_shape", "hidden_states shape"),
        ("wrong_slots", "hidden_states shape"),
        ("wrong_dtype", "hidden_states dtype"),
        ("ids_dtype", "token_ids dtype"),
        ("token_mismatch", "token mismatch at position 2"),
        ("short", "hidden_states shape"),
        ("nan", "NaN"),
        ("inf", "Inf"),
        ("extra_tensor", "tensors"),
    ],
)
def test_each_corrupt_case_is_detected_with_its_reason(tmp_path: Path, case: str, reason: str) -> None:
    states, ids = make_sample()
    path = tmp_path / "hs_0.safetensors"
    if case == "truncated":
        write_sample(tmp_path, 0, states, ids)
        path.write_bytes(path.read_bytes()[:-20])
    elif case == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif case == "wrong_shape":
        _write_raw(path, {"hidden_states": states[:, :, :8].contiguous(), "token_ids": ids})
    elif case == "wrong_slots":
        _write_raw(path, {"hidden_states": states[:, :3].contiguous(), "token_ids": ids})
    elif case == "wrong_dtype":
        _write_raw(path, {"hidden_states": states.float(), "token_ids": ids})
    elif case == "ids_dtype":
        _write_raw(path, {"hidden_states": states, "token_ids": ids.int()})
    elif case == "token_mismatch":
        bad = ids.clone()
        bad[2] += 1
        write_sample(tmp_path, 0, states, bad)
    elif case == "short":
        write_sample(tmp_path, 0, states[:-1], ids[:-1])
    elif case == "nan":
        states[1, 2, 3] = float("nan")
        write_sample(tmp_path, 0, states, ids)
    elif case == "inf":
        states[0, 3, 0] = float("inf")
        write_sample(tmp_path, 0, states, ids)
    elif case == "extra_tensor":
        _write_raw(path, {"hidden_states": states, "token_ids": ids, "extra": ids.clone()})
    check = validate(path, ids.tolist(), SLOTS, HIDDEN)
    assert check.state is SampleState.CORRUPT
    assert reason in check.reason


def test_nan_reason_names_the_slot(tmp_path: Path) -> None:
    states, ids = make_sample()
    states[4, 2, 0] = float("nan")
    check = validate(write_sample(tmp_path, 0, states, ids), ids, SLOTS, HIDDEN)
    assert "slots [2]" in check.reason


def test_header_only_check_skips_the_value_scan(tmp_path: Path) -> None:
    states, ids = make_sample()
    states[0, 0, 0] = float("nan")
    path = write_sample(tmp_path, 0, states, ids)
    assert validate(path, ids, SLOTS, HIDDEN, check_values=False).ok
    assert not validate(path, ids, SLOTS, HIDDEN).ok
    path.write_bytes(path.read_bytes()[:-4])
    assert validate(path, ids, SLOTS, HIDDEN, check_values=False).state is SampleState.CORRUPT


def test_write_killed_midway_leaves_no_sample_file(tmp_path: Path) -> None:
    """SIGKILL the writer halfway through a file (header and token ids written, states not): no hs_* appears."""
    script = textwrap.dedent(
        f"""
        import time, torch
        import sglang_patch.sample_file as sf
        real_write, calls = sf._write_all, []
        def write_then_stall(fd, data):
            real_write(fd, data)
            calls.append(len(data))
            if len(calls) == 2:  # header and token ids are in the temp file, the states not yet
                print("WRITING", flush=True)
                time.sleep(60)
        sf._write_all = write_then_stall
        from eagleflow.extract.sample_store import write_sample
        write_sample({str(tmp_path)!r}, 5, torch.zeros(64, 4, 256), torch.arange(64))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "WRITING"
    assert any(tmp_path.iterdir())  # the temp file exists mid-write
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert not list(tmp_path.glob("hs_*.safetensors"))
    assert validate(sample_path(tmp_path, 5), list(range(64)), 4, 256).state is SampleState.MISSING


def test_publish_dump_renames_on_the_same_filesystem(tmp_path: Path) -> None:
    states, ids = make_sample()
    dump = write_sample(tmp_path / "dumps", 0, states, ids).rename(tmp_path / "dumps" / "row0-abc.safetensors")
    inode = dump.stat().st_ino
    target = publish_dump(dump, sample_path(tmp_path / "dataset" / "hidden_states", 0))
    assert target.stat().st_ino == inode and not dump.exists()
    assert validate(target, ids, SLOTS, HIDDEN).ok


def test_speculators_reads_a_stored_sample(tmp_path: Path) -> None:
    """speculators' own reader (hs_connectors FileTransfer + ArrowDataset) gets the right tensors."""
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    from eagleflow.data.prepare import write_training_dataset

    rows = [make_sample(5), make_sample(9)]
    dataset = tmp_path / "dataset"
    write_training_dataset([ids.tolist() for _, ids in rows], [[0, 1, 1, 1, 1], [1] * 9], dataset)
    for row, (states, ids) in enumerate(rows):
        write_sample(dataset / "hidden_states", row, states, ids)

    cached = FileTransfer(dataset / "hidden_states").get_cached(1)
    assert cached is not None and torch.equal(cached["hidden_states"], rows[1][0])

    data = ArrowDataset(max_len=64, datapath=str(dataset), on_missing="raise")
    assert len(data) == 2
    for row, (states, ids) in enumerate(rows):
        item = data[row]
        assert torch.equal(item["input_ids"], ids)
        assert torch.equal(item["hidden_states"], states[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], states[:, -1])
    assert data[0]["loss_mask"].tolist() == [0, 1, 1, 1, 1]


def test_validate_dataset_names_each_incomplete_row(tmp_path: Path) -> None:
    from eagleflow.data.prepare import write_training_dataset
    from eagleflow.extract.sample_store import validate_dataset

    rows = [make_sample(4), make_sample(6), make_sample(5)]
    write_training_dataset([ids.tolist() for _, ids in rows], [[1] * len(ids) for _, ids in rows], tmp_path / "ds")
    for row, (states, ids) in enumerate(rows[:2]):
        write_sample(tmp_path / "ds" / "hidden_states", row, states, ids)
    assert validate_dataset(tmp_path / "ds", SLOTS, HIDDEN) == [(2, "missing: no file")]
    write_sample(tmp_path / "ds" / "hidden_states", 2, *rows[2])
    assert validate_dataset(tmp_path / "ds", SLOTS, HIDDEN) == []
