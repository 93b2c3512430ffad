"""``regenerate``: the dataset's assistant turns rewritten by the verifier, through the running engine.

A drafter learns to predict its verifier; answers written by people or another model teach it
the wrong distribution. For every conversation, each assistant turn in order is replaced by the
engine's own answer to the conversation so far (earlier turns already regenerated), sent as
SGLang's native ``/generate`` with the prompt tokenised by the verifier's chat template
(``add_generation_prompt``). The rids start with ``regen-``, which the capture skips
(:mod:`sglang_patch.request_ids`), so no hidden states are dumped for them.

``OUT/rows/<row>.json`` is written atomically when a conversation is done, so a killed or failed
run resumes with the rows not yet done; ``OUT/conversations.jsonl`` (in input order, each line
with its ``source_row``) and ``OUT/regenerate.json`` appear when every row is done. A row the
engine fails on is named with its reason and the step fails; a row that is not a usable chat
row fails too, unless ``--skip-bad-rows`` leaves it out (listed in ``OUT/skipped_rows.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.data.prepare import MAX_LISTED_ERRORS, check_messages, read_input_rows
from eagleflow.engine.process import EngineGone, ServerInfo, wait_until_ready
from eagleflow.errors import UserError
from eagleflow.extract.client import EngineClient, RowFailed, ServerGone
from eagleflow.files import atomic_write_json, atomic_write_text
from eagleflow.progress import Progress
from eagleflow.results import emit_result
from sglang_patch.request_ids import regenerate_request_id

CONVERSATIONS_FILE = "conversations.jsonl"
SUMMARY_FILE = "regenerate.json"
SKIPPED_FILE = "skipped_rows.jsonl"
# Tries of a conversation after a 5xx answer, a timeout or a dropped connection.
MAX_ATTEMPTS = 3


class RegenerateConfig(BaseModel):
    """Flags of ``python -m eagleflow regenerate``."""

    input: Path = Field(description="chat conversations ({'messages': [...]}): .jsonl or .parquet")
    tokenizer: Path = Field(description="the verifier model folder (its chat template builds the prompts)")
    out: Path = Field(description="folder for rows/, conversations.jsonl and regenerate.json")
    server: str = Field(description="the running engine's base URL")
    server_pid: int | None = Field(None, description="the engine's process id on this machine (a dead engine stops the wait)")
    regen_temperature: float = Field(0.0, ge=0, description="sampling temperature of the regenerated answers (0: greedy)")
    regen_max_new_tokens: int = Field(512, ge=1, description="longest regenerated answer, in tokens")
    regen_concurrency: int = Field(8, ge=1, le=256, description="conversations regenerated at once")
    skip_bad_rows: bool = Field(False, description="leave out rows that are not usable chat rows (listed) instead of failing")
    warmup_timeout: float = Field(2700.0, gt=0, description="seconds to wait for the engine to become ready")
    request_timeout: float = Field(600.0, gt=0, description="seconds to wait for one answer")


class Regenerator:
    """Regenerates conversations through one engine with the verifier's chat template."""

    def __init__(self, cfg: RegenerateConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(cfg.tokenizer))
        except Exception as exc:
            raise UserError(f"--tokenizer {cfg.tokenizer}: cannot load a tokenizer: {exc}") from exc
        if not self.tokenizer.chat_template:
            raise UserError(f"--tokenizer {cfg.tokenizer} has no chat template to build prompts with")
        self.client = EngineClient(cfg.server, cfg.request_timeout)

    def conversation(self, row: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """``messages`` with every assistant turn replaced by the engine's answer, in order."""
        messages = [dict(m) for m in messages]
        finish: list[Any] = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, tokenize=True, return_dict=True)
            answer = self.client.complete(
                regenerate_request_id(row, turn), list(prompt["input_ids"]), self.cfg.regen_max_new_tokens,
                self.cfg.regen_temperature, row=row,
            )
            # The answer's tokens, not its text: SGLang and the reference engine differ in whether
            # the text keeps the end-of-turn token; the template adds it back.
            message["content"] = self.tokenizer.decode(answer.get("output_ids") or [], skip_special_tokens=True)
            finish.append((answer.get("meta_info") or {}).get("finish_reason"))
        return {"source_row": row, "messages": messages, "finish_reasons": finish}


