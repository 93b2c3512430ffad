"""A block drafter's metrics (DFlash): speculators' metric dicts -> recorder -> metrics.jsonl -> reader
-> charts and offline estimate, from the dicts of a real DFlash training.

``tests/fixtures/metrics/dflash/metric_dicts.jsonl`` holds every metric dict speculators 0.9.0 logged
in one tiny CPU DFlash training (see its README): block size 4, two loss terms (``ce`` and ``kl_div``).
"""

from __future__ import annotations

import io
import json
import logging
import math
import struct
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from eagleflow.__main__ import main as eagleflow_main
from eagleflow.evaluate.report import offline_estimate
from eagleflow.metrics.block_plot import block_accuracy_figure, block_loss_figure, eal_figure
from eagleflow.metrics.reader import (
    block_positions,
    drafter_of,
    latest_metrics,
    parse_repr_log,
    parse_rich_log,
    read_metrics,
    ttt_steps,
)
from eagleflow.metrics.records import format_record, read_records, train_record, val_record
from eagleflow.results import RESULT_PREFIX
from eagleflow.train.recorder import MetricsRecorder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
DICTS = FIXTURES / "dflash" / "metric_dicts.jsonl"
SLOTS = [1, 2, 3]
POSITIONS = [f"position_{k}_acc" for k in SLOTS]
TRAIN_KEYS = ["kind", "step", "epoch", "lr", "loss", "ce_loss", "kl_div_loss", "eal", "full_acc", *POSITIONS,
              "tokens_per_s", "time"]
VAL_KEYS = ["kind", "step", "epoch", "loss", "ce_loss", "kl_div_loss", "eal", "full_acc", *POSITIONS, "time"]


def logged() -> list[dict[str, Any]]:
    """The fixture's ``{"step", "msg"}`` lines: what speculators logged, in order."""
    return [json.loads(line) for line in DICTS.read_text().splitlines()]


def record(entries: list[dict[str, Any]], path: Path, clock: float = 1_800_000_000.0) -> str:
    """``entries`` logged on a logger the recorder listens to, as speculators logs them; its printed lines."""
    stream = io.StringIO()
    recorder = MetricsRecorder(path, stream=stream, clock=lambda: clock)
    logger = logging.getLogger(f"eagleflow.test.block.{path}")
    logger.handlers, logger.propagate, logger.level = [recorder], False, logging.INFO
    try:
        recorder.begin_epoch(0, 2, 42, 0)
        for entry in entries:
            logger.info(entry["msg"], extra={"step": entry["step"]})
    finally:
        logger.handlers = []
        recorder.close()
    return stream.getvalue()


def rich_text(messages: list[dict[str, Any]], width: int = 120) -> str:
    """``messages`` as speculators' Rich handler prints them on a ``width``-column console."""
    from rich.console import Console
    from rich.logging import RichHandler
    from speculators.train.logger import FormatDictFilter

    out = io.StringIO()
    handler = RichHandler(console=Console(file=out, width=width, color_system=None))
    handler.addFilter(FormatDictFilter())
    handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    logger = logging.getLogger(f"eagleflow.test.block.rich.{width}")
    logger.handlers, logger.propagate, logger.level = [handler], False, logging.INFO
    for message in messages:
        logger.info(message)
    return out.getvalue()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def svg_ids(path: Path) -> set[str]:
    root = ET.parse(path).getroot()  # well-formed XML, or this raises
    return {element.get("id") for element in root.iter() if element.get("id")}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("dflash") / "train" / "metrics.jsonl"
    return path, record(logged(), path)


# ---------------------------------------------------------------------------------------
# the record


def test_the_fixture_is_speculators_dflash_shape() -> None:
    entries = logged()
    train = [e for e in entries if "train" in e["msg"]]
    val = [e for e in entries if "val" in e["msg"]]
    assert len(train) == 84 and [e["step"] for e in val] == [42, 84]
    assert list(train[0]["msg"]["train"]) == ["loss", "ce_loss", "kl_div_loss", "full_acc", *POSITIONS, "eal", "error_records"]
    assert list(val[0]["msg"]["val"]) == [f"{name}_epoch" for name in ("loss", "ce_loss", "kl_div_loss", "full_acc", *POSITIONS, "eal")]


def test_block_records_carry_eal_and_the_accuracies(recorded: tuple[Path, str]) -> None:
    path, _ = recorded
    records = read_records(path)
    entries = logged()
    assert len(records) == len(entries)
    for rec, entry in zip(records, entries, strict=True):
        if rec["kind"] == "train":
            assert list(rec) == TRAIN_KEYS  # this order: loss, its terms, eal, full_acc, slots ascending
            values = entry["msg"]["train"]
            assert rec["lr"] == entry["msg"]["lr"] and rec["tokens_per_s"] == entry["msg"]["profile"]["tokens_per_s"]
            for key in TRAIN_KEYS[4:-2]:
                assert rec[key] == values[key], key
        else:
            assert list(rec) == VAL_KEYS
            for key in VAL_KEYS[3:-1]:
                assert rec[key] == entry["msg"]["val"][f"{key}_epoch"], key
        assert rec["step"] == entry["step"] and rec["epoch"] == entry["msg"]["epoch"]
    assert records[-1]["eal"] == pytest.approx(1.1554054054054053)


