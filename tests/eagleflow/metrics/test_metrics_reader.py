"""The metrics reader: the three forms of a real CPU training run, and the edge cases of each.

``tests/fixtures/metrics/`` is made by ``scripts/make_metrics_fixture.py`` from one seeded
tiny training logged three ways (see its README). Extra cases are rendered here through
speculators' own ``FormatDictFilter`` and Rich's ``RichHandler``, so the text is exactly what
speculators prints.
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from eagleflow.errors import UserError
from eagleflow.metrics.reader import (
    BASE_COLUMNS,
    detect_form,
    latest_metrics,
    parse_jsonl,
    parse_metrics,
    parse_repr_log,
    parse_rich_log,
    read_metrics,
    ttt_steps,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
FORMS = {"jsonl": "metrics.jsonl", "rich": "rich.log", "repr": "repr.log"}


@pytest.fixture(scope="module")
def frames() -> dict[str, pd.DataFrame]:
    return {form: read_metrics(FIXTURES / name) for form, name in FORMS.items()}


def rich_text(messages: list[dict[str, Any]], width: int = 80) -> str:
    """``messages`` as speculators' Rich handler prints them on a ``width``-column console."""
    from rich.console import Console
    from rich.logging import RichHandler
    from speculators.train.logger import FormatDictFilter

    out = io.StringIO()
    handler = RichHandler(console=Console(file=out, width=width, color_system=None))
    handler.addFilter(FormatDictFilter())
    handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    logger = logging.getLogger(f"test.speculators.metrics.{width}")
    logger.handlers, logger.propagate, logger.level = [handler], False, logging.INFO
    for message in messages:
        logger.info(message)
    return out.getvalue()


def train_dict(step: int, epoch: int = 0, lr: Any = 3e-5, steps: int = 3) -> dict[str, Any]:
    train: dict[str, float] = {"loss": 0.0}
    for k in range(steps):
        train |= {f"loss_{k}": 5.0 - 0.1 * step + k, f"kl_div_{k}": 5.0, f"full_acc_{k}": 0.01 * step,
                  f"cond_acc_{k}": 0.02 * step}
        train["loss"] += train[f"loss_{k}"]
    return {"train": train, "profile": {"step_ms": 1500.0, "tokens_per_s": 1234.5}, "epoch": epoch, "lr": lr,
            "global_step": step}


def val_dict(epoch: int, steps: int = 3) -> dict[str, Any]:
    return {"val": {f"{name}_{k}_epoch": 0.5 + k for k in range(steps) for name in ("loss", "full_acc", "cond_acc")}
            | {"loss_epoch": 4.5}, "epoch": epoch}


# ---------------------------------------------------------------------------------------
# the real training run, three ways


def test_fixture_forms_are_detected() -> None:
    for form, name in FORMS.items():
        assert detect_form((FIXTURES / name).read_text()) == form, name


def test_fixture_forms_hold_the_same_records(frames: dict[str, pd.DataFrame]) -> None:
    jsonl = frames["jsonl"]
    assert len(jsonl) > 10 and set(jsonl["kind"]) == {"train", "val"}
    steps = ttt_steps(jsonl)
    assert len(steps) >= 2 and steps == list(range(len(steps)))
    for form in ("rich", "repr"):
        other = frames[form]
        assert ttt_steps(other) == steps, form
        for kind in ("train", "val"):
            a = jsonl[jsonl["kind"] == kind].reset_index(drop=True)
            b = other[other["kind"] == kind].reset_index(drop=True)
            assert len(a) == len(b), (form, kind)
            assert a["epoch"].tolist() == b["epoch"].tolist(), (form, kind)
            if kind == "train":
                assert a["step"].tolist() == b["step"].tolist(), form
            columns = ["loss"] + [f"{m}_{k}" for k in steps for m in ("loss", "full_acc", "cond_acc")]
            # The Rich form prints 3 decimals (or 3 significant digits in e-notation).
            tolerance = 6e-3 if form == "rich" else 1e-9
            for column in columns:
                pd.testing.assert_series_equal(a[column], b[column], check_names=False, rtol=tolerance, atol=6e-4)


def test_fixture_columns_are_normalised(frames: dict[str, pd.DataFrame]) -> None:
    for form, frame in frames.items():
        assert list(frame.columns[: len(BASE_COLUMNS)]) == BASE_COLUMNS, form
        assert frame["kind"].map(type).eq(str).all()
        for column in frame.columns.drop("kind"):
            assert frame[column].dtype == "float64", (form, column)
        train = frame[frame["kind"] == "train"]
        assert train["step"].is_monotonic_increasing and train["step"].notna().all(), form
        assert train["lr"].notna().all() and train["lr"].ge(0).all(), form
        # Validation records carry a step, after the last training step of their epoch.
        for _, val in frame[frame["kind"] == "val"].iterrows():
            epoch_steps = train[train["epoch"] == val["epoch"]]["step"]
            assert val["step"] > epoch_steps.max(), form
        assert not any(c.startswith(("train/", "val/", "profile/")) or c.endswith("_epoch") for c in frame.columns)


def test_latest_metrics_of_the_fixture(frames: dict[str, pd.DataFrame]) -> None:
    frame = frames["jsonl"]
    latest = latest_metrics(frame)
    json.dumps(latest)  # plain JSON for the UI
    last_train = frame[frame["kind"] == "train"].iloc[-1]
    last_val = frame[frame["kind"] == "val"].iloc[-1]
    assert latest["records"] == len(frame) and latest["drafter"] == "eagle3" and latest["positions"] == []
    assert "eal" not in latest["train"] and "eal" not in latest["val"]
    assert latest["train"]["step"] == last_train["step"] and latest["val"]["epoch"] == last_val["epoch"]
    assert [e["ttt_step"] for e in latest["ttt"]] == ttt_steps(frame)
    assert latest["ttt"][0]["train_full_acc"] == pytest.approx(last_train["full_acc_0"])
    assert latest["ttt"][0]["val_loss"] == pytest.approx(last_val["loss_0"])


