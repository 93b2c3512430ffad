"""Held-out prompts: rows of the validation split, cut where the first assistant turn begins.

speculators trains on rows ``[0, int(rows * train_data_ratio))`` and validates on the rest
(``speculators/train/data.py``: both splits derive from one boundary), so prompts taken from the
rest were never trained on. A prompt is the row's tokens up to its first loss-masked
(assistant) token: the conversation and the generation prompt, as a user would send it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagleflow.errors import UserError


@dataclass(frozen=True)
class Prompt:
    """One held-out prompt: its dataset row and its token ids."""

    row: int
    input_ids: list[int]


def validation_start(rows: int, train_data_ratio: float) -> int:
    """The first row speculators keeps out of training."""
    return int(rows * train_data_ratio)


def held_out_prompts(dataset: Path, train_data_ratio: float, count: int) -> list[Prompt]:
    """The first ``count`` prompts of the validation split of the prepared dataset ``dataset``.

    Fewer than ``count`` is an error naming the Param, never a silently smaller evaluation.
    """
    import datasets

    try:
        table = datasets.load_from_disk(str(dataset)).with_format(None)
    except FileNotFoundError as exc:
        raise UserError(f"--dataset {dataset} is not a prepared dataset: {exc}") from exc
    start = validation_start(len(table), train_data_ratio)
    prompts: list[Prompt] = []
    for row in range(start, len(table)):
        ids, mask = table[row]["input_ids"], table[row]["loss_mask"]
        first_answer = next((i for i, m in enumerate(mask) if m), None)
        if first_answer:
            prompts.append(Prompt(row, list(ids[:first_answer])))
        if len(prompts) == count:
            break
    if not prompts:
        raise UserError(
            f"--dataset {dataset}: no held-out prompt in rows {start}..{len(table) - 1} (train_data_ratio "
            f"{train_data_ratio} of {len(table)} rows); evaluation needs rows training never saw"
        )
    if len(prompts) < count:
        raise UserError(
            f"--eval-rows {count} (Param eval_rows): the dataset {dataset} has only {len(prompts)} held-out prompts "
            f"(rows {start}..{len(table) - 1} with an answer, of {len(table)} rows at train_data_ratio {train_data_ratio}); "
            f"lower eval_rows to at most {len(prompts)}"
        )
    return prompts