def test_one_loss_term_and_an_anchor_slot() -> None:
    """speculators' default DFlash loss has one term (no ``<term>_loss`` key); ``--sample-from-anchor`` adds slot 0."""
    msg = {"train": {"loss": 3.85, "full_acc": 0.0, "position_1_acc": 0.0, "position_2_acc": 0.0, "position_3_acc": 0.0,
                     "eal": 1.0, "error_records": 0.0}, "profile": {"tokens_per_s": 2000.0}, "epoch": 0, "lr": 3e-3,
           "global_step": 0}
    rec = train_record(msg, 0, 5.0, world_size=2)
    assert list(rec) == ["kind", "step", "epoch", "lr", "loss", "eal", "full_acc", *POSITIONS, "tokens_per_s", "time"]
    assert rec["tokens_per_s"] == 4000.0
    val = val_record({"val": {"loss_epoch": 2.4, "full_acc_epoch": 0.5, "position_0_acc_epoch": 1.0,
                              "position_1_acc_epoch": 0.25, "eal_epoch": math.nan}, "epoch": 3}, 99, 6.0)
    assert val == {"kind": "val", "step": 99, "epoch": 3, "loss": 2.4, "eal": None, "full_acc": 0.5,
                   "position_0_acc": 1.0, "position_1_acc": 0.25, "time": 6.0}


def test_eagle3_records_are_unchanged() -> None:
    train = {"loss": 9.0, "kl_div_0": 5.0, "error_records": 0.0}
    for k in range(3):
        train |= {f"loss_{k}": 3.0, f"full_acc_{k}": 0.5, f"cond_acc_{k}": 0.6}
    rec = train_record({"train": train, "profile": {"tokens_per_s": 10.0}, "epoch": 0, "lr": 1e-4}, 7, 1.0)
    steps = [f"{name}_{k}" for k in range(3) for name in ("loss", "full_acc", "cond_acc")]
    assert list(rec) == ["kind", "step", "epoch", "lr", "loss", *steps, "tokens_per_s", "time"]
    assert format_record(rec) == "step 7 epoch 0 lr 1.0e-04 loss 9.0000 acc0 0.500 acc1 0.500 acc2 0.500 10 tok/s"


def test_the_printed_line_shows_eal_and_full_acc_from_the_first_step(recorded: tuple[Path, str]) -> None:
    _, printed = recorded
    lines = printed.splitlines()
    assert lines[0].startswith("step 0 epoch 0 lr 3.0e-03 loss 6.4211 eal 1.000 full_acc 0.000 2338 tok/s [epoch 1/2 step 1/42")
    assert all(" eal " in line and " full_acc " in line for line in lines)
    assert "val epoch 1 step 84 loss 3.0213 eal 1.155 full_acc 0.126" in lines


# ---------------------------------------------------------------------------------------
# the reader


def test_reader_orders_block_columns_and_says_the_drafter(recorded: tuple[Path, str]) -> None:
    frame = read_metrics(recorded[0])
    assert list(frame.columns) == ["kind", "step", "epoch", "time", "lr", "loss", "eal", "full_acc", *POSITIONS,
                                   "ce_loss", "kl_div_loss", "tokens_per_s"]
    assert drafter_of(frame) == "block" and block_positions(frame) == SLOTS and ttt_steps(frame) == []
    latest = latest_metrics(frame)
    json.dumps(latest)
    val = read_records(recorded[0])[-1]
    assert latest["drafter"] == "block" and latest["ttt"] == []
    assert latest["val"] == {"step": 84, "epoch": 1, "loss": val["loss"], "eal": val["eal"], "full_acc": val["full_acc"],
                             "ce_loss": val["ce_loss"], "kl_div_loss": val["kl_div_loss"]}
    assert latest["train"]["eal"] == pytest.approx(frame[frame["kind"] == "train"]["eal"].iloc[-1])
    assert [p["position"] for p in latest["positions"]] == SLOTS
    assert [p["val_acc"] for p in latest["positions"]] == [val[c] for c in POSITIONS]


def test_text_forms_of_block_dicts_read_the_same(tmp_path: Path) -> None:
    """speculators' Rich and raw-repr output of the same dicts give the same block columns."""
    entries = logged()
    entries = entries[:12] + [e for e in entries if "val" in e["msg"]][:1]  # 12 steps and a validation epoch
    record(entries, tmp_path / "metrics.jsonl")
    jsonl = read_metrics(tmp_path / "metrics.jsonl")
    messages = [e["msg"] for e in entries]
    repr_log = "".join(f"INFO:speculators.metrics:{m!r}\n" for m in messages)
    for frame in (parse_repr_log(repr_log), parse_rich_log(rich_text(messages))):
        assert drafter_of(frame) == "block" and block_positions(frame) == SLOTS
        assert frame["kind"].tolist() == jsonl["kind"].tolist()
        for column in ("loss", "eal", "full_acc", *POSITIONS, "ce_loss", "kl_div_loss"):
            # Rich prints .3f / .2e: equal to print precision.
            pd.testing.assert_series_equal(frame[column], jsonl[column], check_exact=False, rtol=6e-3, atol=6e-4)


