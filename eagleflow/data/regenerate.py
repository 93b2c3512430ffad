"""``regenerate``: the dataset's assistant turns rewritten by the verifier, through the running engine.

A drafter learns to predict its verifier; answers written by people or another model teach it
the wrong distribution. For every conversation, each assistant turn in order is replaced by the
engine's own answer to the conversation so far (earlier turns already regenerated), sent as
SGLang's native ``/generate`` with the prompt tokenised by the verifier's chat template
(``add_generation_prompt``). The rids start with ``regen-``, which the capture skips
(:mod:`sglang_patch.request_ids`), so no hidden states are dumped for them.

No request asks for more than the engine's context length allows (its ``/v1/models``, else the
verifier's config as SGLang derives it: :mod:`eagleflow.engine.context`): each answer's
``max_new_tokens`` is capped by the room its prompt leaves, and a conversation whose next prompt
leaves none ends at its last answered turn; the turns after it are dropped, counted in the row's
file (``shortened``) and in ``regenerate.json``. The verifier's answers are often longer than the
dataset's, so long multi-turn conversations outgrow the context halfway.

``OUT/rows/<row>.json`` is written atomically when a conversation is done, so a killed or failed
run resumes with the rows not yet done; ``OUT/conversations.jsonl`` (in input order, each line
with its ``source_row``) and ``OUT/regenerate.json`` appear when every row is done. A row the
engine fails on is named with its reason and the step fails; a row that is not a usable chat
row, or whose first prompt the chat template cannot render or leaves no room for an answer, fails
too (before any is regenerated), unless ``--skip-bad-rows`` leaves it out (listed in
``OUT/skipped_rows.jsonl``). Switches the template does not have (``--chat-template-kwargs``) are
refused before any row is read.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field

from eagleflow.config import ChatTemplateKwargs, WarmupTimeout, add_model_arguments, model_from_args
from eagleflow.data.chat_tokens import TemplateCannotRender, check_chat_template_kwargs, render_ids, rows_of_turns
from eagleflow.data.conversation import Chat, chat_of, is_chat_row, read_input_rows
from eagleflow.data.prepare import MAX_LISTED_ERRORS, SkipBadRows
from eagleflow.verifier import load_tokenizer, text_config
from eagleflow.engine import (
    EngineClient, EngineGone, EngineRequestSettings, RowFailed, ServerGone, ServerInfo, derived_context_length,
    max_new_tokens_left, wait_until_ready, with_retries,
)
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_json, atomic_write_text
from eagleflow.progress import Progress
from eagleflow.results import emit_result
from sglang_patch.request_ids import regenerate_request_id

CONVERSATIONS_FILE = "conversations.jsonl"
SUMMARY_FILE = "regenerate.json"
SKIPPED_FILE = "skipped_rows.jsonl"


class RegenerateConfig(EngineRequestSettings):
    """Flags of ``python -m eagleflow regenerate``."""

    input: Path = Field(description="conversations (messages or ShareGPT conversations): .jsonl, .parquet or a datasets folder")
    verifier: Path = Field(description="the verifier model folder (its chat template builds the prompts)")
    out: Path = Field(description="folder for rows/, conversations.jsonl and regenerate.json")
    server: str = Field(description="the running engine's base URL")
    server_pid: int | None = Field(None, description="the engine's process id on this machine (a dead engine stops the wait)")
    regen_temperature: float = Field(0.0, ge=0, title="Temperature", description="sampling temperature of the regenerated answers (0: greedy)")
    regen_max_new_tokens: int = Field(
        512, ge=1, title="Max new tokens per answer", description="longest regenerated answer, in tokens (fewer where the engine's context leaves less after the prompt)"
    )
    regen_concurrency: int = Field(8, ge=1, le=256, title="Conversations at once", description="conversations regenerated at once")
    skip_bad_rows: SkipBadRows
    warmup_timeout: WarmupTimeout
    chat_template_kwargs: ChatTemplateKwargs


class Regenerator:
    """Regenerates conversations through one engine with the verifier's chat template, within its context length.

    Built once the engine is ready: it asks the engine for its context length (:func:`engine_context_length`).
    """

    def __init__(self, cfg: RegenerateConfig) -> None:
        self.cfg = cfg
        try:
            self.tokenizer = load_tokenizer(cfg.verifier)
        except Exception as exc:
            raise UserError(f"--verifier {cfg.verifier}: cannot load a tokenizer: {exc}") from exc
        if not self.tokenizer.chat_template:
            raise UserError(f"--verifier {cfg.verifier} has no chat template to build prompts with")
        self.client = EngineClient(cfg.server, cfg.request_timeout)
        self.context_length, self.context_source = engine_context_length(self.client, cfg.verifier)

    def prompt(self, chat: Chat, turn: int) -> list[int]:
        """The token ids sent for the assistant turn at ``turn``: the messages before it and the generation prompt,
        with the row's tools and the run's chat template switches (as preparation and evaluation render them)."""
        return render_ids(self.tokenizer, Chat(chat.messages, chat.tools, self.cfg.chat_template_kwargs), turn, True)[0]

    def first_prompt_problem(self, chat: Chat) -> str | None:
        """Why the conversation cannot be regenerated at all (the template cannot render its first prompt, or it leaves
        no room), or None."""
        first = next(turn for turn, m in enumerate(chat.messages) if m["role"] == "assistant")
        try:
            prompt_tokens = len(self.prompt(chat, first))
        except TemplateCannotRender as exc:
            return exc.reason
        return self._no_room(prompt_tokens) if max_new_tokens_left(self.context_length, prompt_tokens) < 1 else None

    def _no_room(self, prompt_tokens: int) -> str:
        return (f"its first prompt is {prompt_tokens} tokens, which leaves no room for an answer in the engine's context "
                f"length of {self.context_length} tokens")

    def conversation(self, row: int, chat: Chat) -> dict[str, Any]:
        """The conversation with every assistant turn replaced by the engine's answer, in order, within the context;
        each turn's prompt ids as sent and output ids as produced are kept (``turns``): what the drafter trains on."""
        messages = [dict(m) for m in chat.messages]
        chat = Chat(messages, chat.tools)
        finish: list[Any] = []
        asked: list[int] = []
        turns: list[dict[str, list[int]]] = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                prompt = self.prompt(chat, turn)
            except TemplateCannotRender as exc:  # not retried: the same messages fail the same way
                raise RowFailed(exc.reason) from exc
            room = max_new_tokens_left(self.context_length, len(prompt))
            if room < 1:
                if not finish:  # regenerate() leaves such rows out before it starts; this is the backstop
                    raise RowFailed(self._no_room(len(prompt)))
                return self._shortened(row, messages, turn, len(prompt), finish, asked, turns)
            asked.append(min(self.cfg.regen_max_new_tokens, room))
            answer = self.client.complete(
                regenerate_request_id(row, turn), prompt, asked[-1], self.cfg.regen_temperature, row=row,
            )
            reason = (answer.get("meta_info") or {}).get("finish_reason")
            output = generated_ids(answer.get("output_ids") or [], reason)
            turns.append({"prompt_ids": prompt, "output_ids": output})
            # The next prompts render this answer from its text, as a client sending the conversation back would
            # (its thinking split off as a reasoning parser does); what is trained on are the ids above.
            message.pop("tool_calls", None)
            message.pop("reasoning_content", None)
            message.update(answer_message(self.tokenizer.decode(output, skip_special_tokens=True)))
            finish.append(reason)
        return self._record(row, messages, finish, asked, turns)

    def _shortened(
        self, row: int, messages: list[dict[str, Any]], turn: int, prompt_tokens: int, finish: list[Any], asked: list[int],
        turns: list[dict[str, list[int]]],
    ) -> dict[str, Any]:
        """The conversation ended at its last answered turn, because the prompt of the one at ``turn`` does not fit."""
        last = max(i for i in range(turn) if messages[i]["role"] == "assistant")
        record = self._record(row, messages[: last + 1], finish, asked, turns)
        record["shortened"] = {
            "at_message": turn, "prompt_tokens": prompt_tokens,
            "dropped_turns": sum(m["role"] == "assistant" for m in messages[turn:]),
            "dropped_messages": len(messages) - last - 1,
        }
        return record

    def _record(
        self, row: int, messages: list[dict[str, Any]], finish: list[Any], asked: list[int], turns: list[dict[str, list[int]]]
    ) -> dict[str, Any]:
        # max_new_tokens per answer: below regen_max_new_tokens where the room its prompt left capped it.
        return {"source_row": row, "messages": messages, "finish_reasons": finish, "max_new_tokens": asked,
                "capped_answers": sum(n < self.cfg.regen_max_new_tokens for n in asked), "context_length": self.context_length,
                "turns": turns}


