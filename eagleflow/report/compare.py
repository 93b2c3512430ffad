"""``compare``: every drafter of a run side by side (accept length, speedup, size, training time).

``python -m eagleflow compare --run OUTPUT_ROOT/RUN [--drafters eagle3,dflash]``

A run that trains several drafters from one capture (``drafters/<name>/``, :class:`eagleflow.layout.RunLayout`)
has one evaluation report per drafter; this step reads them and writes ``RUN/eval/compare.json``
(:attr:`RunLayout.comparison`) and its chart ``compare.{png,svg}`` beside it, atomically. Without
``--drafters`` it reads the run's one drafter, in the run folder itself.

Per drafter, prompt set and serving config (the baseline, without a drafter, left out): accept length
(mean, p50, p90), accept rate, speedup (median over rounds with their min and max) and tokens/s, as
the evaluation measured them; per drafter its algorithm, the parameters and bytes of its SGLang
weights (counted from the safetensors headers, no tensor loaded) and how long its training took.
Per batch size, the fastest drafter and config, chosen as each report's own ``fastest``
(:func:`eagleflow.evaluate.sweep.fastest_per_batch_size`) and then the best of those, with its exact
SGLang flags; the ``winner`` is the fastest at the smallest batch size. A drafter whose report is
missing or unreadable (its evaluation failed or was skipped) is listed under ``missing`` and the
others are still compared; settings that differ between the evaluations (prompt sets, batch sizes,
engine, …) are listed under ``mismatch``, since their figures were then not measured alike.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.evaluate import write_compare_chart
from eagleflow.evaluate import num
from eagleflow.evaluate import REPORT_FILE
from eagleflow.evaluate import fastest_per_batch_size
from eagleflow.files import atomic_write_json
from eagleflow.layout import RunLayout
from eagleflow.progress import format_bytes, format_duration
from eagleflow.report.shapes import EvaluationShape, shaped
from eagleflow.results import emit_result
from sglang_patch.sample_header import read_header

DEFINITIONS = {
    "sets": "per prompt set, the evaluation's own figures of the config (eval/report.json of the drafter): accept length "
            "mean/p50/p90, accept rate, speedup median over rounds with the rounds' min and max, tokens/s",
    "fastest": "per batch size, the drafter and config with the highest speedup median averaged over the prompt sets "
               "(disturbed figures excluded), as each evaluation's own fastest config; spread: the lowest and highest "
               "round over the prompt sets; accept_length: the mean over the prompt sets",
    "winner": "the fastest drafter and config at the smallest batch size with a trustworthy speedup",
    "parameters": "elements of every tensor in the drafter's SGLang folder (*.safetensors), from the files' headers",
    "bytes": "the sizes of those *.safetensors files",
    "train_seconds": "wall seconds its training took (train/result.json); null where it was not recorded",
    "missing": "drafters without a readable evaluation report (their evaluation failed or was skipped): not compared",
    "mismatch": "settings that differ between the drafters' evaluations, per drafter: their figures were not measured alike",
}
# The settings two evaluations must share for their figures to be compared (mismatch).
MEASURED_ALIKE = ("prompt_sets", "batch_sizes", "engine", "prompts", "max_new_tokens", "chat_template_kwargs")


class CompareConfig(BaseModel):
    """Flags of ``python -m eagleflow compare``."""

    run: Path = Field(description="the run folder (<output_root>/<run_name>); compare.json goes to its eval/")
    drafters: list[str] = Field(
        default_factory=list,
        description="the drafters to compare, by name (drafters/<name>/ in the run), e.g. eagle3,dflash; "
        "none (or an empty name): the run's one drafter, in the run folder itself",
    )

    @field_validator("drafters")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        return list(dict.fromkeys(name.strip() for name in names))  # a name given twice is compared once


def drafter_names(cfg: CompareConfig) -> list[str | None]:
    """The drafters ``cfg`` names, None standing for the run's one drafter (no name, or the empty name)."""
    return [name or None for name in cfg.drafters] or [None]


def run_layout(run: Path) -> RunLayout:
    """The layout of the run folder ``run``; UserError when there is none."""
    run = run.absolute()
    layout = RunLayout.of(run.parent, run.name)
    if not layout.root.is_dir():
        raise UserError(f"--run {run}: no such run folder")
    return layout