# ---------------------------------------------------------------------------------------
# the charts


def run_plot(metrics: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, list[str]], str]:
    code = eagleflow_main(["plot", "--metrics", str(metrics), "--out", str(out)])
    captured = capsys.readouterr()
    results = [line[len(RESULT_PREFIX):] for line in captured.out.splitlines() if line.startswith(RESULT_PREFIX)]
    return code, (json.loads(results[-1]) if results else {}), captured.out


def test_plot_draws_loss_eal_and_slot_accuracy(recorded: tuple[Path, str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "train-progress"
    code, result, printed = run_plot(recorded[0], out, capsys)
    assert code == 0 and "block drafter, slots [1, 2, 3]" in printed
    assert result == {fmt: [str(out / f"{name}.{fmt}") for name in ("loss", "eal", "acc")] for fmt in ("png", "svg")}
    for name, prefixes in (("loss", ["loss-total", "loss-ce_loss", "loss-kl_div_loss"]), ("eal", ["eal"]),
                           ("acc", [*(f"acc-pos{k}" for k in SLOTS), "acc-full"])):
        width, height = png_size(out / f"{name}.png")
        assert width >= 900 and height >= 500
        ids = svg_ids(out / f"{name}.svg")
        for prefix in prefixes:
            assert {f"{prefix}-raw", f"{prefix}-smoothed", f"{prefix}-val"} <= ids, (name, prefix)

    # An EAGLE-3 run plotted into the same folder replaces the charts, and leaves no eal chart behind.
    code, result, _ = run_plot(FIXTURES / "metrics.jsonl", out, capsys)
    assert code == 0 and sorted(p.name for p in out.iterdir()) == [".made-from.json", "acc.png", "acc.svg", "loss.png", "loss.svg"]


def test_block_axes_hold_the_records(recorded: tuple[Path, str]) -> None:
    frame = read_metrics(recorded[0])
    train, val = frame[frame["kind"] == "train"], frame[frame["kind"] == "val"]

    def lines(figure: Any) -> dict[str, Any]:
        return {line.get_gid(): line for line in figure.axes[0].get_lines() if line.get_gid()}

    eal = lines(eal_figure(frame))
    assert list(eal["eal-raw"].get_data()[1]) == pytest.approx(train["eal"].tolist())
    assert list(eal["eal-val"].get_data()[1]) == pytest.approx(val["eal"].tolist())
    acc_figure = block_accuracy_figure(frame)
    acc = lines(acc_figure)
    for k in SLOTS:
        assert list(acc[f"acc-pos{k}-val"].get_data()[1]) == pytest.approx((val[f"position_{k}_acc"] * 100).tolist())
    assert list(acc["acc-full-val"].get_data()[1]) == pytest.approx((val["full_acc"] * 100).tolist())
    assert [t.get_text() for t in acc_figure.legends[0].get_texts()][:3] == ["slot 1", "slot 2", "slot 3"]
    loss = lines(block_loss_figure(frame))
    assert list(loss["loss-ce_loss-val"].get_data()[1]) == pytest.approx(val["ce_loss"].tolist())
    assert list(loss["loss-total-val"].get_data()[1]) == pytest.approx(val["loss"].tolist())


def test_a_block_run_without_terms_plots_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One loss term, no validation yet, the record being written: the charts of the run so far."""
    entries = [e for e in logged() if "train" in e["msg"]][:10]
    for entry in entries:
        for term in ("ce_loss", "kl_div_loss"):
            del entry["msg"]["train"][term]
    path = tmp_path / "metrics.jsonl"
    record(entries, path)
    with path.open("a") as handle:
        handle.write('{"kind": "train", "step": 10, "ea')
    code, result, _ = run_plot(path, tmp_path / "charts", capsys)
    assert code == 0 and len(result["png"]) == 3


# ---------------------------------------------------------------------------------------
# the offline estimate


def test_offline_estimate_of_a_block_drafter_is_its_eal(recorded: tuple[Path, str]) -> None:
    last = read_records(recorded[0])[-1]
    estimate = offline_estimate(recorded[0], 3)
    assert estimate == {
        "accept_length": last["eal"],
        "from": "validation epoch 1 (eal over 3 block slots, bonus token included)",
        "method": "eal",
        "position_acc": [last[c] for c in POSITIONS],
    }
    assert offline_estimate(recorded[0], 1)["accept_length"] == last["eal"]  # the figure as it is, whatever the chain
