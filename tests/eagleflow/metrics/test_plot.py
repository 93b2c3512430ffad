"""The ``plot`` step: four valid chart files, with every TTT step drawn, from any metrics form."""

from __future__ import annotations

import json
import shutil
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from eagleflow.__main__ import main as eagleflow_main
from eagleflow.metrics.reader import read_metrics, ttt_steps
from eagleflow.metrics.plot import accuracy_figure, envelope, loss_figure
from eagleflow.results import RESULT_PREFIX

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
SVG = "{http://www.w3.org/2000/svg}"


def run_plot(metrics: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict, str]:
    code = eagleflow_main(["plot", "--metrics", str(metrics), "--out", str(out), *extra])
    captured = capsys.readouterr()
    results = [line[len(RESULT_PREFIX):] for line in captured.out.splitlines() if line.startswith(RESULT_PREFIX)]
    return code, (json.loads(results[-1]) if results else {}), captured.out + captured.err


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def svg_ids(path: Path) -> set[str]:
    root = ET.parse(path).getroot()  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    return {element.get("id") for element in root.iter() if element.get("id")}


def test_plot_step_writes_four_valid_charts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "train-progress"
    code, result, _ = run_plot(FIXTURES / "metrics.jsonl", out, capsys)
    assert code == 0
    assert result == {
        "png": [str(out / "loss.png"), str(out / "acc.png")],
        "svg": [str(out / "loss.svg"), str(out / "acc.svg")],
    }
    steps = ttt_steps(read_metrics(FIXTURES / "metrics.jsonl"))
    for name in ("loss", "acc"):
        width, height = png_size(out / f"{name}.png")
        assert width >= 900 and height >= 500
        ids = svg_ids(out / f"{name}.svg")
        for k in steps:  # every TTT step has its raw curve, smoothed curve and validation points
            prefixes = [f"loss-ttt{k}"] if name == "loss" else [f"acc-ttt{k}-full", f"acc-ttt{k}-cond"]
            for prefix in prefixes:
                assert {f"{prefix}-raw", f"{prefix}-smoothed", f"{prefix}-val"} <= ids, (name, prefix)
    assert sorted(p.name for p in out.iterdir()) == [".made-from.json", "acc.png", "acc.svg", "loss.png", "loss.svg"]


def test_axes_hold_data_of_every_ttt_step() -> None:
    frame = read_metrics(FIXTURES / "metrics.jsonl")
    steps = ttt_steps(frame)
    train = frame[frame["kind"] == "train"]
    val = frame[frame["kind"] == "val"]

    loss = loss_figure(frame)
    (ax,) = loss.axes[:1]
    lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    for k in steps:
        raw_x, raw_y = lines[f"loss-ttt{k}-raw"].get_data()
        assert len(raw_y) == len(train) and max(raw_y) == pytest.approx(train[f"loss_{k}"].max())
        _, val_y = lines[f"loss-ttt{k}-val"].get_data()
        assert list(val_y) == pytest.approx(val[f"loss_{k}"].tolist())
    assert ax.get_xlabel() and ax.get_ylabel() and loss.texts and loss.legends

    acc = accuracy_figure(frame)
    panels = [a for a in acc.axes if a.get_title().startswith("TTT step")]
    assert [a.get_title() for a in panels] == [f"TTT step {k}" for k in steps]
    for panel, k in zip(panels, steps):
        gids = {line.get_gid(): line for line in panel.get_lines() if line.get_gid()}
        for kind in ("full", "cond"):
            _, y = gids[f"acc-ttt{k}-{kind}-smoothed"].get_data()
            assert len(y) == len(train) and max(y) <= 100
            _, val_y = gids[f"acc-ttt{k}-{kind}-val"].get_data()
            assert list(val_y) == pytest.approx((val[f"{kind}_acc_{k}"] * 100).tolist())
    # Epochs are marked on the x axis: a secondary axis labelled "epoch N" on every panel.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(acc).draw()
    for panel in panels:
        labels = {t.get_text() for top in panel.child_axes for t in top.get_xticklabels()}
        assert {f"epoch {int(e)}" for e in train["epoch"].unique()} <= labels


@pytest.mark.parametrize("name", ["rich.log", "repr.log"])
def test_plot_reads_the_text_forms(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, result, _ = run_plot(FIXTURES / name, tmp_path, capsys)
    assert code == 0 and len(result["png"]) == 2
    assert {f"loss-ttt{k}-smoothed" for k in ttt_steps(read_metrics(FIXTURES / name))} <= svg_ids(tmp_path / "loss.svg")


def test_rerun_overwrites_and_partial_log_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (FIXTURES / "metrics.jsonl").read_text().splitlines(keepends=True)
    partial = tmp_path / "metrics.jsonl"
    # Training "so far": the first third of the records and a torn line being written.
    partial.write_text("".join(lines[: len(lines) // 3]) + lines[len(lines) // 3][:25])
    out = tmp_path / "charts"
    assert run_plot(partial, out, capsys)[0] == 0
    first = (out / "loss.svg").read_text()
    shutil.copyfile(FIXTURES / "metrics.jsonl", partial)
    code, _, output = run_plot(partial, out, capsys)
    assert code == 0 and "charts in" in output
    second = (out / "loss.svg").read_text()
    assert second != first and svg_ids(out / "loss.svg")
    assert sorted(p.name for p in out.iterdir()) == [".made-from.json", "acc.png", "acc.svg", "loss.png", "loss.svg"]  # no temp files

    # The same metrics again (a cleared task): the charts are reused, saying so; --redo-finished draws them again.
    made = (out / "loss.svg").stat().st_mtime_ns
    code, _, output = run_plot(partial, out, capsys)
    assert code == 0 and "plot: reusing the finished result" in output and (out / "loss.svg").stat().st_mtime_ns == made
    code, _, output = run_plot(partial, out, capsys, "--redo-finished")
    assert code == 0 and "reusing" not in output and (out / "loss.svg").stat().st_mtime_ns != made


def test_plot_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, output = run_plot(tmp_path / "missing.jsonl", tmp_path / "out", capsys)
    assert code == 2 and "missing.jsonl does not exist" in output
    (tmp_path / "empty.jsonl").write_text("")
    code, _, output = run_plot(tmp_path / "empty.jsonl", tmp_path / "out", capsys)
    assert code == 2 and "holds no training or validation records yet" in output
    assert not (tmp_path / "out").exists()


def test_envelope_keeps_extremes() -> None:
    import numpy as np

    x = np.arange(10_000, dtype=float)
    y = np.sin(x / 7.0) + (x == 5_000) * 3.0
    ex, ey = envelope(x, y, bins=100)
    assert len(ex) == 200 and ey.max() == pytest.approx(y.max()) and ey.min() == pytest.approx(y.min())
    short_x, short_y = envelope(x[:50], y[:50], bins=100)
    assert len(short_x) == 50 and list(short_y) == list(y[:50])  # short curves are drawn as they are
