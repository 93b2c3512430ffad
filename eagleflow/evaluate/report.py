"""The evaluation report: per config and prompt set, accept length, accept rate, speed and speedup; the charts.

Definitions (docs/design.md §10), said in the report too:

- **accept length**: SGLang's ``spec_accept_length`` of each prompt, completion tokens / verify
  rounds, the bonus token included (a multi-turn prompt: over all its turns); mean, p50 and p90
  over the prompts, and the aggregate (all tokens / all verify rounds, SpecForge's figure);
- **accept rate**: accepted / proposed draft tokens (SGLang's ``spec_accept_rate``: proposed =
  verify rounds x (draft tokens - 1));
- **output tokens/s**: a prompt set's completion tokens / the wall time of decoding it with the
  config's batch size in flight, per timed round (after a warm-up); median with min and max;
- **speedup**: tokens/s over the baseline's at the same batch size in the same round, median
  over rounds; above the aggregate accept length it is *disturbed* (:mod:`eagleflow.evaluate.sweep`);
- **offline estimate**: 1 + Σₖ ``full_acc_k`` of the last validation record of training, over the
  served chain length: the accept length to expect if serving agreed as the validation rows did;
  for a block drafter (DFlash), that record's ``eal``, speculators' expected accept length
  (bonus token included), as it is.

The headline fields (``accept_length``, ``tokens_per_s``, ``same_tokens_as_baseline``) are those of
the first prompt set at the drafter's own chain (1 and ``eval_concurrency`` in flight).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from eagleflow.evaluate.engine_run import TimedPass
from eagleflow.evaluate.sweep import ServeConfig, default_shape, fastest_per_batch_size, spread, verdict

CHART = "accept"
SWEEP_CHART = "sweep"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def offline_estimate(metrics_path: Path | None, num_steps: int) -> dict[str, Any] | None:
    """1 + Σₖ full_acc_k (k < ``num_steps``) of the last validation record, or None without one.

    A block drafter's record (:func:`eagleflow.metrics.records.is_block`) already holds the figure:
    its ``eal``, the mean per-block accepted run plus the bonus token, taken as it is
    (``method: "eal"``, with ``position_acc``, its accuracy per block slot); None without one.
    """
    if metrics_path is None or not metrics_path.exists():
        return None
    from eagleflow.metrics import block_positions_of, is_block, read_records

    val = [r for r in read_records(metrics_path) if r.get("kind") == "val"]
    if not val:
        return None
    last = val[-1]
    if is_block(last):
        if last.get("eal") is None:
            return None
        slots = block_positions_of(last)
        return {
            "accept_length": float(last["eal"]),
            "from": f"validation epoch {last.get('epoch')} (eal over {len(slots)} block slots, bonus token included)",
            "method": "eal",
            "position_acc": [last[f"position_{k}_acc"] for k in slots if last.get(f"position_{k}_acc") is not None],
        }
    accs = [last.get(f"full_acc_{k}") for k in range(num_steps)]
    known = [a for a in accs if a is not None]
    return {
        "accept_length": 1.0 + sum(known),
        "from": f"validation epoch {last.get('epoch')} (full_acc_0..{len(known) - 1})",
        "full_acc": known,
    }


def set_figures(passes: list[TimedPass], baseline: list[TimedPass]) -> dict[str, Any]:
    """One config on one prompt set: accept length and rate (from its first pass: greedy answers repeat), speeds."""
    first = passes[0].generations
    lengths = [float(g.meta["spec_accept_length"]) for g in first if g.meta.get("spec_verify_ct")]
    verify = sum(int(g.meta.get("spec_verify_ct", 0)) for g in first)
    correct = sum(int(g.meta.get("spec_num_correct_drafts", 0)) for g in first)
    proposed = sum(int(g.meta.get("spec_num_proposed_drafts", 0)) for g in first)
    aggregate = sum(g.completion_tokens for g in first) / verify if verify else None
    same = sum(d.output_ids == b.output_ids for d, b in zip(first, baseline[0].generations, strict=True))
    return {
        "prompts": len(first),
        "accept_length": {
            "mean": statistics.fmean(lengths) if lengths else None,
            "p50": percentile(lengths, 0.5),
            "p90": percentile(lengths, 0.9),
            "aggregate": aggregate,
            "per_prompt": lengths,
        },
        "accept_rate": correct / proposed if proposed else None,
        "tokens_per_s": spread([p.tokens_per_s for p in passes]),
        "speedup": verdict([p.tokens_per_s / b.tokens_per_s for p, b in zip(passes, baseline, strict=True)], aggregate),
        "same_tokens_as_baseline": same / len(first) if first else None,
    }


def sweep_rows(
    results: dict[ServeConfig, dict[str, list[TimedPass]]], drafter_path: str, window: int | None, algorithm: str = "EAGLE3",
    calibration: str | None = None,
) -> list[dict[str, Any]]:
    """One row per config: its figures per prompt set and the SGLang flags serving it (``algorithm``'s, naming the
    ``calibration`` file the evaluation fitted, when it did)."""
    rows = []
    for config in sorted(results):
        base = ServeConfig(config.batch_size, 0, 0, 0)
        rows.append({
            "config": config.label, "batch_size": config.batch_size, "steps": config.steps, "topk": config.topk,
            "draft_tokens": config.draft_tokens, "sglang_flags": config.sglang_flags(drafter_path, window, algorithm, calibration),
            "sets": {name: set_figures(passes, results[base][name]) for name, passes in results[config].items()},
        })
    return rows


def build_report(rows: list[dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """The report: ``facts`` (settings, versions, prompt sets), the sweep, the fastest config per batch size,
    and the headline figures of the drafter's chain on the first prompt set."""
    steps, concurrency, first_set = facts["num_steps"], facts["concurrency"], facts["prompt_sets"][0]
    shape = default_shape(facts.get("algorithm", "EAGLE3"), steps, facts.get("block_size"))
    by_label = {row["config"]: row for row in rows}

    def headline(batch_size: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        row = by_label.get(ServeConfig(batch_size, *shape).label)
        base = by_label.get(ServeConfig(batch_size, 0, 0, 0).label)
        return (row["sets"][first_set] if row else None), (base["sets"][first_set] if base else None)

    def speed(batch_size: int) -> dict[str, Any]:
        drafted, base = headline(batch_size)
        if drafted is None or base is None:
            return {"drafter": None, "baseline": None, "speedup": None, "disturbed": False}
        figure = drafted["speedup"]
        return {"drafter": drafted["tokens_per_s"]["median"], "baseline": base["tokens_per_s"]["median"],
                "speedup": figure["median"], "spread": [figure["min"], figure["max"]], "disturbed": figure["disturbed"]}

    single, _ = headline(1)
    return {
        **facts,
        "definitions": {
            "accept_length": "completion tokens / verify rounds (bonus token included), as SGLang's spec_accept_length",
            "tokens_per_s": "completion tokens / wall time of the prompt set at the config's batch size, median over rounds",
            "speedup": "tokens/s over the baseline's at the same batch size in the same round, median over rounds; "
                       "above the accept length it cannot be real and is reported as disturbed (median null)",
        },
        "sweep": rows,
        "fastest": fastest_per_batch_size(rows),
        "accept_length": single["accept_length"] if single else {"mean": None, "p50": None, "p90": None, "per_prompt": []},
        "accept_rate": single["accept_rate"] if single else None,
        "tokens_per_s": {"single_stream": speed(1), "concurrent": speed(concurrency)},
        "same_tokens_as_baseline": single["same_tokens_as_baseline"] if single else None,
    }


def num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def summary_line(report: dict[str, Any]) -> str:
    """``evaluate: accept length 1.83 (p50 1.80, p90 2.40) …`` for the task log: the headline figures."""
    a, speeds = report["accept_length"], report["tokens_per_s"]

    def speedup(figure: dict[str, Any]) -> str:
        if figure.get("disturbed"):
            return "disturbed"
        low, high = figure.get("spread") or (None, None)
        return f"{num(figure['speedup'])}x, rounds {num(low)}-{num(high)}x"

    single, concurrent = speeds["single_stream"], speeds["concurrent"]
    estimate = report.get("offline_estimate")
    same = report["same_tokens_as_baseline"]
    return (
        f"evaluate: accept length {num(a['mean'])} (p50 {num(a['p50'])}, p90 {num(a['p90'])}) on {report['prompt_sets'][0]}, "
        f"accept rate {num(report['accept_rate'])}; one at a time {num(single['drafter'], 1)} vs {num(single['baseline'], 1)} "
        f"tokens/s ({speedup(single)}), {report['concurrency']} in flight {num(concurrent['drafter'], 1)} vs "
        f"{num(concurrent['baseline'], 1)} tokens/s ({speedup(concurrent)}); same tokens as without the "
        f"drafter on {num(None if same is None else 100 * same, 0)}% of prompts"
        + (f"; offline estimate {num(estimate['accept_length'])} from {estimate['from']}" if estimate else "")
    )


def sweep_table(report: dict[str, Any]) -> list[str]:
    """The sweep as text: one line per config and prompt set, then the fastest config per batch size and its flags."""
    lines = [f"{'config':<12} {'prompt set':<12} {'accept len':>10} {'p50':>5} {'p90':>5} {'rate':>5} {'tok/s':>8} {'speedup':>8}  rounds"]
    for row in report["sweep"]:
        for name, s in row["sets"].items():
            a, speed = s["accept_length"], s["speedup"]
            shown = "disturbed" if speed["disturbed"] else num(speed["median"])
            lines.append(
                f"{row['config']:<12} {name:<12} {num(a['mean']):>10} {num(a['p50'], 1):>5} {num(a['p90'], 1):>5} "
                f"{num(s['accept_rate']):>5} {num(s['tokens_per_s']['median'], 1):>8} {shown:>8}  "
                f"{num(speed['min'])}-{num(speed['max'])}x"
            )
    for batch_size, best in report["fastest"].items():
        flags = " ".join(best["sglang_flags"]) or "(no speculative flags: serve without the drafter)"
        lines.append(f"fastest at batch size {batch_size}: {best['config']} ({num(best['mean_speedup'])}x mean over the "
                     f"prompt sets); serve with SGLang: {flags}")
    return lines
