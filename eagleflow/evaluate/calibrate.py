"""A drafter's calibration, fitted on held-out prompts by the evaluation when its family has one (the registry's
``calibration`` owner; DSpark's confidence temperatures).

One engine of the drafter's own shape is started with the family's recording variable, answers every held-out
prompt once (greedy, as the sweep does), and stops; the family fits what it recorded into the file SGLang reads,
which the fastest configs' SGLang flags then name. The recording is the reference engine's: an SGLang engine's
is written by SGLang's own collector (``.pt`` shards, in its ``cap-accept`` verify mode), which SGLang's own fit
tool reads, so with ``--engine sglang`` the report says how to fit it instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagleflow.drafters import family_of_algorithm
from eagleflow.engine import EngineClient, free_port, serving_engine_command
from eagleflow.evaluate.config import EvaluateConfig
from eagleflow.evaluate.engine_run import generate, running_engine
from eagleflow.evaluate.prompts import ChatPrompts, Prompt
from eagleflow.export import ServedDrafter

RECORDING = "calibration-records.jsonl"


def calibrate(cfg: EvaluateConfig, drafter: ServedDrafter, prompts: Sequence[Prompt], chat: ChatPrompts | None,
              draft_tokens: int | None) -> dict[str, Any] | None:
    """The drafter's family's calibration fitted on ``prompts`` (written into ``cfg.out``): what the report says of
    it; None for a family without one."""
    chosen = family_of_algorithm(drafter.algorithm)
    if not chosen.calibration or not prompts:
        return None
    step = chosen.owner("calibration")
    if cfg.engine != "reference":
        return {"skipped": f"fitted from the reference engine's recording; with SGLang, record with {step.env} set and "
                           "fit with python -m sglang.benchmark.dspark_sts_fit"}
    recording = cfg.out / RECORDING
    recording.unlink(missing_ok=True)  # a recording of this evaluation's prompts only
    port = free_port()
    argv, env = serving_engine_command(cfg.engine, cfg.verifier, port, drafter, tp_size=cfg.tp_size,
                                       extra_args=cfg.eval_server_extra_args, num_draft_tokens=draft_tokens)
    with running_engine(argv, {**env, step.env: str(recording)}, cfg.out / "engine-calibration", port, cfg.warmup_timeout) as info:
        client = EngineClient(info.url, request_timeout=3600.0)
        for prompt in prompts:
            generate(client, prompt, cfg.eval_max_new_tokens, "calibration", chat)
    result = step.fit(recording, cfg.out, dataset=f"{len(prompts)} held-out prompts")
    print(f"evaluate: calibration from {result['records']} verify steps: ECE per position {_fmt(result['ece_before'])} "
          f"-> {_fmt(result['ece_after'])}; {' '.join(result['flag'])}", flush=True)
    return result


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"
