"""Step ``plot``: loss and accuracy charts (PNG + SVG) from training metrics.

``python -m eagleflow plot --metrics <run>/train/metrics.jsonl --out <run>/train-progress``
writes ``loss.{png,svg}`` and ``acc.{png,svg}`` (a block drafter's: ``loss``, ``eal`` and
``acc``) and prints ``{"png": [...], "svg": [...]}`` as its result line (the XCom payload of
docs/design.md §3.5). Any of the three metric forms of :mod:`eagleflow.metrics` is accepted, and a
log that is still being written is fine: the charts show the run so far. Every file is
published atomically, so a page showing the charts never reads half a PNG, and a re-run simply
replaces them (and removes a chart of the other drafter kind left in the folder).

Every curve is the raw training curve (faint), a smoothed line over it and the validation value
of each epoch as a marker; epochs are marked along the x axis. An EAGLE-3 drafter's charts have
a curve per TTT step: its loss, and its full and conditional accuracy (a panel per step). A block
drafter's (DFlash, :mod:`eagleflow.metrics.records`): the loss and each loss term; the expected
accept length ``eal``; the accuracy of each block slot and of all slots together (``full_acc``),
drawn by :mod:`eagleflow.metrics.block_plot` with the parts here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from eagleflow.config import RedoFinished, add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.files import atomic_path
from eagleflow.metrics.reader import block_positions, drafter_of, read_metrics, ttt_steps
from eagleflow.results import emit_result

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

CHARTS = ("loss", "acc")  # an EAGLE-3 drafter's
BLOCK_CHARTS = ("loss", "eal", "acc")  # a block drafter's
FORMATS = ("png", "svg")
# A chart is ~1100 pixels wide: a raw curve longer than this many bins is drawn as the
# min/max of each bin (looks identical, and 30K points would make a slow multi-MB SVG), and a
# smoothed curve is thinned to this many points.
MAX_BINS = 1200
PNG_DPI = 110

FULL_COLOR = "#1f77b4"
COND_COLOR = "#d62728"


class PlotConfig(BaseModel):
    """Flags of ``python -m eagleflow plot``."""

    metrics: Path = Field(description="metrics file: metrics.jsonl, or a log with speculators' Rich or raw-dict output")
    out: Path = Field(
        description="folder for loss.{png,svg} and acc.{png,svg}, and a block drafter's eal.{png,svg} (created if missing)"
    )
    form: Literal["auto", "jsonl", "rich", "repr"] = Field(
        "auto", description="form of the metrics file; auto detects it"
    )
    smooth: int = Field(
        0, ge=0, description="smoothing window in logged steps; 0 picks one from the number of records"
    )
    redo_finished: RedoFinished


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``plot`` step, derived from :class:`PlotConfig`."""
    add_model_arguments(parser, PlotConfig)


def main(args: argparse.Namespace) -> int:
    """Read the metrics, write the chart files, print their paths as the step's result (reused when the metrics did not change)."""
    from eagleflow.reuse import MadeFrom, file_identities, settings_of

    cfg = model_from_args(PlotConfig, args)
    made = MadeFrom("plot", cfg.out.absolute(), {"settings": settings_of(cfg, "out", "redo_finished"), "files": file_identities([cfg.metrics])})
    result = made.reuse_or_none(cfg.redo_finished)
    if result is None:
        result = run(cfg)
        made.save(result, [*result["png"], *result["svg"]])
    emit_result(result)
    return 0


