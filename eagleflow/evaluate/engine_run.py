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

from eagleflow.engine.process import EngineGone, ServerInfo, start_server, stop_server, wait_until_ready
from eagleflow.errors import UserError
from eagleflow.evaluate.prompts import Prompt
from eagleflow.extract.client import EngineClient, RowFailed, ServerGone
from eagleflow.progress import Progress


class EngineFailed(UserError):
    """The evaluation engine died or never became ready; the message holds its log's tail."""


@dataclass(frozen=True)
class Generation:
    """One answer: the tokens, how long it took, and SGLang's ``meta_info``."""

    row: int
    output_ids: list[int]
    seconds: float
    meta: dict[str, Any]

    @property
    def completion_tokens(self) -> int:
        return int(self.meta.get("completion_tokens", len(self.output_ids)))


@dataclass
class EngineMeasurement:
    """What one engine did with the prompts: one at a time, then several in flight."""

    single: list[Generation] = field(default_factory=list)
    concurrent: list[Generation] = field(default_factory=list)
    concurrent_seconds: float = 0.0

    @property
    def single_tokens_per_s(self) -> float:
        seconds = sum(g.seconds for g in self.single)
        return sum(g.completion_tokens for g in self.single) / seconds if seconds else 0.0

    @property
    def concurrent_tokens_per_s(self) -> float:
        tokens = sum(g.completion_tokens for g in self.concurrent)
        return tokens / self.concurrent_seconds if self.concurrent_seconds else 0.0


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


def generate(client: EngineClient, prompt: Prompt, max_new_tokens: int, label: str) -> Generation:
    """One greedy generation of ``prompt``; a failed request is an error naming the row."""
    began = time.monotonic()
    try:
        answer = client.complete(
            f"eval-{label}-{prompt.row}-{uuid.uuid4().hex[:8]}", prompt.input_ids, max_new_tokens, 0.0, row=prompt.row
        )
    except (RowFailed, ServerGone) as exc:
        raise UserError(f"row {prompt.row}: the {label} engine failed: {exc}") from exc
    seconds = time.monotonic() - began
    return Generation(prompt.row, list(answer.get("output_ids") or []), seconds, dict(answer.get("meta_info") or {}))


def measure(url: str, prompts: Sequence[Prompt], max_new_tokens: int, concurrency: int, label: str) -> EngineMeasurement:
    """The prompts one at a time (with a progress line), then all of them with ``concurrency`` in flight."""
    client = EngineClient(url, request_timeout=3600.0)
    result = EngineMeasurement()
    progress = Progress(len(prompts), label=f"{label} prompts", every=max(1, len(prompts) // 4), interval=30.0)
    for prompt in prompts:
        result.single.append(generate(client, prompt, max_new_tokens, label))
        progress.advance(extra=f"{result.single_tokens_per_s:.1f} tokens/s")
    began = time.monotonic()
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"eval-{label}")
    try:
        result.concurrent = list(pool.map(lambda p: generate(client, p, max_new_tokens, label), prompts))
    finally:
        # Not waiting for requests in flight: a stopped step must stop its engine now, which ends them.
        pool.shutdown(wait=False, cancel_futures=True)
    result.concurrent_seconds = time.monotonic() - began
    print(
        f"evaluate: {label}: {result.single_tokens_per_s:.1f} tokens/s one at a time, "
        f"{result.concurrent_tokens_per_s:.1f} tokens/s with {concurrency} in flight",
        flush=True,
    )
    return result

