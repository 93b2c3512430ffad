"""A block drafter's charts (DFlash): ``loss``, ``eal`` and ``acc`` of :mod:`eagleflow.metrics.plot`.

A block drafter's metrics are per block, not per TTT step (:mod:`eagleflow.metrics.records`): its
loss and each loss term; the expected accept length ``eal``; the accuracy of each block slot
(``position_k_acc``) and of all slots together (``full_acc``). Drawn as the EAGLE-3 charts are:
the raw training curve (faint), a smoothed line over it, the validation value of each epoch as a
marker, epochs marked along the x axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagleflow.metrics.plot import _curve, _epoch_starts, _mark_epochs, _split, _step_colors, _title, smoothing_window
from eagleflow.metrics.reader import block_positions
from eagleflow.metrics.records import loss_terms_of

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["block_accuracy_figure", "block_loss_figure", "eal_figure"]

WHO = "Block drafter"
EAL_COLOR = "#2ca02c"


def _colors(count: int) -> list[str]:
    """``count`` distinct colours: the step colours, or a sequential map for more."""
    if count <= len(_step_colors()):
        return _step_colors()[:count]
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps["viridis"]
    return [to_hex(cmap(i / max(count - 1, 1) * 0.9)) for i in range(count)]


def _legend_tail() -> tuple[list[Any], list[str]]:
    """The legend entries saying what a line and a dot mean."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color="0.2", linewidth=2),
        Line2D([], [], linestyle="none", marker="o", markerfacecolor="0.6", markeredgecolor="black"),
    ]
    return handles, ["training (smoothed)", "validation (end of epoch)"]


def _single_axes(size: tuple[float, float] = (10, 5.8)) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0, 1, 0.92))
    return fig, fig.add_subplot()


def _finish_axes(ax: Axes, train: pd.DataFrame, ylabel: str) -> None:
    _mark_epochs(ax, _epoch_starts(train), label_axis=True)
    ax.set_xlabel("global training step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.01)


def block_loss_figure(frame: pd.DataFrame, smooth: int = 0) -> Figure:
    """A block drafter's loss, and each loss term when it has more than one, on one axes."""
    from matplotlib.lines import Line2D

    train, val = _split(frame)
    window = smoothing_window(len(train), smooth)
    terms = [t for t in loss_terms_of(frame.columns) if frame[t].notna().any()]
    fig, ax = _single_axes()
    colors = _colors(len(terms) + 1)
    _curve(ax, train, val, "loss", colors[0], "loss", window, gid="loss-total")
    handles, labels = [Line2D([], [], color=colors[0], linewidth=3)], ["loss"]
    for index, term in enumerate(terms, start=1):
        _curve(ax, train, val, term, colors[index], term, window, linestyle="--", marker="s", gid=f"loss-{term}")
        handles.append(Line2D([], [], color=colors[index], linewidth=3, linestyle="--"))
        labels.append(f"{term.removesuffix('_loss')} term")
    _finish_axes(ax, train, "loss")
    ax.set_ylim(bottom=0)
    tail = _legend_tail()
    fig.legend(handles + tail[0], labels + tail[1], loc="outside lower center", ncols=len(handles) + 2, fontsize=9,
               frameon=False)
    explain = "loss: the weighted sum of the terms; each term unweighted" if terms else ""
    _title(fig, "loss", frame, window, explain=explain, who=WHO)
    return fig


def eal_figure(frame: pd.DataFrame, smooth: int = 0) -> Figure:
    """A block drafter's expected accept length (speculators' ``eal``)."""
    from matplotlib.lines import Line2D

    train, val = _split(frame)
    window = smoothing_window(len(train), smooth)
    slots = block_positions(frame)
    fig, ax = _single_axes()
    _curve(ax, train, val, "eal", EAL_COLOR, "expected accept length", window, gid="eal")
    _finish_axes(ax, train, "expected accept length (tokens per verification)")
    ax.set_ylim(bottom=1)
    tail = _legend_tail()
    fig.legend([Line2D([], [], color=EAL_COLOR, linewidth=3), *tail[0]], ["expected accept length", *tail[1]],
               loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    bound = f" (at most {len(slots) + 1}: {len(slots)} draft slots + 1)" if slots else ""
    _title(
        fig, "expected accept length", frame, window, who=WHO,
        explain=f"per block, the leading run of right draft slots plus the verifier's bonus token{bound}",
    )
    return fig


def block_accuracy_figure(frame: pd.DataFrame, smooth: int = 0) -> Figure:
    """A block drafter's accuracy per block slot, and over all slots (``full_acc``), on one percent axis."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import PercentFormatter

    train, val = _split(frame)
    window = smoothing_window(len(train), smooth)
    slots = block_positions(frame)
    fig, ax = _single_axes()
    colors = _colors(len(slots))
    handles, labels = [], []
    for color, k in zip(colors, slots, strict=True):
        _curve(ax, train, val, f"position_{k}_acc", color, f"slot {k}", window, gid=f"acc-pos{k}", scale=100)
        handles.append(Line2D([], [], color=color, linewidth=3))
        labels.append(f"slot {k}")
    _curve(ax, train, val, "full_acc", "0.15", "all slots", window, linestyle="--", marker="s", gid="acc-full", scale=100)
    handles.append(Line2D([], [], color="0.15", linewidth=2, linestyle="--"))
    labels.append("all slots (full_acc)")
    _finish_axes(ax, train, "draft token accuracy")
    ax.yaxis.set_major_formatter(PercentFormatter(100, decimals=0))
    columns = [c for c in (*(f"position_{k}_acc" for k in slots), "full_acc") if c in frame.columns]
    peaks = [float(frame[c].max()) * 100 for c in columns if frame[c].notna().any()]
    ax.set_ylim(0, min(100.0, max(peaks + [1.0]) * 1.1 + 1))
    tail = _legend_tail()
    fig.legend(handles + tail[0], labels + tail[1], loc="outside lower center", ncols=min(len(handles) + 2, 8),
               fontsize=9, frameon=False)
    _title(
        fig, "accuracy per block slot", frame, window, who=WHO,
        explain="slot k: share of the draft tokens at block slot k that are right (slot 0 is the anchor, the verifier's token)",
    )
    return fig
