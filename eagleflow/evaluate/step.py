"""``evaluate``: serve the exported drafter under a sweep of serving configs, decode prompt sets, report.

``python -m eagleflow evaluate --dataset RUN/dataset --verifier MODEL --drafter RUN/drafter --train-dir RUN/train --out RUN/eval``

One engine per draft shape of ``--eval-configs`` (steps, topk, draft tokens; the baseline is the
engine without a drafter), each warmed up (one untimed answer per prompt set) before it is timed.
Every config decodes every prompt set (``--eval-sets``) greedily with its batch size in flight,
``--eval-rounds`` times. The reference engines all run at once and take turns slice by slice:
every config of one batch size answers the same ``batch size`` prompts before any goes on to the
next slice, in an order reversed every slice (and rotated every round), so a slow spell of the
machine lands on the configs alike and their ratio holds while the machine's own speed drifts
(on a shared 2-core VM the same answer takes from 1x to 2x the time within a minute);
SGLang engines, which each take the GPUs, run one after the other, each for all its rounds.
``OUT/report.json`` holds per config and prompt set the accept length (mean, p50, p90,
aggregate), accept rate, tokens/s and speedup over the same batch size's baseline (median and
spread over rounds; a speedup above the accept length is flagged disturbed, never reported),
the fastest config per batch size with its SGLang flags, the offline estimate from training's
last validation, the engine and versions; ``OUT/accept.{png,svg}`` and ``OUT/sweep.{png,svg}`` the
charts; the task log the sweep table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import time
from typing import TYPE_CHECKING, Any

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.engine import EngineClient, free_port, interrupted_by_signals, serving_engine_command
from eagleflow.evaluate.calibrate import calibrate
from eagleflow.evaluate.config import EvaluateConfig, param_label
from eagleflow.errors import UserError
from eagleflow.evaluate.charts import write_chart, write_sweep_chart
from eagleflow.evaluate.engine_run import TimedPass, generate, running_engine, timed_pass
from eagleflow.evaluate.prompt_file import file_set_name
from eagleflow.evaluate.prompts import ChatPrompts, Prompt, Room, file_prompts, held_out_prompts, humaneval_prompts
from eagleflow.evaluate.report import build_report, offline_estimate, summary_line, sweep_rows, sweep_table
from eagleflow.evaluate.sweep import ServeConfig, interleaved_turns, parse_configs
from eagleflow.export import ServedDrafter
from eagleflow.files import atomic_write_json
from eagleflow.layout import TrainLayout
from eagleflow.results import emit_result

if TYPE_CHECKING:
    from eagleflow.reuse import MadeFrom

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


def prompt_sets(cfg: EvaluateConfig) -> tuple[dict[str, list[Prompt]], ChatPrompts | None]:
    """The prompt sets of ``--eval-sets``, ``--eval-rows`` each, and the chat template that renders them.

    Every check runs here, before any engine starts: each set holds eval_rows prompts, every line of
    the prompt file is well formed, every prompt fits the engines' context with its answers.
    """
    chat = ChatPrompts(cfg.verifier, cfg.chat_template_kwargs) if set(cfg.eval_sets) - {"heldout"} else None
    room = Room.of_engines(cfg.verifier, cfg.eval_server_extra_args, cfg.eval_max_new_tokens)
    sets: dict[str, list[Prompt]] = {}
    for name in dict.fromkeys(cfg.eval_sets):
        if name == "heldout":
            sets[name] = held_out_prompts(cfg.dataset, training_ratio(cfg), cfg.eval_rows)
            room.check(sets[name], chat, f"the prompt set heldout (the validation rows of {cfg.dataset})", "row")
        elif name == "humaneval":
            sets[name] = humaneval_prompts(chat, cfg.eval_rows)
            room.check(sets[name], chat, "the prompt set humaneval", "problem")
        else:  # named after the file
            label = file_set_name(cfg.eval_prompts)
            sets[label] = file_prompts(chat, cfg.eval_prompts, cfg.eval_rows, label)
            room.check(sets[label], chat, f"{param_label('eval_prompts')} {cfg.eval_prompts}", "line")
    return sets, chat


def measure_sweep(
    cfg: EvaluateConfig, drafter: ServedDrafter, configs: list[ServeConfig], sets: dict[str, list[Prompt]], chat: ChatPrompts | None
) -> dict[ServeConfig, dict[str, list[TimedPass]]]:
    """Every config on every prompt set, ``eval_rounds`` timed passes each, after each engine's warm-up."""
    shapes = sorted({c.shape for c in configs})
    results: dict[ServeConfig, dict[str, list[TimedPass]]] = {c: {name: [] for name in sets} for c in configs}

    def engine(shape: tuple[int, int, int]) -> contextlib.AbstractContextManager[Any]:
        steps, topk, draft_tokens = shape
        served = dataclasses.replace(drafter, num_steps=steps) if steps else None
        port = free_port()
        argv, env = serving_engine_command(cfg.engine, cfg.verifier, port, served, tp_size=cfg.tp_size,
                                           extra_args=cfg.eval_server_extra_args, topk=topk or 1, num_draft_tokens=draft_tokens or None)
        label = "baseline" if not steps else f"{steps}-{topk}-{draft_tokens}"
        return running_engine(argv, env, cfg.out / f"engine-{label}", port, cfg.warmup_timeout)

    def warm_up(client: EngineClient) -> None:
        for prompts in sets.values():
            generate(client, prompts[0], cfg.eval_max_new_tokens, "warmup", chat)

    def record(config: ServeConfig, name: str, timed: TimedPass, round_: int) -> None:
        results[config][name].append(timed)
        print(f"evaluate: round {round_ + 1}/{cfg.eval_rounds} {config.label} {name}: {timed.tokens_per_s:.1f} tokens/s", flush=True)

    def interleaved_round(group: list[ServeConfig], clients: dict[tuple[int, int, int], EngineClient], round_: int) -> None:
        """One batch size's configs take turns a slice of ``batch_size`` prompts at a time (see the module docstring)."""
        for name, prompts in sets.items():
            passes = {config: TimedPass() for config in group}
            for config, part in interleaved_turns(group, len(prompts), round_):
                passes[config].add(timed_pass(clients[config.shape], prompts[part], cfg.eval_max_new_tokens,
                                              config.batch_size, config.label, chat))
            for config in group:
                record(config, name, passes[config], round_)

    if cfg.engine == "reference":  # all engines at once, configs interleaved
        with contextlib.ExitStack() as stack:
            clients = {shape: EngineClient(stack.enter_context(engine(shape)).url, request_timeout=3600.0) for shape in shapes}
            for client in clients.values():
                warm_up(client)
            groups = [[c for c in configs if c.batch_size == size] for size in sorted({c.batch_size for c in configs})]
            for round_ in range(cfg.eval_rounds):
                for group in groups:
                    interleaved_round(group, clients, round_)
    else:
        for shape in shapes:
            with engine(shape) as info:
                client = EngineClient(info.url, request_timeout=3600.0)
                warm_up(client)
                for round_ in range(cfg.eval_rounds):
                    for config in (c for c in configs if c.shape == shape):
                        for name, prompts in sets.items():
                            record(config, name, timed_pass(client, prompts, cfg.eval_max_new_tokens, config.batch_size,
                                                            config.label, chat), round_)
    return results


