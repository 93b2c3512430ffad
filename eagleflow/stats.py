"""``dataset-stats``: rows, tokens and the bytes the hidden states will take (DESIGN.md §1.3)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.results import emit_result
from eagleflow.verifier import config_int

BYTES_PER_VALUE = 2  # hidden states are stored as bf16


class StatsConfig(BaseModel):
    """Flags of ``python -m eagleflow dataset-stats``."""

    dataset: Path = Field(description="training dataset folder (prepare-dataset output)")
    model: Path = Field(description="verifier model folder (its config.json gives the hidden size)")
    aux_layer_ids: list[int] = Field(description="captured layer ids; one more slot holds the final state")


def dataset_stats(dataset_dir: Path, n_slots: int, hidden_size: int) -> dict[str, Any]:
    """Rows, tokens, mean/max length and estimated hidden-state bytes (tokens × slots × hidden × 2)."""
    import datasets

    try:
        lengths = list(datasets.load_from_disk(str(dataset_dir)).with_format(None)["seq_len"])
    except FileNotFoundError as exc:
        raise UserError(f"--dataset {dataset_dir} is not a prepared dataset: {exc}") from exc
    tokens = int(sum(lengths))
    return {
        "rows": len(lengths),
        "tokens": tokens,
        "mean_len": round(tokens / len(lengths), 1) if lengths else 0.0,
        "max_len": int(max(lengths)) if lengths else 0,
        "n_slots": n_slots,
        "hidden_size": hidden_size,
        "estimated_bytes": tokens * n_slots * hidden_size * BYTES_PER_VALUE,
    }


def format_bytes(n: float) -> str:
    """``924e9`` -> ``924.0 GB`` (decimal units, as disks are sold)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def format_table(rows: list[tuple[str, str]]) -> str:
    """A two-column text table for the task log."""
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"  {key.ljust(width)}  {value}" for key, value in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, StatsConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(StatsConfig, args)
    stats = dataset_stats(cfg.dataset, len(cfg.aux_layer_ids) + 1, config_int(cfg.model, "hidden_size"))
    print(
        format_table(
            [
                ("rows", f"{stats['rows']:,}"),
                ("tokens", f"{stats['tokens']:,}"),
                ("mean / max length", f"{stats['mean_len']} / {stats['max_len']}"),
                ("slots × hidden", f"{stats['n_slots']} × {stats['hidden_size']}"),
                ("hidden states (est.)", format_bytes(stats["estimated_bytes"])),
            ]
        ),
        flush=True,
    )
    emit_result(stats)
    return 0
