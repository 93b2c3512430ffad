"""Runs whose drafters were evaluated, for the compare step and the run page: real files, chosen figures.

Each drafter's ``eval/report.json`` is written by the evaluation's own report functions
(:func:`eagleflow.evaluate.report.sweep_rows`, :func:`~eagleflow.evaluate.report.build_report`) from timed
passes whose accept length and per-round speedups the test chooses; its SGLang folder holds a real
safetensors file of small tensors; its ``train/result.json`` the training's wall seconds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eagleflow.evaluate.engine_run import Generation, TimedPass
from eagleflow.evaluate.report import build_report, sweep_rows
from eagleflow.evaluate.sweep import ServeConfig, parse_config
from eagleflow.files import atomic_write_json
from eagleflow.layout import RunLayout

TOKENS = 60  # completion tokens of every answer: an accept length dividing 60 gives exact verify counts
PROMPTS = 2
# (accept length, speedup of each round) of a config on one prompt set, or per prompt set
Figures = tuple[float, list[float]] | dict[str, tuple[float, list[float]]]


def passes(accept_length: float | None, seconds: list[float]) -> list[TimedPass]:
    """One timed pass per round, each ``PROMPTS`` answers of ``TOKENS`` tokens in ``seconds[round]``; with a drafter,
    SGLang's spec counts of ``accept_length`` (None: the baseline, no spec fields)."""
    meta: dict[str, float] = {"completion_tokens": TOKENS}
    if accept_length is not None:
        verify = round(TOKENS / accept_length)
        meta |= {"spec_verify_ct": verify, "spec_accept_length": accept_length,
                 "spec_num_correct_drafts": TOKENS - verify, "spec_num_proposed_drafts": 3 * verify}
    return [TimedPass([Generation(row, [1] * TOKENS, s, dict(meta)) for row in range(PROMPTS)], s) for s in seconds]


def write_drafter(
    run: Path, name: str | None, algorithm: str, configs: dict[str, Figures], sets: tuple[str, ...] = ("heldout", "humaneval"),
    train_seconds: float | None = None, shapes: tuple[tuple[int, ...], ...] = ((16, 8), (8,)),
    chat_template_kwargs: dict[str, Any] | None = None,
) -> RunLayout:
    """Drafter ``name`` of ``run`` (None: the run's one drafter) evaluated on ``configs`` ("1,3,1,4" -> figures):
    its report, its SGLang weights (one tensor per shape of ``shapes``) and its training result."""
    import torch
    from safetensors.torch import save_file

    layout = RunLayout.of(run.parent, run.name).for_drafter(name)
    sglang = layout.drafter / "sglang"
    sglang.mkdir(parents=True, exist_ok=True)
    save_file({f"layer.{i}": torch.ones(shape) for i, shape in enumerate(shapes)}, str(sglang / "model.safetensors"))
    (sglang / "config.json").write_text("{}")
    atomic_write_json(layout.train.result, {"best_checkpoint": "x"} | ({"train_seconds": train_seconds} if train_seconds is not None else {}))
    results: dict[ServeConfig, dict[str, list[TimedPass]]] = {}
    for label, figures in configs.items():
        config = parse_config(label, block=algorithm == "DFLASH")
        per_set = figures if isinstance(figures, dict) else dict.fromkeys(sets, figures)
        results[config] = {s: passes(per_set[s][0], [1.0 / x for x in per_set[s][1]]) for s in sets}
        rounds = len(next(iter(per_set.values()))[1])
        results[ServeConfig(config.batch_size, 0, 0, 0)] = {s: passes(None, [1.0] * rounds) for s in sets}
    facts = {"engine": "reference", "num_steps": 3, "algorithm": algorithm, "block_size": 8 if algorithm == "DFLASH" else None,
             "prompt_sets": list(sets), "prompts": PROMPTS, "max_new_tokens": TOKENS, "concurrency": 2, "rounds": rounds,
             "chat_template_kwargs": chat_template_kwargs or {}}
    report = build_report(sweep_rows(results, str(sglang), 2048 if algorithm == "EAGLE3" else None, algorithm), facts)
    atomic_write_json(layout.evaluation / "report.json", report)
    return layout


def numel(shapes: tuple[tuple[int, ...], ...] = ((16, 8), (8,))) -> int:
    return sum(math.prod(shape) for shape in shapes)


# Two drafters of one run: EAGLE-3 is fastest at batch size 1 (config 1,3,4,8: 1.6 and 1.3, mean 1.45, against
# DFlash's 1.3), DFlash at batch size 2 (1.6 against 1.2), so the winner (batch size 1) is EAGLE-3's 1,3,4,8.
EAGLE3_CONFIGS: dict[str, Figures] = {
    "1,3,1,4": {"heldout": (2.0, [1.3, 1.5, 1.7]), "humaneval": (1.5, [1.1, 1.2, 1.4])},
    "1,3,4,8": {"heldout": (2.5, [1.4, 1.6, 1.8]), "humaneval": (2.0, [1.2, 1.3, 1.5])},
    "2,3,1,4": (2.0, [1.1, 1.2, 1.3]),
}
DFLASH_CONFIGS: dict[str, Figures] = {"1,1,1,8": (3.0, [1.2, 1.3, 1.4]), "2,1,1,8": (3.0, [1.5, 1.6, 1.9])}


def write_two_drafters(run: Path) -> dict[str, RunLayout]:
    """``drafters/eagle3`` (trained 3725 s) and ``drafters/dflash`` (no training time recorded) of ``run``."""
    return {
        "eagle3": write_drafter(run, "eagle3", "EAGLE3", EAGLE3_CONFIGS, train_seconds=3725.0),
        "dflash": write_drafter(run, "dflash", "DFLASH", DFLASH_CONFIGS, shapes=((4, 4), (32, 2), (3,))),
    }
