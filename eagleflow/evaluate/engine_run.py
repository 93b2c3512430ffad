"""One engine for an evaluation: started in its own session, asked greedy generations, stopped.

The engine is the same process an operator would launch (:mod:`eagleflow.engine.process`), so
its log, readiness and stop behave as in the rest of the pipeline; the requests are SGLang's
native ``/generate`` with ``temperature`` 0, whose answers carry the spec fields. The engine is
the step's own: it is stopped when the step ends, is stopped (SIGTERM, SIGINT: the step's
``finally``) or dies outright (the kernel's parent-death signal, :func:`start_server` ``owned``).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleflow.engine import (
    EngineClient, EngineGone, RowFailed, ServerGone, ServerInfo, start_server, stop_server, wait_until_ready
)
from eagleflow.errors import UserError
from eagleflow.evaluate.prompts import ChatPrompts, Prompt


class EngineFailed(UserError):
    """The evaluation engine died or never became ready; the message holds its log's tail."""


SPEC_COUNTS = ("completion_tokens", "spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts")


@dataclass(frozen=True)
class Generation:
    """One prompt's answer (all its turns): the tokens, how long it took, and SGLang's ``meta_info``
    (counts summed over the turns, ``spec_accept_length`` recomputed from them)."""

    row: int
    output_ids: list[int]
    seconds: float
    meta: dict[str, Any]

    @property
    def completion_tokens(self) -> int:
        return int(self.meta.get("completion_tokens", len(self.output_ids)))


@dataclass
class TimedPass:
    """One prompt set decoded with ``batch_size`` requests in flight, timed as a whole (SpecForge's output throughput)."""

    generations: list[Generation] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, part: TimedPass) -> None:
        """Fold in one slice of the prompt set (its answers and its wall time): an interleaved pass is timed slice by slice."""
        self.generations += part.generations
        self.seconds += part.seconds

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(g.completion_tokens for g in self.generations)
        return tokens / self.seconds if self.seconds else 0.0


@contextlib.contextmanager
def running_engine(argv: list[str], env: dict[str, str], folder: Path, port: int, timeout: float) -> Iterator[ServerInfo]:
    """Start the engine, wait until it answers ``/health_generate``, stop its process group afterwards
    (also when a signal or an error ends the step: see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    info = start_server(argv, env, folder / "server.log", folder / "server.json", url, folder / "dumps", owned=True)
    try:
        try:
            wait_until_ready(info, timeout)
        except EngineGone as exc:
            raise EngineFailed(f"the evaluation engine {exc}") from exc
        yield info
    finally:
        print(f"evaluate: {stop_server(int(info.pid or 0), grace=30.0)}", flush=True)


def generate(client: EngineClient, prompt: Prompt, max_new_tokens: int, label: str, chat: ChatPrompts | None = None) -> Generation:
    """One greedy answer to ``prompt``, turn by turn (a follow-up comes after the engine's own previous answer);
    a failed request is an error naming the row."""
    began = time.monotonic()
    ids, messages = prompt.input_ids, list(prompt.messages)
    output: list[int] = []
    answer_ids: list[int] = []  # the previous turn's answer, which a follow-up comes after
    totals: dict[str, int] = {}
    for turn in range(1 + len(prompt.followups)):
        if turn:
            assert chat is not None, "follow-up turns need the chat template"
            messages += [{"role": "assistant", "content": chat.decode(answer_ids)},
                         {"role": "user", "content": prompt.followups[turn - 1]}]
            ids = chat.encode(messages)
        try:
            answer = client.complete(f"eval-{label}-{prompt.row}-{uuid.uuid4().hex[:8]}", ids, max_new_tokens, 0.0, row=prompt.row)
        except (RowFailed, ServerGone) as exc:
            raise UserError(f"row {prompt.row}: the {label} engine failed: {exc}") from exc
        answer_ids = list(answer.get("output_ids") or [])
        output += answer_ids
        meta = dict(answer.get("meta_info") or {})
        for key in SPEC_COUNTS:
            if key in meta:
                totals[key] = totals.get(key, 0) + int(meta[key])
    if totals.get("spec_verify_ct"):
        totals_meta: dict[str, Any] = {**totals, "spec_accept_length": totals.get("completion_tokens", len(output)) / totals["spec_verify_ct"]}
    else:
        totals_meta = dict(totals)
    return Generation(prompt.row, output, time.monotonic() - began, totals_meta)


def timed_pass(client: EngineClient, prompts: Sequence[Prompt], max_new_tokens: int, batch_size: int, label: str,
               chat: ChatPrompts | None = None) -> TimedPass:
    """All ``prompts`` with ``batch_size`` requests in flight, timed from the first request to the last answer."""
    result = TimedPass()
    began = time.monotonic()
    pool = ThreadPoolExecutor(batch_size, thread_name_prefix=f"eval-{label}")
    try:
        result.generations = list(pool.map(lambda p: generate(client, p, max_new_tokens, label, chat), prompts))
    finally:
        # Not waiting for requests in flight: a stopped step must stop its engine now, which ends them.
        pool.shutdown(wait=False, cancel_futures=True)
    result.seconds = time.monotonic() - began
    return result