def read_report(path: Path, root: Path) -> tuple[dict[str, Any] | None, str]:
    """The evaluation report in ``path`` checked against the shape the run page reads, or None and why not."""
    shown = path.relative_to(root) if path.is_relative_to(root) else path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no {shown}: its evaluation failed or was skipped"
    except (OSError, ValueError) as exc:
        return None, f"{shown} is unreadable ({exc})"
    if not isinstance(data, dict):
        return None, f"{shown} is not a JSON object"
    report = shaped(EvaluationShape, data, path, root)
    if "error" in report:
        return None, report["error"]
    if not any(row["steps"] for row in report["sweep"]):
        return None, f"{shown} holds no config with the drafter (only baselines)"
    return report, ""


def weight_figures(folder: Path) -> tuple[int | None, int | None, str | None]:
    """Parameters (tensor elements from the safetensors headers) and bytes of ``folder``'s weights, and a note
    when they cannot be counted."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None, None, f"no *.safetensors in {folder}: size unknown"
    size = sum(path.stat().st_size for path in files)
    try:
        parameters = sum(math.prod(t.shape) for path in files for t in read_header(path).tensors.values())
    except (OSError, ValueError) as exc:
        return None, size, f"parameters not counted: {exc}"
    return parameters, size, None


def train_seconds(result: Path) -> float | None:
    """``train_seconds`` of a training result; None where the file or the key is absent (older runs)."""
    try:
        value = json.loads(result.read_text(encoding="utf-8")).get("train_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def set_figures(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures of one config on one prompt set that are compared (the report's, without per-prompt lists and rounds)."""
    accept, speedup, speed = figures["accept_length"], figures["speedup"], figures["tokens_per_s"]
    return {
        "accept_length": {key: accept.get(key) for key in ("mean", "p50", "p90")},
        "accept_rate": figures.get("accept_rate"),
        "speedup": {key: speedup.get(key) for key in ("median", "min", "max", "disturbed")},
        "tokens_per_s": {key: speed.get(key) for key in ("median", "min", "max")},
    }


def drafter_figures(label: str, name: str | None, report: dict[str, Any], layout: RunLayout) -> dict[str, Any]:
    """One drafter's entry: its facts, its configs with the drafter per prompt set, its fastest config per batch size."""
    configs = [
        {"config": row["config"], "batch_size": row["batch_size"], "sglang_flags": list(row.get("sglang_flags") or []),
         "sets": {set_name: set_figures(figures) for set_name, figures in row["sets"].items()}}
        for row in report["sweep"] if row["steps"]  # the baseline measures no drafter
    ]
    by_label = {config["config"]: config for config in configs}
    fastest = {}
    for batch_size, best in fastest_per_batch_size(configs).items():
        sets = by_label[best["config"]]["sets"].values()
        accept = [s["accept_length"]["mean"] for s in sets if s["accept_length"]["mean"] is not None]
        fastest[batch_size] = {
            **best, "spread": [min(s["speedup"]["min"] for s in sets), max(s["speedup"]["max"] for s in sets)],
            "accept_length": statistics.fmean(accept) if accept else None,
        }
    parameters, size, note = weight_figures(layout.drafter / "sglang")
    return {
        "label": label, "name": name, "algorithm": report.get("algorithm"), "report": str(layout.evaluation / REPORT_FILE),
        "weights": str(layout.drafter / "sglang"), "parameters": parameters, "bytes": size,
        "train_seconds": train_seconds(layout.train.result), "notes": [note] if note else [],
        "engine": report.get("engine"), "prompt_sets": report["prompt_sets"], "prompts": report.get("prompts"),
        "max_new_tokens": report.get("max_new_tokens"), "rounds": report.get("rounds"),
        "chat_template_kwargs": report.get("chat_template_kwargs") or {},
        "batch_sizes": sorted({row["batch_size"] for row in report["sweep"]}),
        "configs": configs, "fastest": fastest,
    }