# ---------------------------------------------------------------------------------------
# jsonl


def test_jsonl_torn_last_line_is_skipped() -> None:
    text = (FIXTURES / "metrics.jsonl").read_text()
    complete = parse_jsonl(text)
    torn = text + '{"kind": "train", "step": 999, "los'
    assert len(parse_jsonl(torn)) == len(complete)


def test_jsonl_bad_line_names_the_line() -> None:
    lines = (FIXTURES / "metrics.jsonl").read_text().splitlines(keepends=True)
    broken = "".join(lines[:3]) + "not json\n" + "".join(lines[3:])
    with pytest.raises(UserError, match=r"fixture.jsonl line 4: not a JSON object"):
        parse_jsonl(broken, source="fixture.jsonl")
    with pytest.raises(UserError, match=r"line 2: expected a JSON object, got list"):
        parse_jsonl(lines[0] + "[1, 2]\n")


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        read_metrics(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    empty = read_metrics(tmp_path / "empty.jsonl")
    assert len(empty) == 0 and list(empty.columns) == BASE_COLUMNS
    assert latest_metrics(empty) == {"records": 0, "drafter": None, "train": None, "val": None, "ttt": [], "positions": []}
    with pytest.raises(UserError, match="unknown metrics form 'xml'"):
        parse_metrics("", form="xml")


# ---------------------------------------------------------------------------------------
# Rich


@pytest.mark.parametrize("width", [40, 60, 80, 200])
def test_rich_wrapping_at_any_width_parses_the_same(width: int) -> None:
    messages = [train_dict(0), train_dict(1), val_dict(0), train_dict(2, epoch=1)]
    text = rich_text(messages, width=width)
    if width <= 60:
        # So narrow that Rich folds tokens mid-word (at 40, one character per row).
        assert any(line.strip() and not line.rstrip().endswith(",") for line in text.splitlines()[1:4])
    frame = parse_rich_log(text)
    assert frame["kind"].tolist() == ["train", "train", "val", "train"]
    assert frame["step"].tolist() == [0, 1, 2, 2]  # validation: the step after the last training one
    assert frame["loss_2"].tolist() == pytest.approx([7.0, 6.9, 2.5, 6.8])
    assert frame["full_acc_1"].iloc[1] == pytest.approx(0.01)  # printed as 1.00e-02
    assert frame["tokens_per_s"].iloc[0] == pytest.approx(1230)  # .2e: 1.23e+03
    assert frame["lr"].iloc[0] == pytest.approx(3e-5)


def test_rich_ignores_other_records_and_takes_adamw_lr() -> None:
    hparams = {"verifier_name_or_path": "/models/tiny", "lr": 3e-5, "epochs": 3}
    text = rich_text([hparams, train_dict(0, lr={"Muon": 3e-4, "AdamW": 3e-5})])
    # A progress bar redrawn with carriage returns can leave a record starting mid-line.
    text = "Resuming training on epoch 3\nEpoch 0:  10%|█     | 1/10\r" + text + "Epoch 0: 100%|██████| 10/10\n"
    frame = parse_rich_log(text)
    assert frame["kind"].tolist() == ["train"]
    assert frame["lr"].iloc[0] == pytest.approx(3e-5)
    assert frame["lr_Muon"].iloc[0] == pytest.approx(3e-4)


def test_rich_record_cut_off_at_the_end_is_skipped() -> None:
    text = rich_text([train_dict(0), train_dict(1)])
    lines = text.splitlines(keepends=True)
    second = max(i for i, line in enumerate(lines) if "INFO" in line)
    cut = "".join(lines[: second + 2])  # the second record's first two lines only
    assert parse_rich_log(cut)["step"].tolist() == [0]
    assert parse_rich_log(text[:-10])["step"].tolist() == [0]  # mid-line: the torn line is dropped


def test_rich_with_ansi_colours() -> None:
    plain = rich_text([train_dict(0)])
    coloured = plain.replace("INFO", "\x1b[34mINFO\x1b[0m").replace("train/", "\x1b[1mtrain/\x1b[0m", 2)
    pd.testing.assert_frame_equal(parse_rich_log(coloured), parse_rich_log(plain))


# ---------------------------------------------------------------------------------------
# raw repr


def test_repr_with_nan_and_host_prefix() -> None:
    message = train_dict(4)
    message["train"]["cond_acc_0"] = math.nan
    lines = [
        f"INFO:speculators.metrics:{message!r}",
        f"[2026-11-30T16:00:00] INFO - speculators.metrics - {val_dict(0)!r}",  # another host format
        "INFO:speculators:Found checkpoint at /x/2",
    ]
    frame = parse_repr_log("\n".join(lines) + "\n")
    assert frame["kind"].tolist() == ["train", "val"]
    assert math.isnan(frame["cond_acc_0"].iloc[0]) and frame["step"].tolist() == [4, 5]
    assert detect_form("\n".join(lines)) == "repr"


def test_repr_bad_and_torn_lines() -> None:
    good = f"INFO:speculators.metrics:{train_dict(0)!r}\n"
    assert len(parse_repr_log(good + good[:40])) == 1  # torn last line
    with pytest.raises(UserError, match=r"log line 2: metric dict does not parse"):
        parse_repr_log(good + "INFO:speculators.metrics:{'train': {'loss_0': oops}}\n" + good, source="log")