def evaluate(cfg: EvaluateConfig) -> dict[str, Any]:
    """Run the sweep over the prompt sets, write the report and the charts; return the report."""
    started = time.monotonic()
    drafter = ServedDrafter.from_export(cfg.drafter, cfg.num_steps)
    from eagleflow.drafters import family_of_algorithm

    block = family_of_algorithm(drafter.algorithm).block
    try:
        configs = parse_configs(cfg.eval_configs, drafter.num_steps, cfg.eval_concurrency, drafter.block_size, block)
    except ValueError as exc:
        raise UserError(f"{param_label('eval_configs')} for the {drafter.algorithm} drafter in {cfg.drafter}: {exc}") from exc
    sets, chat = prompt_sets(cfg)
    print(
        f"evaluate: prompt sets {', '.join(f'{n} ({len(p)})' for n, p in sets.items())}, {cfg.eval_max_new_tokens} new "
        f"tokens each, {cfg.engine} engine; configs {' '.join(c.label for c in configs)}, {cfg.eval_rounds} rounds",
        flush=True,
    )
    results = measure_sweep(cfg, drafter, configs, sets, chat)
    calibration = calibrate(cfg, drafter, sets.get("heldout") or [], chat, None)
    heldout = sets.get("heldout")
    facts = {
        "engine": cfg.engine,
        "versions": versions(cfg.engine),
        "drafter": str(drafter.path),
        "num_steps": drafter.num_steps,
        "algorithm": drafter.algorithm,
        "block_size": drafter.block_size,
        "prompt_sets": list(sets),
        "prompts": len(next(iter(sets.values()))),
        "rows": [heldout[0].row, heldout[-1].row] if heldout else None,
        "max_new_tokens": cfg.eval_max_new_tokens,
        "chat_template_kwargs": cfg.chat_template_kwargs,  # the prompts' rendering, as the drafter's data was
        "concurrency": cfg.eval_concurrency,
        "rounds": cfg.eval_rounds,
        "interleaved": cfg.engine == "reference",
        "offline_estimate": offline_estimate(TrainLayout(cfg.train_dir).metrics if cfg.train_dir else None, drafter.num_steps),
    }
    calibration_path = calibration.get("path") if calibration else None
    report = build_report(sweep_rows(results, str(drafter.path), drafter.window, drafter.algorithm, calibration_path), facts)
    if calibration:
        report["calibration"] = calibration
    report["seconds"] = round(time.monotonic() - started, 1)
    report["chart"] = write_chart(report, cfg.out)
    report["sweep_chart"] = write_sweep_chart(report, cfg.out)
    atomic_write_json(cfg.out / REPORT_FILE, report)
    for line in sweep_table(report):
        print(f"evaluate: {line}", flush=True)
    print(summary_line(report), flush=True)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, EvaluateConfig)


