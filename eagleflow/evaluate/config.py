"""Flags of ``python -m eagleflow evaluate``, declared once (the Params form shows three of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field


class EvaluateConfig(BaseModel):
    """Flags of ``python -m eagleflow evaluate``."""

    dataset: Path = Field(description="the prepared training dataset (held-out prompts come from its validation rows)")
    model: Path = Field(description="the verifier model folder the engines serve")
    drafter: Path = Field(description="the drafter folder eagleflow export wrote (export.json, sglang/)")
    out: Path = Field(description="folder for report.json and the chart")
    train_dir: Path | None = Field(None, description="the training folder: its train/validation split and last validation metrics")
    engine: Literal["reference", "sglang"] = Field("reference", description="which engine serves the drafter")
    eval_rows: int = Field(16, ge=1, title="Held-out prompts", description="held-out prompts to decode (rows training never saw)")
    eval_max_new_tokens: int = Field(128, ge=2, title="New tokens per prompt", description="tokens generated per prompt")
    eval_concurrency: int = Field(4, ge=1, title="Requests in flight (concurrent measurement)", description="requests in flight in the concurrent measurement")
    num_steps: int | None = Field(None, ge=1, description="draft tokens per verification; default: the drafter's TTT steps")
    train_data_ratio: float | None = Field(
        None, gt=0, lt=1, description="the training split; default: the training folder's setting"
    )
    tp_size: int = Field(1, ge=1, description="SGLang --tp-size of the evaluation engines")
    server_extra_args: list[str] = Field(default_factory=list, description="appended to both engines' command lines")
    warmup_timeout: float = Field(2700.0, gt=0, description="seconds an engine may take to become ready")
