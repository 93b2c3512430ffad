"""``evaluate``: serve the exported drafter, decode held-out prompts with and without it, report.

``python -m eagleflow evaluate --dataset RUN/dataset --model MODEL --drafter RUN/drafter --train-dir RUN/train --out RUN/eval``

Two engines run one after the other on the same GPUs (or CPU): the engine with the drafter's
EAGLE-3 decoding (SGLang's flags, or the reference engine's identical ones), then the same
engine without it, the base model's own throughput. Each decodes the held-out prompts greedily,
one at a time and then ``--eval-concurrency`` at once. ``OUT/report.json`` holds accept length
(mean, p50, p90), accept rate, tokens/s with and without the drafter and their ratio, the offline
estimate from training's last validation, the engine and versions;  ``OUT/accept.{png,svg}`` the
chart; the task log one summary line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from typing import Any

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.engine.launch import serving_engine_command
from eagleflow.engine.process import free_port, interrupted_by_signals
from eagleflow.evaluate.config import EvaluateConfig
from eagleflow.errors import UserError
from eagleflow.evaluate.engine_run import measure, running_engine
from eagleflow.evaluate.prompts import held_out_prompts
from eagleflow.evaluate.report import build_report, offline_estimate, summary_line, write_chart
from eagleflow.export.step import ServedDrafter
from eagleflow.files import atomic_write_json
from eagleflow.layout import TrainLayout
from eagleflow.results import emit_result

REPORT_FILE = "report.json"


def training_ratio(cfg: EvaluateConfig) -> float:
    """The split training used: ``--train-data-ratio``, else the training folder's recorded setting."""
    if cfg.train_data_ratio is not None:
        return cfg.train_data_ratio
    if cfg.train_dir is not None and TrainLayout(cfg.train_dir).config.is_file():
        return float(json.loads(TrainLayout(cfg.train_dir).config.read_text())["train_data_ratio"])
    raise UserError("give --train-dir (its train-config.json has the split) or --train-data-ratio")


def versions(engine: str) -> dict[str, str | None]:
    """Versions of what served and trained the drafter."""
    names = ["eagleflow", "torch", "transformers", "speculators"] + (["sglang"] if engine == "sglang" else [])
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def evaluate(cfg: EvaluateConfig) -> dict[str, Any]:
    """Run both engines over the held-out prompts, write the report and the chart; return the report."""
    started = time.monotonic()
    drafter = ServedDrafter.from_export(cfg.drafter, cfg.num_steps)
    prompts = held_out_prompts(cfg.dataset, training_ratio(cfg), cfg.eval_rows)
    print(
        f"evaluate: {len(prompts)} held-out prompts (rows {prompts[0].row}..{prompts[-1].row}), {cfg.eval_max_new_tokens} "
        f"new tokens each, {cfg.engine} engine, {drafter.num_steps} draft tokens per verification",
        flush=True,
    )
    measurements = {}
    for label, served in (("drafter", drafter), ("baseline", None)):
        port = free_port()
        argv, env = serving_engine_command(
            cfg.engine, cfg.model, port, served, tp_size=cfg.tp_size, extra_args=cfg.server_extra_args
        )
        with running_engine(argv, env, cfg.out / f"engine-{label}", port, cfg.warmup_timeout) as info:
            measurements[label] = measure(info.url, prompts, cfg.eval_max_new_tokens, cfg.eval_concurrency, label)
    facts = {
        "engine": cfg.engine,
        "versions": versions(cfg.engine),
        "drafter": str(drafter.path),
        "num_steps": drafter.num_steps,
        "prompts": len(prompts),
        "rows": [prompts[0].row, prompts[-1].row],
        "max_new_tokens": cfg.eval_max_new_tokens,
        "concurrency": cfg.eval_concurrency,
        "offline_estimate": offline_estimate(TrainLayout(cfg.train_dir).metrics if cfg.train_dir else None, drafter.num_steps),
    }
    report = build_report(measurements["drafter"], measurements["baseline"], facts)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["chart"] = write_chart(report, cfg.out)
    atomic_write_json(cfg.out / REPORT_FILE, report)
    print(summary_line(report), flush=True)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, EvaluateConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(EvaluateConfig, args)
    try:
        with interrupted_by_signals():
            report = evaluate(cfg)
    except KeyboardInterrupt as exc:
        # running_engine's finally stopped the engine on the way here.
        print(f"evaluate: stopped ({exc}); its engine is stopped and no report was written; rerun the step to evaluate", flush=True)
        return 1
    emit_result(
        {
            "report": str(cfg.out / REPORT_FILE),
            "accept_length": report["accept_length"]["mean"],
            "speedup": report["tokens_per_s"]["single_stream"]["speedup"],
        }
    )
    return 0
