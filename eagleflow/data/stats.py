"""``dataset-stats``: rows, tokens and the bytes the hidden states will take (docs/design.md §1, step 2).

The bytes per token come from the sample file format (:func:`sglang_patch.sample_format.bytes_per_token`, no torch needed):
slots × hidden × 2 B in bf16, slots × hidden × 1 B plus a 4 B scale in fp8, and the 8 B token id.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import AuxLayerIds, StoredHiddenStatesDtype, add_model_arguments, model_from_args
from eagleflow.data.dataset_files import dataset_column
from eagleflow.verifier import config_int, resolve_aux_layer_ids
from eagleflow.progress import format_bytes, format_table
from eagleflow.results import emit_result
from sglang_patch.sample_format import HiddenStatesDtype, bytes_per_token


class StatsConfig(BaseModel):
    """Flags of ``python -m eagleflow dataset-stats``."""

    dataset: Path = Field(description="training dataset folder (prepare-dataset output)")
    verifier: Path = Field(description="verifier model folder (its config.json gives the hidden size)")
    aux_layer_ids: AuxLayerIds = Field(description="captured layer ids; one more slot holds the final state")
    hidden_states_dtype: StoredHiddenStatesDtype


def dataset_stats(
    dataset_dir: Path, n_slots: int, hidden_size: int, hidden_states_dtype: HiddenStatesDtype = "bf16"
) -> dict[str, Any]:
    """Rows, tokens, mean/max length and estimated hidden-state bytes (tokens × bytes per token)."""
    lengths = dataset_column(dataset_dir, "seq_len")
    tokens = int(sum(lengths))
    return {
        "rows": len(lengths),
        "tokens": tokens,
        "mean_len": round(tokens / len(lengths), 1) if lengths else 0.0,
        "max_len": int(max(lengths)) if lengths else 0,
        "n_slots": n_slots,
        "hidden_size": hidden_size,
        "hidden_states_dtype": hidden_states_dtype,
        "bytes_per_token": bytes_per_token(n_slots, hidden_size, hidden_states_dtype),
        "estimated_bytes": tokens * bytes_per_token(n_slots, hidden_size, hidden_states_dtype),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, StatsConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(StatsConfig, args)
    aux_layer_ids = resolve_aux_layer_ids(cfg.verifier, cfg.aux_layer_ids)
    stats = dataset_stats(cfg.dataset, len(aux_layer_ids) + 1, config_int(cfg.verifier, "hidden_size"), cfg.hidden_states_dtype)
    print(
        format_table(
            [
                ("rows", f"{stats['rows']:,}"),
                ("tokens", f"{stats['tokens']:,}"),
                ("mean / max length", f"{stats['mean_len']} / {stats['max_len']}"),
                ("slots × hidden", f"{stats['n_slots']} × {stats['hidden_size']}"),
                ("stored as", f"{stats['hidden_states_dtype']}, {stats['bytes_per_token']:,} B per token"),
                ("hidden states (est.)", format_bytes(stats["estimated_bytes"])),
            ]
        ),
        flush=True,
    )
    emit_result(stats)
    return 0