def generated_ids(output_ids: list[int], finish_reason: Any) -> list[int]:
    """What the engine generated, its end-of-turn token included: an engine that leaves the matched stop token
    out of ``output_ids`` still generated it (and the drafter must learn to predict it)."""
    matched = finish_reason.get("matched") if isinstance(finish_reason, dict) and finish_reason.get("type") == "stop" else None
    if isinstance(matched, int) and not isinstance(matched, bool) and (not output_ids or output_ids[-1] != matched):
        return [*output_ids, matched]
    return list(output_ids)


def answer_message(text: str) -> dict[str, Any]:
    """An answer's text as a chat message: ``<think>…</think>`` split off into ``reasoning_content``, as SGLang's
    reasoning parsers (Qwen3, Kimi-K2.5, DeepSeek-R1) do; an answer without it is all ``content``."""
    opened = text.lstrip().startswith("<think>")
    if "</think>" not in text:
        return {"content": text}
    thinking, _, content = text.partition("</think>")
    thinking = thinking.lstrip().removeprefix("<think>") if opened else thinking
    return {"reasoning_content": thinking.strip("\n"), "content": content.lstrip("\n")}


def engine_context_length(client: EngineClient, verifier: Path) -> tuple[int, str]:
    """The engine's context length and where it came from: its ``/v1/models``, else the verifier's config."""
    length = client.context_length()
    if length is not None:
        return length, f"from {client.url}/v1/models"
    # An engine that does not say: SGLang's own derivation from the config it would load.
    return derived_context_length(text_config(verifier)), f"derived from {verifier / 'config.json'}; the engine does not report it"


