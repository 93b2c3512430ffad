"""The evaluation's charts: ``accept.{png,svg}`` (the headline accept lengths and speeds),
``sweep.{png,svg}`` (speedup by config and prompt set, with each figure's spread over rounds) and the
run's ``compare.{png,svg}`` (every drafter's fastest config per batch size, :mod:`eagleflow.report.compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagleflow.evaluate.report import CHART, SWEEP_CHART

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b"]


def _save(figure: Any, out_dir: Path, name: str) -> dict[str, str]:
    from eagleflow.files import atomic_path

    written = {}
    for fmt in ("png", "svg"):
        target = out_dir / f"{name}.{fmt}"
        with atomic_path(target) as tmp:
            figure.savefig(tmp, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else {})
        written[fmt] = str(target)
    return written


def _figure(size: tuple[float, float]) -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def write_chart(report: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """``accept.{png,svg}``: the headline accept-length histogram and the tokens/s bars, published atomically."""
    from matplotlib.ticker import MaxNLocator

    figure = _figure((11, 4.2))
    left, right = figure.subplots(1, 2)
    lengths = report["accept_length"]["per_prompt"]
    top = report["num_steps"] + 1
    left.hist(lengths, bins=[1 + i * 0.25 for i in range(int((top - 1) / 0.25) + 2)], color="#1f77b4", edgecolor="black")
    if report["accept_length"]["mean"] is not None:
        left.axvline(report["accept_length"]["mean"], color="#d62728", linestyle="--", label="mean")
    estimate = report.get("offline_estimate")
    if estimate:
        left.axvline(estimate["accept_length"], color="0.3", linestyle=":", label="offline estimate")
    left.set(title="accept length per prompt", xlabel="tokens per verification (bonus included)", ylabel="prompts")
    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.legend(fontsize=8)
    speeds = report["tokens_per_s"]
    labels = ["one at a time", f"{report['concurrency']} in flight"]
    with_drafter = [speeds["single_stream"]["drafter"] or 0, speeds["concurrent"]["drafter"] or 0]
    without = [speeds["single_stream"]["baseline"] or 0, speeds["concurrent"]["baseline"] or 0]
    positions = range(len(labels))
    right.bar([p - 0.2 for p in positions], without, width=0.4, label="without drafter", color="0.6")
    right.bar([p + 0.2 for p in positions], with_drafter, width=0.4, label="with drafter", color="#2ca02c")
    right.set_xticks(list(positions), labels)
    right.set(title="output tokens/s (median over rounds)", ylabel="tokens/s")
    right.legend(fontsize=8)
    figure.suptitle(f"EAGLE-3 drafter on {report['prompt_sets'][0]} prompts ({report['engine']} engine)", fontweight="bold")
    return _save(figure, out_dir, CHART)


def write_sweep_chart(report: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """``sweep.{png,svg}``: median speedup per config (bars per prompt set, min-max whiskers); disturbed figures hatched at 0."""
    rows = [row for row in report["sweep"] if row["steps"]]
    sets = report["prompt_sets"]
    figure = _figure((max(6.0, 1.4 * len(rows) + 3), 4.2))
    axes = figure.subplots(1, 1)
    width = 0.8 / max(len(sets), 1)
    for index, name in enumerate(sets):
        xs, heights, low, high = [], [], [], []
        for position, row in enumerate(rows):
            figure_ = row["sets"][name]["speedup"]
            xs.append(position + (index - (len(sets) - 1) / 2) * width)
            value = figure_["median"]
            heights.append(value or 0.0)
            low.append(max((value or 0.0) - figure_["min"], 0.0) if value else 0.0)
            high.append(max(figure_["max"] - value, 0.0) if value else 0.0)
        bars = axes.bar(xs, heights, width=width, label=name, color=COLORS[index % len(COLORS)], yerr=[low, high], capsize=3)
        for bar, row in zip(bars, rows, strict=True):
            if row["sets"][name]["speedup"]["disturbed"]:
                axes.annotate("disturbed", (bar.get_x() + bar.get_width() / 2, 0.02), rotation=90, ha="center", fontsize=7)
    axes.axhline(1.0, color="0.3", linestyle="--", linewidth=1, label="baseline")
    axes.set_xticks(range(len(rows)), [row["config"] for row in rows])
    axes.set_title("speedup over the same batch size's baseline\n(median of rounds, whiskers: min-max)", fontsize=10)
    axes.set(xlabel="config: batch size, steps, topk, draft tokens", ylabel="speedup")
    axes.legend(fontsize=8)
    return _save(figure, out_dir, SWEEP_CHART)


def write_compare_chart(comparison: dict[str, Any], out_dir: Path, name: str) -> dict[str, str]:
    """``<name>.{png,svg}``: per batch size, each drafter's fastest config, its speedup (mean of the prompt sets' medians,
    whiskers: the lowest and highest round) and accept length, grouped bars; the winner starred, a missing figure said."""
    drafters = comparison["drafters"]
    sizes = sorted({config["batch_size"] for d in drafters for config in d["configs"]})
    figure = _figure((max(8.0, 2.4 * len(sizes) * max(len(drafters), 1) ** 0.5 + 4), 4.4))
    speed_axes, accept_axes = figure.subplots(1, 2)
    width = 0.8 / max(len(drafters), 1)
    winner = comparison.get("winner") or {}
    for index, drafter in enumerate(drafters):
        xs = [position + (index - (len(drafters) - 1) / 2) * width for position in range(len(sizes))]
        best = [drafter["fastest"].get(str(size)) for size in sizes]
        speeds = [b["mean_speedup"] if b else 0.0 for b in best]
        low = [max(s - b["spread"][0], 0.0) if b else 0.0 for s, b in zip(speeds, best, strict=True)]
        high = [max(b["spread"][1] - s, 0.0) if b else 0.0 for s, b in zip(speeds, best, strict=True)]
        style = {"width": width, "color": COLORS[index % len(COLORS)], "label": f"{drafter['label']} ({drafter['algorithm']})"}
        speed_axes.bar(xs, speeds, yerr=[low, high], capsize=3, **style)
        accept_axes.bar(xs, [(b["accept_length"] or 0.0) if b else 0.0 for b in best], **style)
        for x, size, b, top in zip(xs, sizes, best, [s + h for s, h in zip(speeds, high, strict=True)], strict=True):
            if b is None:  # every config of this drafter at this batch size was disturbed (or it was not measured there)
                speed_axes.annotate("no figure", (x, 0.02), rotation=90, ha="center", fontsize=7)
                continue
            won = winner.get("drafter") == drafter["label"] and winner.get("batch_size") == size
            speed_axes.annotate(("★ winner\n" if won else "") + b["config"], (x, top), xytext=(0, 3), textcoords="offset points",
                                ha="center", va="bottom", fontsize=7, fontweight="bold" if won else "normal")
    speed_axes.axhline(1.0, color="0.3", linestyle="--", linewidth=1, label="baseline")
    for axes, title, label in ((speed_axes, "speedup of the fastest config\n(mean of the prompt sets' medians, whiskers: "
                                "min-max round)", "speedup"),
                               (accept_axes, "its accept length\n(mean over the prompt sets, bonus token included)", "accept length")):
        axes.set_xticks(range(len(sizes)), [f"batch size {size}" for size in sizes])
        axes.set_title(title, fontsize=10)
        axes.set(ylabel=label)
        axes.margins(y=0.15)
    handles, labels = speed_axes.get_legend_handles_labels()  # below both panels: the labels stay clear of the bars
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8, frameon=False)
    figure.suptitle(f"Drafters of run {Path(comparison['run']).name} side by side", fontweight="bold")
    return _save(figure, out_dir, name)
