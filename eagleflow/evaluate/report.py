"""The evaluation report: accept length, accept rate, speedup, the offline estimate, a chart.

Definitions (DESIGN.md §10), said in the report too:

- **accept length**: SGLang's ``spec_accept_length`` of each request, completion tokens / verify
  rounds, the bonus token included; the report gives its mean, p50 and p90 over the prompts;
- **accept rate**: accepted / proposed draft tokens over all prompts (SGLang's ``spec_accept_rate``);
- **speedup**: output tokens/s with the drafter / without it, one request at a time and with
  several in flight, on the same prompts and engine;
- **offline estimate**: 1 + Σₖ ``full_acc_k`` of the last validation record of training
  (``full_acc_k``: the share of positions whose drafts 0..k were all right), over the served
  chain length: the accept length to expect if serving agreed as the validation rows did.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from eagleflow.evaluate.engine_run import EngineMeasurement

CHART = "accept"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def accept_lengths(measurement: EngineMeasurement) -> list[float]:
    """``spec_accept_length`` of every single-stream request that was verified at least once."""
    return [float(g.meta["spec_accept_length"]) for g in measurement.single if g.meta.get("spec_verify_ct")]


def offline_estimate(metrics_path: Path | None, num_steps: int) -> dict[str, Any] | None:
    """1 + Σₖ full_acc_k (k < ``num_steps``) of the last validation record, or None without one."""
    if metrics_path is None or not metrics_path.exists():
        return None
    from eagleflow.metrics.records import read_records

    val = [r for r in read_records(metrics_path) if r.get("kind") == "val"]
    if not val:
        return None
    last = val[-1]
    accs = [last.get(f"full_acc_{k}") for k in range(num_steps)]
    known = [a for a in accs if a is not None]
    return {
        "accept_length": 1.0 + sum(known),
        "from": f"validation epoch {last.get('epoch')} (full_acc_0..{len(known) - 1})",
        "full_acc": known,
    }


def build_report(drafter: EngineMeasurement, baseline: EngineMeasurement, facts: dict[str, Any]) -> dict[str, Any]:
    """The report of one evaluation; ``facts`` adds the settings (engine, versions, prompts…)."""
    lengths = accept_lengths(drafter)
    correct = sum(int(g.meta.get("spec_num_correct_drafts", 0)) for g in drafter.single)
    proposed = sum(int(g.meta.get("spec_num_proposed_drafts", 0)) for g in drafter.single)
    same = sum(d.output_ids == b.output_ids for d, b in zip(drafter.single, baseline.single, strict=True))

    def speed(with_drafter: float, without: float) -> dict[str, float | None]:
        return {"drafter": with_drafter, "baseline": without, "speedup": with_drafter / without if without else None}

    return {
        **facts,
        "accept_length": {
            "mean": statistics.fmean(lengths) if lengths else None,
            "p50": percentile(lengths, 0.5),
            "p90": percentile(lengths, 0.9),
            "per_prompt": lengths,
            "definition": "completion tokens / verify rounds (bonus token included), as SGLang's spec_accept_length",
        },
        "accept_rate": correct / proposed if proposed else None,
        "tokens_per_s": {
            "single_stream": speed(drafter.single_tokens_per_s, baseline.single_tokens_per_s),
            "concurrent": speed(drafter.concurrent_tokens_per_s, baseline.concurrent_tokens_per_s),
        },
        "same_tokens_as_baseline": same / len(drafter.single) if drafter.single else None,
    }


def summary_line(report: dict[str, Any]) -> str:
    """``evaluate: accept length 1.83 (p50 1.80, p90 2.40) …`` for the task log."""
    a, speeds = report["accept_length"], report["tokens_per_s"]
    single, concurrent = speeds["single_stream"], speeds["concurrent"]

    def num(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    estimate = report.get("offline_estimate")
    same = report["same_tokens_as_baseline"]
    return (
        f"evaluate: accept length {num(a['mean'])} (p50 {num(a['p50'])}, p90 {num(a['p90'])}), accept rate "
        f"{num(report['accept_rate'])}; one at a time {num(single['drafter'], 1)} vs {num(single['baseline'], 1)} "
        f"tokens/s ({num(single['speedup'])}x), {report['concurrency']} in flight {num(concurrent['drafter'], 1)} vs "
        f"{num(concurrent['baseline'], 1)} tokens/s ({num(concurrent['speedup'])}x); same tokens as without the "
        f"drafter on {num(None if same is None else 100 * same, 0)}% of prompts"
        + (f"; offline estimate {num(estimate['accept_length'])} from {estimate['from']}" if estimate else "")
    )


def write_chart(report: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """``accept.{png,svg}``: the accept-length histogram and the tokens/s bars, published atomically."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from eagleflow.files import atomic_path

    figure = Figure(figsize=(11, 4.2), layout="constrained")
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
    with_drafter = [speeds["single_stream"]["drafter"], speeds["concurrent"]["drafter"]]
    without = [speeds["single_stream"]["baseline"], speeds["concurrent"]["baseline"]]
    positions = range(len(labels))
    right.bar([p - 0.2 for p in positions], without, width=0.4, label="without drafter", color="0.6")
    right.bar([p + 0.2 for p in positions], with_drafter, width=0.4, label="with drafter", color="#2ca02c")
    right.set_xticks(list(positions), labels)
    right.set(title="output tokens/s", ylabel="tokens/s")
    right.legend(fontsize=8)
    figure.suptitle(f"EAGLE-3 drafter on {report['prompts']} held-out prompts ({report['engine']} engine)", fontweight="bold")
    written = {}
    for fmt in ("png", "svg"):
        target = out_dir / f"{CHART}.{fmt}"
        with atomic_path(target) as tmp:
            figure.savefig(tmp, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else {})
        written[fmt] = str(target)
    return written
