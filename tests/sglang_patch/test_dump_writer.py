"""The dump writer: byte budget, "writer behind" instead of a stall, verdicts, disk full, status file.

Real threads and real files; the slow disk is the writer's own ``write_delay`` (it sleeps before
each file, so the queue really fills), the full disk a real tmpfs mount.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sglang_patch.dump_writer import DumpWriter, default_queue_budget
from sglang_patch.handoff import DISK_FULL, NONFINITE, TOO_LARGE, WRITER_BEHIND, ErrorRecord, dump_path, error_path, read_writer_statuses
from sglang_patch.sample_file import VALUES_FINITE, VALUES_KEY, sample_file_bytes

SEQ, SLOTS, HIDDEN = 32, 4, 64
ONE = sample_file_bytes(SEQ, SLOTS, HIDDEN)


def states(seed: int = 0, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(seq, SLOTS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def outcome(dump_dir: Path, rid: str) -> str:
    """"dump", the error record's kind, or "none"."""
    if dump_path(dump_dir, rid).exists():
        return "dump"
    if error_path(dump_dir, rid).exists():
        return ErrorRecord.read(error_path(dump_dir, rid)).kind
    return "none"


def test_a_slow_disk_gets_writer_behind_records_not_a_stalled_caller_and_stays_in_budget(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, max_pending_bytes=2 * ONE + ONE // 2, wait_seconds=0.3, threads=1, write_delay=0.6)
    waits, held = [], []
    for i in range(6):
        started = time.monotonic()
        writer.submit(f"row{i}-a", states(i), torch.arange(SEQ))
        waits.append(time.monotonic() - started)
        held.append(writer.status())
    assert max(waits) < 0.3 + 0.25, waits  # never longer than the bound (plus scheduling slack)
    statuses = read_writer_statuses(tmp_path)
    assert len(statuses) == 1 and statuses[0].fresh and statuses[0].pending  # the status file says what is queued
    writer.close()
    kinds = [outcome(tmp_path, f"row{i}-a") for i in range(6)]
    assert kinds.count("dump") >= 2 and WRITER_BEHIND in kinds and "none" not in kinds, kinds
    assert all(s.pending_bytes <= writer.budget for s in held) and writer.status().peak_pending_bytes <= writer.budget
    behind = ErrorRecord.read(error_path(tmp_path, f"row{kinds.index(WRITER_BEHIND)}-a"))
    assert behind.retryable and "writer behind" in behind.error and behind.details["budget_bytes"] == writer.budget
    for i, kind in enumerate(kinds):
        if kind == "dump":
            assert torch.equal(load_file(dump_path(tmp_path, f"row{i}-a"))["hidden_states"], states(i))
    assert not read_writer_statuses(tmp_path), "close removes the status file"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temp file left"


def test_a_request_larger_than_the_whole_budget_is_refused_at_once_naming_the_param(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, max_pending_bytes=ONE - 1, wait_seconds=5)
    started = time.monotonic()
    assert writer.submit("row0-a", states(), torch.arange(SEQ)) is False
    assert time.monotonic() - started < 1
    writer.close()
    record = ErrorRecord.read(error_path(tmp_path, "row0-a"))
    assert record.kind == TOO_LARGE and not record.retryable and "dump_queue_gb" in record.error


def test_non_finite_states_are_never_written_and_finite_ones_carry_the_verdict(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path)
    bad = states(1)
    bad[3, 2, 5] = float("nan")
    bad[4, 2, 6] = float("-inf")
    writer.submit("row1-a", bad, torch.arange(SEQ))
    writer.submit("row2-a", states(2), torch.arange(SEQ))
    writer.close()
    assert outcome(tmp_path, "row1-a") == NONFINITE
    assert "1 NaN, 1 Inf in slots [2]" in ErrorRecord.read(error_path(tmp_path, "row1-a")).error
    with safe_open(str(dump_path(tmp_path, "row2-a")), "pt") as handle:
        assert handle.metadata() == {VALUES_KEY: VALUES_FINITE}


def test_slot_major_buffers_write_the_same_file_as_token_major_states(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path)
    x = states(3)
    pending = writer.begin("row3-a", SEQ, SLOTS, HIDDEN, torch.bfloat16, device="cpu")
    assert pending is not None
    for slot in range(SLOTS):  # filled the way the hook fills it: per slot, in two token chunks
        pending.put(slot, x[:20, slot], start=0)
        pending.put(slot, x[20:, slot], start=20)
    pending.commit(torch.arange(SEQ))
    writer.submit("row4-a", x.clone(), torch.arange(SEQ))
    writer.close()
    assert dump_path(tmp_path, "row3-a").read_bytes() == dump_path(tmp_path, "row4-a").read_bytes()


def test_fp8_dumps_match_the_sample_formats_encoder_from_either_buffer_and_disk_full_names_the_stored_bytes(small_tmpfs) -> None:
    """A writer asked for fp8 writes what the sample format's own encoder makes (from a whole
    tensor and from the hook's slot-major buffer), with the finiteness verdict; "disk full"
    counts the fp8 bytes the file would take, not the bf16 ones."""
    from sglang_patch.sample_file import encode_hidden_states

    folder = small_tmpfs("1m")
    writer = DumpWriter(folder, hidden_states_dtype="fp8")
    x = states(8)
    pending = writer.begin("row8-a", SEQ, SLOTS, HIDDEN, torch.bfloat16, device="cpu")
    assert pending is not None
    for slot in range(SLOTS):
        pending.put(slot, x[:, slot])
    pending.commit(torch.arange(SEQ))
    writer.submit("row9-a", x.clone(), torch.arange(SEQ))
    writer.submit("row10-a", states(10, seq=8192), torch.arange(8192))  # 8192 × 4 × 64 × 1 B = 2 MiB of fp8
    writer.close()
    expected = encode_hidden_states(x, "fp8")
    for rid in ("row8-a", "row9-a"):
        sample = load_file(dump_path(folder, rid))
        assert sample["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(sample["hidden_states"].view(torch.uint8), expected["hidden_states"].view(torch.uint8))
        assert torch.equal(sample["hidden_states_scales"], expected["hidden_states_scales"])
        with safe_open(str(dump_path(folder, rid)), "pt") as handle:
            assert handle.metadata() == {VALUES_KEY: VALUES_FINITE}
    record = ErrorRecord.read(error_path(folder, "row10-a"))
    assert record.kind == DISK_FULL and record.details["needed_bytes"] == sample_file_bytes(8192, SLOTS, HIDDEN, "fp8")


def test_fp8_is_quantised_at_the_source_into_hs_connectors_bytes_and_only_fp8_reaches_the_host(tmp_path: Path) -> None:
    """Kimi-shaped bf16 states through both ways in (the hook's slot-by-slot dump and a whole
    tensor): each file is hs-connectors' quantisation of the same states, bit for bit; the host
    holds only fp8 bytes, scales and ids (the budget says so), never a bf16 buffer."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    seq, slots, hidden = 48, 4, 7168
    x = torch.randn(seq, slots, hidden, generator=torch.Generator().manual_seed(11))
    x = (x * torch.logspace(-20, 20, seq).view(-1, 1, 1)).to(torch.bfloat16)
    x[5] = 0.0
    x[9, 3, 100] = 3e4  # one slot's outlier sets the token's scale for every slot
    stored = sample_file_bytes(seq, slots, hidden, "fp8")
    writer = DumpWriter(tmp_path, hidden_states_dtype="fp8", threads=1, write_delay=1.0)  # both stay queued
    pending = writer.begin("row20-a", seq, slots, hidden, torch.bfloat16, device="cpu")
    assert pending is not None and pending.host is None and writer.status().pending_bytes == stored
    assert pending.staging.dtype == torch.bfloat16 and pending.staging.device.type == "cpu"
    assert {k: v.dtype for k, v in pending.encoded.items()} == {"hidden_states": torch.float8_e4m3fn, "hidden_states_scales": torch.float32}
    for slot in range(slots):  # the hook's order: slot by slot, each in two token pieces
        pending.put(slot, x[:30, slot], start=0)
        pending.put(slot, x[30:, slot], start=30)
    pending.commit(torch.arange(seq))
    assert pending.staging is None, "the staging is given back at commit"
    writer.submit("row21-a", x, torch.arange(seq))
    writer.close()
    assert writer.status().peak_pending_bytes == 2 * stored
    values, scales = quantize_tensor_to_fp8(x)
    for rid in ("row20-a", "row21-a"):
        sample = load_file(dump_path(tmp_path, rid))
        assert torch.equal(sample["hidden_states"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(sample["hidden_states_scales"], scales)
        with safe_open(str(dump_path(tmp_path, rid)), "pt") as handle:
            assert handle.metadata() == {VALUES_KEY: VALUES_FINITE}


def test_non_finite_fp8_states_are_never_written_and_the_record_names_slots_and_tokens(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, hidden_states_dtype="fp8")
    bad = states(12)
    bad[3, 2, 5] = float("nan")
    bad[7, 0, 6] = float("-inf")
    pending = writer.begin("row12-a", SEQ, SLOTS, HIDDEN, torch.bfloat16, device="cpu")
    assert pending is not None
    for slot in range(SLOTS):
        pending.put(slot, bad[:, slot])
    pending.commit(torch.arange(SEQ))
    writer.submit("row13-a", bad, torch.arange(SEQ))
    writer.close()
    for rid in ("row12-a", "row13-a"):
        assert outcome(tmp_path, rid) == NONFINITE
        assert "in slots [0, 2], 2 token(s): 3, 7" in ErrorRecord.read(error_path(tmp_path, rid)).error


def test_default_budget_is_sized_from_the_hosts_memory() -> None:
    import os

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert default_queue_budget() == min(max(memory // 8, 256 << 20), 32 << 30)


def test_disk_full_gives_a_record_naming_folder_and_bytes_and_leaves_no_partial_file(small_tmpfs) -> None:
    folder = small_tmpfs("1m")
    writer = DumpWriter(folder)
    big = states(5, seq=2048)  # 2048 × 4 × 64 × 2 B = 1 MiB of states: more than is free
    writer.submit("row5-a", big, torch.arange(2048))
    writer.submit("row6-a", states(6), torch.arange(SEQ))  # a small one still fits afterwards
    writer.close()
    record = ErrorRecord.read(error_path(folder, "row5-a"))
    assert record.kind == DISK_FULL and str(folder) in record.error
    assert record.details["needed_bytes"] == sample_file_bytes(2048, SLOTS, HIDDEN) and record.details["free_bytes"] < record.details["needed_bytes"]
    assert outcome(folder, "row6-a") == "dump"
    assert sorted(p.name for p in folder.iterdir()) == ["row5-a.error.json", "row6-a.safetensors"]


def test_a_disk_that_fills_up_during_the_write_still_gets_its_record(small_tmpfs) -> None:
    """Free space checked, then the disk fills while the (slow) write is under way: ENOSPC midway.
    The partial file goes, the writer gives up its reserve, and the record still fits."""
    folder = small_tmpfs("1m")
    writer = DumpWriter(folder, write_delay=1.0)
    writer.submit("row7-a", states(7, seq=512), torch.arange(512))  # 256 KiB: fits when checked
    time.sleep(0.3)  # the writer has checked the free space and sleeps before writing
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    (folder / "filler").write_bytes(b"\0" * free)
    writer.close()
    record = ErrorRecord.read(error_path(folder, "row7-a"))
    assert record.kind == DISK_FULL and record.details["needed_bytes"] == sample_file_bytes(512, SLOTS, HIDDEN)
    assert writer.write_errors and "No space left" in writer.write_errors[0]
    assert sorted(p.name for p in folder.iterdir()) == ["filler", "row7-a.error.json"], "no partial file"


def test_flush_waits_for_queued_dumps_and_records(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, write_delay=0.3)
    writer.submit("row7-a", states(7), torch.arange(SEQ))
    writer.submit_error("row8-a", "boom")
    done = threading.Event()
    threading.Thread(target=lambda: (writer.flush(10), done.set()), daemon=True).start()
    assert not done.wait(0.1)
    assert done.wait(5)
    assert outcome(tmp_path, "row7-a") == "dump" and outcome(tmp_path, "row8-a") == "write_failed"
    writer.close()