def row_file(out: Path, row: int) -> Path:
    """Where a regenerated conversation waits until every row is done."""
    return out / "rows" / f"{row}.json"


def regenerate(cfg: RegenerateConfig) -> dict[str, Any]:
    """Regenerate every row not done yet; publish the JSONL when all are; return the summary."""
    started = time.monotonic()
    rows = list(read_input_rows(cfg.input))
    usable: list[tuple[int, list[dict[str, Any]]]] = []
    bad: list[tuple[int, str]] = []
    for row, record in rows:
        if isinstance(record, str):
            problem: str | None = record  # the line did not parse
        elif "messages" not in record:
            problem = "no 'messages' (regeneration needs chat rows, not token ids)"
        else:
            problem = check_messages(record["messages"])
        if problem:
            bad.append((row, problem))
        else:
            usable.append((row, record["messages"]))
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
        failed = _regenerate_rows(Regenerator(cfg), todo, cfg.out, cfg.regen_concurrency)
    if failed:
        listed = "; ".join(f"row {row}: {reason}" for row, reason in sorted(failed.items())[:MAX_LISTED_ERRORS])
        raise UserError(
            f"{len(failed)} row(s) could not be regenerated ({listed}); the {len(usable) - len(failed)} done rows are kept "
            f"in {cfg.out / 'rows'} and a rerun does only the rest"
        )
    return _publish(cfg, usable, bad, started)


def _regenerate_rows(regenerator: Regenerator, todo: list[tuple[int, list[dict[str, Any]]]], out: Path, concurrency: int) -> dict[int, str]:
    """Regenerate ``todo`` with ``concurrency`` in flight; each finished row is written at once."""
    progress = Progress(len(todo), label="conversations", every=max(1, min(50, len(todo) // 10)), interval=30.0)
    failed: dict[int, str] = {}

    def one(item: tuple[int, list[dict[str, Any]]]) -> None:
        row, messages = item
        delay = 1.0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                atomic_write_json(row_file(out, row), regenerator.conversation(row, messages))
                break
            except RowFailed as exc:
                if exc.retryable and attempt < MAX_ATTEMPTS:
                    print(f"row {row}: {exc}; retrying in {delay:.0f}s", flush=True)
                    time.sleep(delay)
                    delay *= 2
                    continue
                failed[row] = str(exc) + (f" (after {attempt} attempts)" if exc.retryable else "")
            except ServerGone as exc:
                failed[row] = str(exc)
            print(f"row {row}: FAILED: {failed[row]}", flush=True)
            break
        progress.advance(extra=f"failed {len(failed)}")

    with ThreadPoolExecutor(concurrency, thread_name_prefix="regenerate") as pool:
        list(pool.map(one, todo))
    return failed


def _publish(cfg: RegenerateConfig, usable: list[tuple[int, Any]], bad: list[tuple[int, str]], started: float) -> dict[str, Any]:
    lines = []
    for row, _ in usable:
        record = json.loads(row_file(cfg.out, row).read_text())
        lines.append(json.dumps({"messages": record["messages"], "source_row": row}) + "\n")
    conversations = cfg.out / CONVERSATIONS_FILE
    atomic_write_text(conversations, "".join(lines))
    if bad:
        atomic_write_text(cfg.out / SKIPPED_FILE, "".join(json.dumps({"row": r, "reason": why}) + "\n" for r, why in bad))
    summary = {
        "source": str(cfg.input),
        "regenerated": str(conversations),
        "rows": len(usable),
        "skipped_rows": len(bad),
        "temperature": cfg.regen_temperature,
        "max_new_tokens": cfg.regen_max_new_tokens,
        "verifier": str(cfg.tokenizer),
        "seconds": round(time.monotonic() - started, 1),
    }
    atomic_write_json(cfg.out / SUMMARY_FILE, summary)
    print(f"regenerate: {len(usable)} conversations in {conversations} (from {cfg.input}); {len(bad)} rows left out", flush=True)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, RegenerateConfig)


def main(args: argparse.Namespace) -> int:
    summary = regenerate(model_from_args(RegenerateConfig, args))
    emit_result({key: summary[key] for key in ("regenerated", "rows", "skipped_rows", "source")})
    return 0