def fastest_drafters(drafters: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per batch size (ascending), the drafter whose own fastest config is fastest; the first listed wins a tie."""
    best: dict[str, dict[str, Any]] = {}
    for drafter in drafters:
        for batch_size, figure in drafter["fastest"].items():
            if batch_size not in best or figure["mean_speedup"] > best[batch_size]["mean_speedup"]:
                best[batch_size] = {"drafter": drafter["label"], "algorithm": drafter["algorithm"], **figure}
    return dict(sorted(best.items(), key=lambda item: int(item[0])))


def mismatch(drafters: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each setting of :data:`MEASURED_ALIKE` on which the drafters' evaluations differ, with every drafter's value."""
    differ = {}
    for key in MEASURED_ALIKE:
        values = {drafter["label"]: drafter[key] for drafter in drafters}
        if len({json.dumps(sorted(v) if isinstance(v, list) else v) for v in values.values()}) > 1:  # set order is no difference
            differ[key] = values
    return differ


def compare_drafters(cfg: CompareConfig) -> dict[str, Any]:
    """Read every drafter's evaluation of ``cfg.run`` and put them side by side (compare.json's content, without the chart).

    :raises UserError: no drafter of the run has a readable report.
    """
    layout = run_layout(cfg.run)
    drafters, missing = [], []
    for name in drafter_names(cfg):
        drafter = layout.for_drafter(name)
        label = name or layout.root.name
        report, reason = read_report(drafter.evaluation / REPORT_FILE, layout.root)
        if report is None:
            missing.append({"drafter": label, "reason": reason})
            print(f"compare: {label}: not compared: {reason}", flush=True)
            continue
        drafters.append(drafter_figures(label, name, report, drafter))
    if not drafters:
        reasons = "; ".join(f"{m['drafter']}: {m['reason']}" for m in missing)
        raise UserError(f"no drafter of the run {layout.root} has an evaluation report to compare ({reasons})")
    fastest = fastest_drafters(drafters)
    first = next(iter(fastest), None)  # batch sizes ascend: the smallest with a trustworthy speedup
    return {
        "run": str(layout.root), "definitions": DEFINITIONS, "drafters": drafters, "missing": missing,
        "mismatch": mismatch(drafters), "fastest": fastest,
        "winner": {"batch_size": int(first), **fastest[first]} if first is not None else None,
    }


def summary_lines(comparison: dict[str, Any]) -> list[str]:
    """The comparison as text for the task log: each drafter's facts and configs, the fastest per batch size, the winner."""
    lines = []
    for d in comparison["drafters"]:
        size = f"{d['parameters']:,} parameters" if d["parameters"] is not None else "parameters unknown"
        lines.append(f"{d['label']}: {d['algorithm']}, {size}, {format_bytes(d['bytes']) if d['bytes'] is not None else '? B'}, "
                     f"trained in {format_duration(d['train_seconds']) if d['train_seconds'] is not None else 'unrecorded time'}"
                     + "".join(f"; {note}" for note in d["notes"]))
        for c in d["configs"]:
            for set_name, s in c["sets"].items():
                a, speed = s["accept_length"], s["speedup"]
                shown = "disturbed" if speed["disturbed"] else f"{num(speed['median'])}x"
                lines.append(f"  {c['config']:<10} {set_name:<12} accept length {num(a['mean'])} (p50 {num(a['p50'])}, p90 "
                             f"{num(a['p90'])}), speedup {shown} (rounds {num(speed['min'])}-{num(speed['max'])}x)")
    for batch_size, best in comparison["fastest"].items():
        lines.append(f"fastest at batch size {batch_size}: {best['drafter']} {best['config']} ({num(best['mean_speedup'])}x "
                     f"mean over the prompt sets); serve with SGLang: {' '.join(best['sglang_flags'])}")
    for key, values in comparison["mismatch"].items():
        lines.append(f"not measured alike: {key} differ: " + ", ".join(f"{label} {value}" for label, value in values.items()))
    winner = comparison["winner"]
    if winner is None:
        lines.append("winner: none (no trustworthy speedup: every figure disturbed)")
    else:
        slower = " (slower than serving without a drafter)" if winner["mean_speedup"] < 1 else ""
        lines.append(f"winner: {winner['drafter']} {winner['config']} at batch size {winner['batch_size']}, "
                     f"{num(winner['mean_speedup'])}x{slower}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``compare`` step, derived from :class:`CompareConfig`."""
    add_model_arguments(parser, CompareConfig)


def main(args: argparse.Namespace) -> int:
    """Compare the run's drafters, write compare.json and its chart, print the comparison and the result line."""
    cfg = model_from_args(CompareConfig, args)
    comparison = compare_drafters(cfg)
    target = run_layout(cfg.run).comparison
    comparison["chart"] = write_compare_chart(comparison, target.parent, target.stem)
    atomic_write_json(target, comparison)
    for line in summary_lines(comparison):
        print(f"compare: {line}", flush=True)
    emit_result({"compare": str(target), "winner": comparison["winner"], **comparison["chart"]})
    return 0