def made_from(cfg: EvaluateConfig) -> MadeFrom:
    """What an evaluation is made from: its settings, the exported drafter, the dataset's rows (not their states), the prompt file."""
    from eagleflow.data import dataset_fingerprint
    from eagleflow.reuse import MadeFrom, file_identities, settings_of

    inputs = [cfg.drafter, cfg.verifier / "config.json", *([cfg.eval_prompts] if cfg.eval_prompts else [])]
    if cfg.train_dir is not None:
        inputs.append(TrainLayout(cfg.train_dir).result)  # its split and last validation metrics
    files = file_identities(inputs)
    return MadeFrom("evaluate", cfg.out.absolute(), {"settings": settings_of(cfg, "out", "redo_finished"), "files": files,
                                                     "dataset": dataset_fingerprint(cfg.dataset, hidden_states=False)})


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(EvaluateConfig, args)
    made = made_from(cfg)
    result = made.reuse_or_none(cfg.redo_finished)
    if result is not None:
        emit_result(result)
        return 0
    try:
        with interrupted_by_signals():
            report = evaluate(cfg)
    except KeyboardInterrupt as exc:
        # running_engine's finally stopped the engine on the way here.
        print(f"evaluate: stopped ({exc}); its engine is stopped and no report was written; rerun the step to evaluate", flush=True)
        return 1
    result = {
        "report": str(cfg.out / REPORT_FILE),
        "accept_length": report["accept_length"]["mean"],
        "speedup": report["tokens_per_s"]["single_stream"]["speedup"],
        "fastest": {bs: best["config"] for bs, best in report["fastest"].items()},
    }
    made.save(result, [cfg.out / REPORT_FILE, *report["chart"].values(), *report["sweep_chart"].values()])
    emit_result(result)
    return 0