def run(cfg: PlotConfig) -> dict[str, list[str]]:
    """Draw both charts from ``cfg.metrics`` into ``cfg.out``; returns ``{"png": [...], "svg": [...]}``."""
    started = time.monotonic()
    frame = read_metrics(cfg.metrics, form=cfg.form)
    if not len(frame):
        raise UserError(f"{cfg.metrics} holds no training or validation records yet")
    drafter = drafter_of(frame)
    if drafter is None:
        raise UserError(
            f"{cfg.metrics} has records but no per-TTT-step metrics (loss_0, full_acc_0, …) "
            "nor a block drafter's (eal, position_1_acc, …)"
        )
    written = plot_metrics(frame, cfg.out, smooth=cfg.smooth)
    train = frame[frame["kind"] == "train"]
    what = f"TTT steps {ttt_steps(frame)}" if drafter == "eagle3" else f"block drafter, slots {block_positions(frame)}"
    print(
        f"plot: {len(train)} training and {len(frame) - len(train)} validation records, "
        f"{what}, charts in {cfg.out} ({time.monotonic() - started:.1f}s)",
        flush=True,
    )
    return written


def plot_metrics(frame: pd.DataFrame, out_dir: str | Path, smooth: int = 0) -> dict[str, list[str]]:
    """Write the charts of ``frame`` as PNG and SVG into ``out_dir``, atomically: ``loss`` and
    ``acc``, and for a block drafter ``eal`` too (:data:`CHARTS`, :data:`BLOCK_CHARTS`)."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display here, and never a GUI backend in a worker
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written: dict[str, list[str]] = {fmt: [] for fmt in FORMATS}
    if drafter_of(frame) == "block":
        from eagleflow.metrics.block_plot import block_accuracy_figure, block_loss_figure, eal_figure

        builders = (("loss", block_loss_figure), ("eal", eal_figure), ("acc", block_accuracy_figure))
    else:
        builders = (("loss", loss_figure), ("acc", accuracy_figure))
    drawn = {name for name, _ in builders}
    for name in (*CHARTS, *BLOCK_CHARTS):
        if name not in drawn:  # the other drafter kind's chart, from an earlier run into this folder
            for fmt in FORMATS:
                (out_dir / f"{name}.{fmt}").unlink(missing_ok=True)
    for name, build in builders:
        figure = build(frame, smooth=smooth)
        try:
            for fmt in FORMATS:
                target = out_dir / f"{name}.{fmt}"
                with atomic_path(target) as tmp:
                    # The temporary name ends in .tmp, so the format must be given explicitly.
                    figure.savefig(tmp, format=fmt, dpi=PNG_DPI, metadata=_metadata(fmt))
                written[fmt].append(str(target))
        finally:
            plt.close(figure)
    return written


def _metadata(fmt: str) -> dict[str, Any]:
    # A fixed creation date keeps re-rendered SVGs byte-identical for identical data.
    return {"Date": None} if fmt == "svg" else {}


# ---------------------------------------------------------------------------------------
# figures


def smoothing_window(count: int, requested: int = 0) -> int:
    """Window (in logged steps) of the smoothed line: ``requested``, else ~5% of the curve (at most 500)."""
    if requested > 0:
        return requested
    return max(1, min(count // 20, 500))


def _smoothed(values: pd.Series, window: int) -> pd.Series:
    # Centred, so the smoothed line does not lag behind the raw one.
    return values.rolling(window, min_periods=1, center=True).mean()


def _epoch_starts(train: pd.DataFrame) -> list[tuple[float, int]]:
    """(first step, epoch) of every epoch present in the training records."""
    if not len(train) or train["epoch"].isna().all():
        return []
    firsts = train.dropna(subset=["epoch", "step"]).groupby("epoch", sort=True)["step"].min()
    return [(float(step), int(epoch)) for epoch, step in firsts.items()]


def _mark_epochs(ax: Axes, starts: list[tuple[float, int]], label_axis: bool) -> None:
    """A dotted line where each epoch after the first begins; epoch numbers along the top axis."""
    for step, epoch in starts:
        if epoch != starts[0][1]:
            ax.axvline(step, color="0.55", linestyle=":", linewidth=1, zorder=0)
    if label_axis and starts:
        top = ax.secondary_xaxis("top")
        top.set_xticks([step for step, _ in starts], [f"epoch {epoch}" for _, epoch in starts])
        top.tick_params(axis="x", labelsize=8, length=3, colors="0.3")


def _title(fig: Figure, what: str, frame: pd.DataFrame, window: int, explain: str = "", who: str = "EAGLE-3 drafter") -> None:
    """Bold title, then one grey line: how far training is and how to read the lines."""
    train = frame[frame["kind"] == "train"]
    val = frame[frame["kind"] == "val"]
    parts = []
    if len(train):
        last = train.iloc[-1]
        parts.append(f"{len(train)} logged steps, last step {int(last['step'])}")
        if last["epoch"] == last["epoch"]:  # not NaN
            parts.append(f"epoch {int(last['epoch'])}")
    parts.append(f"{len(val)} validation epoch{'s' if len(val) != 1 else ''}")
    parts.append("faint: every logged step" + (f", bold: centred mean over {window} steps" if window > 1 else ""))
    fig.suptitle(f"{who}: {what}", fontsize=13, fontweight="bold")
    subtitle = " · ".join(parts) + (f"\n{explain}" if explain else "")
    fig.text(0.5, 0.94 if not explain else 0.925, subtitle, ha="center", va="center", fontsize=9, color="0.35")


def envelope(x: np.ndarray, y: np.ndarray, bins: int = MAX_BINS) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` reduced to the min and max of ``bins`` consecutive groups (unchanged if short).

    Drawn as a line, the result covers the same pixels as the full noisy curve.
    """
    import numpy as np

    if len(x) <= 2 * bins:
        return x, y
    edges = np.linspace(0, len(x), bins + 1).astype(np.int64)
    starts, stops = edges[:-1], edges[1:] - 1
    low = np.minimum.reduceat(y, starts)
    high = np.maximum.reduceat(y, starts)
    return np.repeat((x[starts] + x[stops]) / 2, 2), np.column_stack([low, high]).ravel()