def row_file(out: Path, row: int) -> Path:
    """Where a regenerated conversation waits until every row is done."""
    return out / "rows" / f"{row}.json"


def regenerate(cfg: RegenerateConfig) -> dict[str, Any]:
    """Regenerate every row not done yet; publish the JSONL when all are; return the summary."""
    started = time.monotonic()
    check_chat_template_kwargs(cfg.verifier, cfg.chat_template_kwargs, "--chat-template-kwargs")
    rows = list(read_input_rows(cfg.input))
    usable: list[tuple[int, Chat]] = []
    bad: list[tuple[int, str]] = []
    for row, record in rows:
        if isinstance(record, str):
            chat: Chat | str = record  # the line did not parse
        elif not is_chat_row(record):
            chat = "no 'messages' or 'conversations' (regeneration needs conversations, not token ids)"
        else:
            chat = chat_of(record)
        if isinstance(chat, str):
            bad.append((row, chat))
        else:
            usable.append((row, chat))
    if bad and not cfg.skip_bad_rows:
        listed = "; ".join(f"row {row}: {reason}" for row, reason in bad[:MAX_LISTED_ERRORS])
        raise UserError(f"{len(bad)} row(s) of {cfg.input} cannot be regenerated ({listed}); --skip-bad-rows leaves them out")
    todo = [(row, messages) for row, messages in usable if not row_file(cfg.out, row).is_file()]
    print(
        f"regenerate: {len(usable)} conversations, {len(usable) - len(todo)} already regenerated, {len(todo)} to do "
        f"at temperature {cfg.regen_temperature:g}, up to {cfg.regen_max_new_tokens} tokens per answer, "
        f"{cfg.regen_concurrency} at once, through {cfg.server}",
        flush=True,
    )
    failed: dict[int, str] = {}
    if todo:
        try:
            wait_until_ready(ServerInfo.at(cfg.server, cfg.server_pid), cfg.warmup_timeout)
        except EngineGone as exc:
            raise UserError(f"the engine at {cfg.server} {exc}") from exc
        regenerator = Regenerator(cfg)
        print(f"regenerate: context length {regenerator.context_length} tokens ({regenerator.context_source}); "
              "no answer asks for more than its prompt leaves", flush=True)
        no_room = [(row, why) for row, chat in todo if (why := regenerator.first_prompt_problem(chat))]
        if no_room and not cfg.skip_bad_rows:
            listed = "; ".join(f"row {row}: {reason}" for row, reason in no_room[:MAX_LISTED_ERRORS])
            raise UserError(f"{len(no_room)} row(s) of {cfg.input} cannot be regenerated ({listed}); --skip-bad-rows leaves them out")
        if no_room:
            left_out = {row for row, _ in no_room}
            bad = sorted(bad + no_room)
            usable = [(row, messages) for row, messages in usable if row not in left_out]
            todo = [(row, messages) for row, messages in todo if row not in left_out]
        if todo:
            failed = _regenerate_rows(regenerator, todo, cfg.out, cfg.regen_concurrency)
    if failed:
        listed = "; ".join(f"row {row}: {reason}" for row, reason in sorted(failed.items())[:MAX_LISTED_ERRORS])
        raise UserError(
            f"{len(failed)} row(s) could not be regenerated ({listed}); the {len(usable) - len(failed)} done rows are kept "
            f"in {cfg.out / 'rows'} and a rerun does only the rest"
        )
    return _publish(cfg, usable, bad, started)


