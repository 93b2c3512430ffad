"""The sample store: docs/design.md §3.2 files written atomically, validated with reasons, read by speculators."""

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


# ---------------------------------------------------------------------------------------------
# fp8 storage: float8_e4m3fn states and one float32 scale per token (speculators 0.9's fp8 backend)


def test_fp8_files_are_hs_connectors_quantisation_byte_for_byte(tmp_path: Path) -> None:
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    states, ids = make_sample()
    states[2] = 0  # an all-zero token still gets a usable scale
    for source in (states, states.float() * 3.7):
        before = source.clone()
        path = write_sample(tmp_path, 0, source, ids, "fp8")
        assert torch.equal(source, before), "the caller's states are left as they were"
        loaded = load_sample(path)
        values, scales = quantize_tensor_to_fp8(source)
        assert set(loaded) == {"hidden_states", "hidden_states_scales", "token_ids"}
        assert loaded["hidden_states"].dtype == torch.float8_e4m3fn and loaded["hidden_states_scales"].shape == (SEQ, 1, 1)
        assert torch.equal(loaded["hidden_states"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(loaded["hidden_states_scales"], scales)
        restored = dequantize_fp8_tensor(loaded["hidden_states"], loaded["hidden_states_scales"])
        torch.testing.assert_close(restored.float(), source.float(), rtol=0.07, atol=1e-6)
        check = validate(path, ids, SLOTS, HIDDEN, "fp8")
        assert check.ok and check.num_tokens == SEQ


def test_a_file_of_the_other_storage_dtype_is_not_complete(tmp_path: Path) -> None:
    states, ids = make_sample()
    fp8 = write_sample(tmp_path, 0, states, ids, "fp8")
    bf16 = write_sample(tmp_path, 1, states, ids, "bf16")
    for check_values in (True, False):
        wrong = validate(fp8, ids, SLOTS, HIDDEN, "bf16", check_values=check_values)
        assert wrong.state is SampleState.CORRUPT and "stored as fp8, this run stores bf16" in wrong.reason
        assert "stored as bf16, this run stores fp8" in validate(bf16, ids, SLOTS, HIDDEN, "fp8", check_values=check_values).reason
    assert validate(fp8, ids, SLOTS, HIDDEN, "fp8", check_values=False).ok


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("zero_scale", "hidden_states_scales not finite and positive, first at token 3"),
        ("negative_scale", "not finite and positive"),
        ("nan_scale", "not finite and positive"),
        ("inf_scale", "not finite and positive"),
        ("scale_shape", "hidden_states_scales torch.float32 (7, 1)"),
        ("scale_dtype", "hidden_states_scales torch.bfloat16"),
        ("no_scales", "tensors ['hidden_states', 'token_ids']"),
        ("nan_value", "non-finite values: 1 NaN in slots [1]"),
    ],
)
def test_each_corrupt_fp8_case_is_detected_with_its_reason(tmp_path: Path, case: str, reason: str) -> None:
    states, ids = make_sample()
    tensors = load_sample(write_sample(tmp_path, 0, states, ids, "fp8"))
    scales = tensors["hidden_states_scales"]
    if case == "zero_scale":
        scales[3] = 0
    elif case == "negative_scale":
        scales[0] = -scales[0]
    elif case == "nan_scale":
        scales[5] = float("nan")
    elif case == "inf_scale":
        scales[1] = float("inf")
    elif case == "scale_shape":
        tensors["hidden_states_scales"] = scales[:, :, 0].contiguous()
    elif case == "scale_dtype":
        tensors["hidden_states_scales"] = scales.to(torch.bfloat16)
    elif case == "no_scales":
        del tensors["hidden_states_scales"]
    elif case == "nan_value":
        raw = tensors["hidden_states"].view(torch.uint8)
        raw[4, 1, 2] = 0x7F  # float8_e4m3fn's NaN
    path = _write_raw(tmp_path / "hs_0.safetensors", tensors)
    check = validate(path, ids, SLOTS, HIDDEN, "fp8")
    assert check.state is SampleState.CORRUPT
    assert reason in check.reason, check.reason


def test_fp8_takes_about_half_the_bytes_per_token(tmp_path: Path) -> None:
    from sglang_patch.sample_file import bytes_per_token

    seq, slots, hidden = 512, 4, 1024
    states = torch.randn(seq, slots, hidden).to(torch.bfloat16)
    ids = torch.arange(seq)
    sizes = {dtype: write_sample(tmp_path, i, states, ids, dtype).stat().st_size for i, dtype in enumerate(("bf16", "fp8"))}
    for dtype, size in sizes.items():
        assert 0 <= size - seq * bytes_per_token(slots, hidden, dtype) < 512, (dtype, size)  # the header on top
    assert sizes["fp8"] / sizes["bf16"] < 0.51
    assert bytes_per_token(slots, hidden, "bf16") == slots * hidden * 2 + 8
    assert bytes_per_token(slots, hidden, "fp8") == slots * hidden + 4 + 8


def test_speculators_fp8_backend_reads_a_stored_fp8_sample(tmp_path: Path) -> None:
    """speculators' fp8 backend (hs_connectors FP8Transfer) inside its own ArrowDataset dequantises our files."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset

    from eagleflow.data.prepare import write_training_dataset

    rows = [make_sample(5), make_sample(9)]
    dataset = tmp_path / "dataset"
    write_training_dataset([ids.tolist() for _, ids in rows], [[1] * 5, [1] * 9], dataset)
    for row, (states, ids) in enumerate(rows):
        write_sample(dataset / "hidden_states", row, states, ids, "fp8")
    data = ArrowDataset(max_len=64, datapath=str(dataset), on_missing="raise", transfer=FP8Transfer(dataset / "hidden_states"))
    for row, (states, ids) in enumerate(rows):
        stored = load_sample(sample_path(dataset / "hidden_states", row))
        expected = dequantize_fp8_tensor(stored["hidden_states"], stored["hidden_states_scales"])
        item = data[row]
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], expected[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], expected[:, -1])
        torch.testing.assert_close(item["verifier_last_hidden_states"], states[:, -1], rtol=0.07, atol=1e-3)


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ('{"master": "127.0.0.1:50051",', "--sample-store: sample store address is not JSON (Expecting property name"),
        ('["127.0.0.1:50051"]', "--sample-store: sample store address is a JSON list, not an object {master, admin, metadata_server, namespace}"),
    ],
)
def test_a_store_address_that_is_not_a_json_object_is_refused_naming_the_flag(tmp_path: Path, address: str, said: str) -> None:
    """What a step is given in --sample-store (the operator's XCom, or a hand-run step): refused when read, not at
    the first sample (it was a JSONDecodeError or an AttributeError traceback there)."""
    from eagleflow.config import model_from_args
    from eagleflow.errors import UserError
    from eagleflow.extract.config import ExtractConfig

    flags = {"dataset": tmp_path, "server": "http://127.0.0.1:9", "dump_dir": tmp_path, "rows": "0:4", "verifier": tmp_path,
             "aux_layer_ids": [1, 2, 3], "manifest": tmp_path / "shard.json", "sample_store": address}
    with pytest.raises(UserError) as refused:
        model_from_args(ExtractConfig, flags)
    assert str(refused.value).startswith(said), refused.value