def _thin(x: np.ndarray, y: np.ndarray, points: int = MAX_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Every n-th point of a smooth curve (keeping the last), at most about ``points`` of them."""
    if len(x) <= points:
        return x, y
    every = -(-len(x) // points)
    keep = list(range(0, len(x), every))
    if keep[-1] != len(x) - 1:
        keep.append(len(x) - 1)
    return x[keep], y[keep]


def _curve(
    ax: Axes,
    train: pd.DataFrame,
    val: pd.DataFrame,
    column: str,
    color: str,
    label: str,
    window: int,
    linestyle: str = "-",
    marker: str = "o",
    gid: str = "",
    scale: float = 1.0,
) -> None:
    """Raw (faint) + smoothed training curve of ``column`` and its validation markers."""
    if column in train.columns:
        data = train[["step", column]].dropna()
        if len(data):
            steps = data["step"].to_numpy(dtype="float64")
            values = data[column].to_numpy(dtype="float64") * scale
            raw = ax.plot(*envelope(steps, values), color=color, alpha=0.22, linewidth=0.8, linestyle=linestyle)[0]
            raw.set_gid(f"{gid}-raw")
            smoothed = _smoothed(data[column], window).to_numpy(dtype="float64") * scale
            line = ax.plot(
                *_thin(steps, smoothed), color=color, linewidth=2, linestyle=linestyle,
                label=f"{label} (train, smoothed)",
            )[0]
            line.set_gid(f"{gid}-smoothed")
    if column in val.columns:
        points = val[["step", column]].dropna()
        if len(points):
            markers = ax.plot(
                points["step"], points[column] * scale, linestyle="none", marker=marker, markersize=7,
                markerfacecolor=color, markeredgecolor="black", markeredgewidth=0.8, zorder=5,
                label=f"{label} (validation, per epoch)",
            )[0]
            markers.set_gid(f"{gid}-val")


def _split(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    train = frame[frame["kind"] == "train"].sort_values("step", kind="stable")
    val = frame[frame["kind"] == "val"].sort_values("step", kind="stable")
    return train, val


def loss_figure(frame: pd.DataFrame, smooth: int = 0) -> Figure:
    """Loss of every TTT step on one axes: one colour per step."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    train, val = _split(frame)
    window = smoothing_window(len(train), smooth)
    steps = ttt_steps(frame)
    fig = Figure(figsize=(10, 5.8), layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0, 1, 0.92))
    ax = fig.add_subplot()
    colors = _step_colors()
    for k in steps:
        _curve(ax, train, val, f"loss_{k}", colors[k % len(colors)], f"TTT step {k}", window, gid=f"loss-ttt{k}")
    _mark_epochs(ax, _epoch_starts(train), label_axis=True)
    ax.set_xlabel("global training step")
    ax.set_ylabel("loss (KL divergence to the verifier)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.01)
    # One entry per colour, then what a line and a dot mean: fewer, clearer entries than
    # labelling every artist.
    handles = [Line2D([], [], color=colors[k % len(colors)], linewidth=3) for k in steps]
    labels = [f"TTT step {k}" for k in steps]
    handles += [
        Line2D([], [], color="0.2", linewidth=2),
        Line2D([], [], linestyle="none", marker="o", markerfacecolor="0.6", markeredgecolor="black"),
    ]
    labels += ["training (smoothed)", "validation (end of epoch)"]
    fig.legend(handles, labels, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False)
    _title(fig, "loss per TTT step", frame, window)
    return fig


def accuracy_figure(frame: pd.DataFrame, smooth: int = 0) -> Figure:
    """Full and conditional accuracy, one panel per TTT step (shared percent axis)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import PercentFormatter

    train, val = _split(frame)
    window = smoothing_window(len(train), smooth)
    steps = ttt_steps(frame)
    fig = Figure(figsize=(max(6.5, 4.4 * len(steps)), 5.4), layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0, 1, 0.885))
    axes = fig.subplots(1, len(steps), sharey=True, squeeze=False)[0]
    starts = _epoch_starts(train)
    for ax, k in zip(axes, steps, strict=True):
        _curve(ax, train, val, f"full_acc_{k}", FULL_COLOR, "full", window, gid=f"acc-ttt{k}-full", scale=100)
        _curve(
            ax, train, val, f"cond_acc_{k}", COND_COLOR, "conditional", window, linestyle="--", marker="s",
            gid=f"acc-ttt{k}-cond", scale=100,
        )
        _mark_epochs(ax, starts, label_axis=True)
        ax.set_title(f"TTT step {k}", fontsize=11)
        ax.set_xlabel("global training step")
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.01)
        ax.yaxis.set_major_formatter(PercentFormatter(100, decimals=0))
    axes[0].set_ylabel("draft token accuracy")
    peaks = [frame[c].max() for k in steps for c in (f"full_acc_{k}", f"cond_acc_{k}") if c in frame.columns]
    top = max([float(p) * 100 for p in peaks if p == p] + [1.0])
    axes[0].set_ylim(0, min(100.0, top * 1.1 + 1))
    handles = [
        Line2D([], [], color=FULL_COLOR, linewidth=2),
        Line2D([], [], color=COND_COLOR, linewidth=2, linestyle="--"),
        Line2D([], [], linestyle="none", marker="o", markerfacecolor=FULL_COLOR, markeredgecolor="black"),
        Line2D([], [], linestyle="none", marker="s", markerfacecolor=COND_COLOR, markeredgecolor="black"),
    ]
    labels = ["full accuracy (training, smoothed)", "conditional accuracy (training, smoothed)",
              "full (validation, end of epoch)", "conditional (validation, end of epoch)"]
    fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=9, frameon=False)
    _title(
        fig, "accuracy per TTT step", frame, window,
        explain="full: share of positions where the draft token is right · "
        "conditional: the same, counting only positions where the earlier TTT steps were right",
    )
    return fig


def _step_colors() -> list[str]:
    return ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