def _regenerate_rows(regenerator: Regenerator, todo: list[tuple[int, Chat]], out: Path, concurrency: int) -> dict[int, str]:
    """Regenerate ``todo`` with ``concurrency`` in flight; each finished row is written at once."""
    progress = Progress(len(todo), label="conversations", every=max(1, min(50, len(todo) // 10)), interval=30.0)
    failed: dict[int, str] = {}
    shortened: list[int] = []

    def one(item: tuple[int, Chat]) -> None:
        row, chat = item

        def before_retry(exc: RowFailed, delay: float) -> None:
            print(f"row {row}: {exc}; retrying in {delay:.0f}s", flush=True)

        try:
            record = with_retries(lambda: regenerator.conversation(row, chat), regenerator.cfg.max_retries, before_retry=before_retry)
            atomic_write_json(row_file(out, row), record)
            if "shortened" in record:
                shortened.append(row)
        except (RowFailed, ServerGone) as exc:
            failed[row] = str(exc)
            print(f"row {row}: FAILED: {failed[row]}", flush=True)
        progress.advance(extra=f"failed {len(failed)}, shortened {len(shortened)}")

    with ThreadPoolExecutor(concurrency, thread_name_prefix="regenerate") as pool:
        list(pool.map(one, todo))
    return failed


def _publish(cfg: RegenerateConfig, usable: list[tuple[int, Any]], bad: list[tuple[int, str]], started: float) -> dict[str, Any]:
    lines = []
    shortened = dropped = capped = 0
    context_lengths: set[int] = set()
    for row, chat in usable:
        record = json.loads(row_file(cfg.out, row).read_text())
        line = {"messages": record["messages"], "source_row": row, **({"tools": chat.tools} if chat.tools else {})}
        if record.get("turns"):  # the engine's own ids (rows written before they were kept have none: their text is rendered)
            line["token_rows"] = [{"input_ids": ids, "loss_mask": mask} for ids, mask in rows_of_turns(
                [(t["prompt_ids"] + t["output_ids"], [0] * len(t["prompt_ids"]) + [1] * len(t["output_ids"])) for t in record["turns"]]
            )]
        lines.append(json.dumps(line) + "\n")
        cut = record.get("shortened")
        shortened += cut is not None
        dropped += cut["dropped_turns"] if cut else 0
        capped += record.get("capped_answers", 0)
        if "context_length" in record:  # rows written before the cap existed have none
            context_lengths.add(record["context_length"])
    conversations = cfg.out / CONVERSATIONS_FILE
    atomic_write_text(conversations, "".join(lines))
    if bad:
        atomic_write_text(cfg.out / SKIPPED_FILE, "".join(json.dumps({"row": r, "reason": why}) + "\n" for r, why in bad))
    summary = {
        "source": str(cfg.input),
        "regenerated": str(conversations),
        "rows": len(usable),
        "skipped_rows": len(bad),
        # Conversations that ended early because their next prompt left no room in the context,
        # the assistant turns they lost, and answers whose max_new_tokens the context cut.
        "shortened_conversations": shortened,
        "dropped_turns": dropped,
        "capped_answers": capped,
        # One length, unless rows were regenerated by engines of different lengths across reruns.
        "context_length": next(iter(context_lengths)) if len(context_lengths) == 1 else sorted(context_lengths) or None,
        "temperature": cfg.regen_temperature,
        "max_new_tokens": cfg.regen_max_new_tokens,
        "verifier": str(cfg.verifier),
        "seconds": round(time.monotonic() - started, 1),
    }
    atomic_write_json(cfg.out / SUMMARY_FILE, summary)
    print(
        f"regenerate: {len(usable)} conversations in {conversations} (from {cfg.input}); {shortened} shortened to fit the "
        f"context ({dropped} turns dropped, {capped} answers capped); {len(bad)} rows left out",
        flush=True,
    )
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, RegenerateConfig)


def main(args: argparse.Namespace) -> int:
    summary = regenerate(model_from_args(RegenerateConfig, args))
    keys = ("regenerated", "rows", "skipped_rows", "shortened_conversations", "dropped_turns", "source")
    emit_result({key: summary[key] for key in keys})
    return 0
