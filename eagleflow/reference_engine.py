"""``python -m eagleflow serve-reference``: a CPU/GPU stand-in for SGLang that captures hidden states.

SGLang cannot run on CPU machines, so the CPU path (and the GPU correctness oracle for the SGLang
hook) is this small HTTP server backed by ``transformers``. It answers the subset of SGLang's
native API the pipeline uses, with SGLang 0.5.9's field names, status codes and error bodies
(read from ``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py`` and
``managers/tokenizer_manager.py``):

- ``POST /generate`` ``{"rid", "input_ids" | "text", "sampling_params": {"max_new_tokens", "temperature"}}``
  -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "e2e_latency", ...}}``. A request error is 400 ``{"error": {"message"}}`` (SGLang's
  ``_create_error_response``); a body without ``text``/``input_ids`` gets SGLang's own message.
  Like SGLang, ``/generate`` is served as soon as the port is open; only the health checks wait
  for the warmup.
- ``GET /health`` and ``/health_generate``: 503 until the warmup is done, then a real 1-token
  forward with a ``HEALTH_CHECK_<time>`` rid (SGLang's default for both paths) and 200.
- ``GET /model_info`` (and its deprecated name ``/get_model_info``): answers at once.

Every prefill of a request whose rid does not start with ``HEALTH_CHECK`` is captured by hooks
(:mod:`eagleflow.capture`) and written by the same :class:`sglang_patch.dump_writer.DumpWriter` as
the SGLang hook, to ``<dump_dir>/<rid>.safetensors``, before the HTTP answer is sent.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, field_validator

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_text

if TYPE_CHECKING:
    import torch

# SGLang's log line when its warmup request succeeded; the launcher/sensor side may grep for it.
READY_LINE = "The server is fired up and ready to roll!"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
# SGLang's GenerateReqInput validation message (io_struct.py, _validate_inputs).
NO_INPUT_MESSAGE = "Either text, input_ids or input_embeds should be provided."
# SGLang's SamplingParams defaults (sampling_params.py) for fields a client leaves out.
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_TEMPERATURE = 1.0
GREEDY_BELOW_TEMPERATURE = 1e-6  # SGLang treats temperatures under this as greedy (top_k = 1)
# The extractor's rid naming: ``row{N}-{anything}``.
ROW_RID = re.compile(r"^row(\d+)-")
STATS_INTERVAL_S = 30.0


class ReferenceEngineConfig(BaseModel):
    """Flags of ``python -m eagleflow serve-reference``."""

    model: Path = Field(description="local folder of a transformers causal LM (config.json + safetensors)")
    dump_dir: Path = Field(description="folder the per-request hidden-state dumps <rid>.safetensors go to")
    aux_layers: list[int] = Field(
        description="layer ids to capture, comma-separated: id k = the state entering decoder layer k, "
        "n = the last layer's output before the final norm; the final pre-norm state is always added as the last slot"
    )
    host: str = Field("127.0.0.1", description="address to bind (keep 127.0.0.1 unless a remote client must reach it)")
    port: int = Field(30000, ge=0, le=65535, description="TCP port to bind (SGLang's default 30000; 0 = any free port, printed at start)")
    warmup_seconds: float = Field(
        0.0, ge=0, description="simulated warmup: /health answers 503 this long after the model is loaded (one real forward runs meanwhile)"
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the model runs")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="model dtype; auto = the dtype in the model's config.json (dumps are always bf16)"
    )
    threads: int = Field(
        0, ge=0, description="CPU threads for torch (0 = torch's default, one per core); 1 avoids thrashing on a shared small machine"
    )
    trust_remote_code: bool = Field(False, description="allow the model folder's own modelling code (Kimi-K2.5 needs it)")
    fail_row: list[int] = Field(
        default_factory=list,
        description="TEST ONLY: comma list of rows whose requests (rid row{N}-…) answer 500, once across restarts "
        "(a marker <dump_dir>/.fail-row-N.injected records that the failure was injected)",
    )

    @field_validator("aux_layers")
    @classmethod
    def _aux_not_empty(cls, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("give at least one layer id, e.g. 2,4,6")
        return ids

    @field_validator("fail_row")
    @classmethod
    def _rows_not_negative(cls, rows: list[int]) -> list[int]:
        bad = [r for r in rows if r < 0]
        if bad:
            raise ValueError(f"row numbers must be >= 0, got {bad}")
        return rows


class RequestError(Exception):
    """A request the engine answers with an error status; ``body`` is SGLang's error JSON for it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def body(self) -> dict[str, Any]:
        if self.status == HTTPStatus.BAD_REQUEST:
            # http_server._create_error_response: what a ValueError in the tokenizer manager becomes.
            return {"error": {"message": self.message}}
        # http_server's HTTPException handler (ErrorResponse), used for scheduler aborts (500/503).
        return {"object": "error", "message": self.message, "type": str(self.status), "param": None, "code": self.status}


def fail_row_marker(dump_dir: str | os.PathLike[str], row: int) -> Path:
    """The marker that records that ``--fail-row row`` has injected its one failure."""
    return Path(dump_dir) / f".fail-row-{row}.injected"


class ReferenceEngine:
    """The model, its capture settings and the request logic, independent of the HTTP layer.

    :param model: a loaded ``transformers`` causal LM in eval mode.
    :param tokenizer: its tokenizer, or None when the folder has none (then only ``input_ids`` work).
    :param config: the engine's flags.
    """

    def __init__(self, model: Any, tokenizer: Any, config: ReferenceEngineConfig) -> None:
        from eagleflow.capture import check_aux_layer_ids, decoder_layers_and_norm, model_device
        from sglang_patch.dump_writer import DumpWriter

        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model_device(model)
        layers, _ = decoder_layers_and_norm(model)
        self.num_layers = len(layers)
        try:
            self.aux_layer_ids = check_aux_layer_ids(config.aux_layers, self.num_layers)
        except ValueError as exc:
            raise UserError(f"--aux-layers: {exc}") from exc
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.context_length = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.eos_token_ids = _eos_token_ids(model)
        # Only the last position's logits are needed; older/remote modelling code may lack the knob.
        self._logits_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self.writer = DumpWriter(config.dump_dir)
        self.ready = threading.Event()
        self.shutting_down = False
        self.warmup_error: str | None = None
        self._forward_lock = threading.Lock()  # one forward at a time; requests queue on it
        # Rows still to fail in this process: a marker left by an earlier process means its one
        # injected failure already happened.
        self.fail_rows_pending = {r for r in config.fail_row if not fail_row_marker(config.dump_dir, r).exists()}
        self._stats_lock = threading.Lock()
        self._requests = 0
        self._failed = 0
        self._prompt_tokens = 0
        self._last_stats = (time.monotonic(), 0, 0)

    @classmethod
    def load(cls, config: ReferenceEngineConfig) -> ReferenceEngine:
        """Load the model (and its tokenizer when the folder has one) named by ``config.model``."""
        import torch
        from transformers import AutoModelForCausalLM

        if not (config.model / "config.json").is_file():
            raise UserError(f"--model: {config.model} is not a model folder (no config.json there)")
        if config.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device here; use --device cpu")
        if config.threads:
            torch.set_num_threads(config.threads)
        dtype: Any = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(config.model), dtype=dtype, trust_remote_code=config.trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise UserError(f"--model: cannot load {config.model}: {exc}") from exc
        model.to(config.device).eval()
        return cls(model, _load_tokenizer(config.model, config.trust_remote_code), config)

    # ---- requests -------------------------------------------------------------------------

    def generate(self, body: Any) -> dict[str, Any]:
        """Answer one ``/generate`` body; raises :class:`RequestError` for an error answer."""
        started = time.time()
        rid: Any = body.get("rid") if isinstance(body, dict) else None  # for the log line, until parsed
        try:
            rid, input_ids, max_new_tokens, temperature, ignore_eos = self._parse_request(body)
            if not rid.startswith(HEALTH_CHECK_PREFIX):
                self._maybe_inject_failure(rid)
            try:
                output_ids, finish_reason = self._run(rid, input_ids, max_new_tokens, temperature, ignore_eos)
            except Exception as exc:  # the model failed (e.g. out of memory): a 500 naming it, the server lives on
                traceback.print_exc()
                raise RequestError(500, f"rid {rid}: forward failed: {type(exc).__name__}: {exc}") from exc
        except RequestError as exc:
            self._count(0, failed=True)
            print(f"generate rid={rid}: HTTP {exc.status}: {exc.message}", file=sys.stderr, flush=True)
            raise
        if not rid.startswith(HEALTH_CHECK_PREFIX):
            self._count(len(input_ids), failed=False)
        return {
            "text": self._decode(output_ids),
            "output_ids": output_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish_reason,
                "prompt_tokens": len(input_ids),
                "weight_version": "default",
                "total_retractions": 0,
                "completion_tokens": len(output_ids),
                # No prefix cache here, so every prompt token is computed (and captured).
                "cached_tokens": 0,
                "e2e_latency": time.time() - started,
            },
        }

    def health(self) -> bool:
        """SGLang's ``/health_generate``: False before warmup or during shutdown, else a real 1-token forward."""
        if self.shutting_down or not self.ready.is_set():
            return False
        rid = f"{HEALTH_CHECK_PREFIX}_{time.time()}"
        try:
            self.generate({"rid": rid, "input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        except Exception as exc:  # an unhealthy model is a 503, never a crashed endpoint
            print(f"health check failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return False
        return True

    def model_info(self) -> dict[str, Any]:
        """``/model_info``: SGLang's fields, plus the shape facts a client of this engine needs."""
        return {
            "model_path": str(self.config.model),
            "tokenizer_path": str(self.config.model) if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
            # Extras (not in SGLang's answer): enough to size and check dumps without the model.
            "engine": "eagleflow-reference",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "aux_layer_ids": self.aux_layer_ids,
            "num_hidden_state_slots": len(self.aux_layer_ids) + 1,
            "dump_dir": str(self.config.dump_dir),
        }

    def warmup(self) -> None:
        """One real forward (as SGLang's warmup request), then wait out ``--warmup-seconds``; sets :attr:`ready`."""
        started = time.monotonic()
        try:
            ids = [i % self.vocab_size for i in (10, 11, 12)]  # SGLang's warmup ids without a tokenizer
            self._run("WARMUP", ids, max_new_tokens=1, temperature=0.0, ignore_eos=True, dump=False)
        except Exception as exc:
            self.warmup_error = f"{type(exc).__name__}: {exc}"
            print(f"warmup forward failed: {self.warmup_error}", file=sys.stderr, flush=True)
            return
        remaining = self.config.warmup_seconds - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
        self.ready.set()
        print(READY_LINE, flush=True)

    def close(self) -> None:
        """Write every queued dump, then stop the writer thread."""
        self.shutting_down = True
        self.writer.close()
        for message in self.writer.write_errors:
            print(f"dump write failed: {message}", file=sys.stderr, flush=True)

    # ---- internals ------------------------------------------------------------------------

    def _parse_request(self, body: Any) -> tuple[str, list[int], int, float, bool]:
        if isinstance(body, list):
            raise RequestError(400, "a JSON list of requests is not supported by the reference engine; send one request per call")
        if not isinstance(body, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        rid = body.get("rid")
        if rid is None:
            rid = uuid.uuid4().hex  # SGLang's default rid
        if not isinstance(rid, str):
            raise RequestError(400, f"rid must be a string, got {type(rid).__name__} (batch requests are not supported)")
        # The rid becomes a file name in the dump folder: it must not leave that folder.
        if not rid or "/" in rid or "\\" in rid or rid.startswith("."):
            raise RequestError(400, f"rid {rid!r} must be a plain file name (no '/', '\\', leading '.')")
        if body.get("stream"):
            raise RequestError(400, f"rid {rid}: stream is not supported by the reference engine; send stream: false")
        if body.get("input_embeds") is not None:
            raise RequestError(400, f"rid {rid}: input_embeds is not supported by the reference engine; send input_ids")
        input_ids = body.get("input_ids")
        text = body.get("text")
        if input_ids is None and text is None:
            # Also what a vLLM-style body ({"prompt_token_ids": [...]}) gets: SGLang drops unknown keys.
            raise RequestError(400, NO_INPUT_MESSAGE)
        if input_ids is None:
            input_ids = self._tokenize(rid, text)
        input_ids = self._check_input_ids(rid, input_ids)

        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError(400, f"rid {rid}: sampling_params must be a JSON object, got {type(params).__name__}")
        max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if max_new_tokens is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise RequestError(400, f"rid {rid}: sampling_params.max_new_tokens must be at least 0, got {max_new_tokens!r}.")
        temperature = params.get("temperature", DEFAULT_TEMPERATURE)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise RequestError(400, f"rid {rid}: sampling_params.temperature must be a number >= 0, got {temperature!r}.")
        ignore_eos = bool(params.get("ignore_eos", False))
        if self.context_length and len(input_ids) > self.context_length:
            raise RequestError(
                400,
                f"rid {rid}: The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens).",
            )
        return rid, input_ids, int(max_new_tokens), float(temperature), ignore_eos

    def _tokenize(self, rid: str, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(400, f"rid {rid}: text must be a string, got {type(text).__name__} (batch requests are not supported)")
        if self.tokenizer is None:
            raise RequestError(400, f"rid {rid}: text needs a tokenizer and {self.config.model} has none; send input_ids")
        return list(self.tokenizer.encode(text))

    def _check_input_ids(self, rid: str, input_ids: Any) -> list[int]:
        if not isinstance(input_ids, list):
            raise RequestError(400, f"rid {rid}: input_ids must be a list of token ids, got {type(input_ids).__name__}")
        if not input_ids:
            raise RequestError(400, f"rid {rid}: input_ids is empty")
        for position, token in enumerate(input_ids):
            if isinstance(token, list):
                raise RequestError(400, f"rid {rid}: input_ids is a list of lists; batch requests are not supported")
            if not _is_int(token):
                raise RequestError(400, f"rid {rid}: input_ids[{position}] = {token!r} is not an integer token id")
            if not 0 <= token < self.vocab_size:
                raise RequestError(
                    400, f"rid {rid}: input_ids[{position}] = {token} is outside the vocabulary [0, {self.vocab_size})"
                )
        return input_ids

    def _maybe_inject_failure(self, rid: str) -> None:
        match = ROW_RID.match(rid)
        if not match or int(match.group(1)) not in self.fail_rows_pending:
            return
        row = int(match.group(1))
        marker = fail_row_marker(self.config.dump_dir, row)
        if not marker.exists():
            atomic_write_text(marker, f"{rid}\n")
        raise RequestError(500, f"injected failure for row {row} (--fail-row)")

    def _run(
        self, rid: str, input_ids: list[int], max_new_tokens: int, temperature: float, ignore_eos: bool, dump: bool = True
    ) -> tuple[list[int], dict[str, Any]]:
        """Prefill (captured unless a health check or ``dump=False``), then up to ``max_new_tokens`` decode steps."""
        import torch

        from eagleflow.capture import HiddenStateCapture

        capture = dump and not rid.startswith(HEALTH_CHECK_PREFIX)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        output_ids: list[int] = []
        finish_reason: dict[str, Any] = {"type": "length", "length": max_new_tokens}
        with self._forward_lock, torch.inference_mode():
            if capture:
                with HiddenStateCapture(self.model, self.aux_layer_ids) as hooks:
                    out = self.model(input_ids=ids, use_cache=max_new_tokens > 1, **self._logits_kwargs)
                states = hooks.stacked()
                self.writer.submit(rid, states, torch.tensor(input_ids, dtype=torch.int64))
            else:
                out = self.model(input_ids=ids, use_cache=max_new_tokens > 1, **self._logits_kwargs)
            for step in range(max_new_tokens):
                token = _pick_token(out.logits[0, -1], temperature)
                output_ids.append(token)
                if token in self.eos_token_ids and not ignore_eos:
                    finish_reason = {"type": "stop", "matched": token}
                    break
                if step + 1 < max_new_tokens:
                    out = self.model(
                        input_ids=torch.tensor([[token]], device=self.device),
                        past_key_values=out.past_key_values,
                        use_cache=True,
                        **self._logits_kwargs,
                    )
        if capture:
            # The client checks the dump right after our answer: it must be on disk by then.
            self.writer.flush()
        return output_ids, finish_reason

    def _decode(self, output_ids: list[int]) -> str:
        return self.tokenizer.decode(output_ids) if self.tokenizer is not None and output_ids else ""

    def _count(self, prompt_tokens: int, failed: bool) -> None:
        """Count a request and print a rate line every ``STATS_INTERVAL_S`` seconds (a server runs for hours)."""
        with self._stats_lock:
            self._requests += 1
            self._failed += int(failed)
            self._prompt_tokens += prompt_tokens
            now = time.monotonic()
            last_time, last_requests, last_tokens = self._last_stats
            if now - last_time < STATS_INTERVAL_S:
                return
            elapsed = now - last_time
            self._last_stats = (now, self._requests, self._prompt_tokens)
            line = (
                f"generate: {self._requests} requests ({self._failed} failed), {self._prompt_tokens} prompt tokens; "
                f"last {elapsed:.0f}s: {(self._requests - last_requests) / elapsed:.2f} req/s, "
                f"{(self._prompt_tokens - last_tokens) / elapsed:.0f} prompt tok/s"
            )
        print(line, flush=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pick_token(logits: torch.Tensor, temperature: float) -> int:
    import torch

    if temperature < GREEDY_BELOW_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1))


def _eos_token_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


def _load_tokenizer(model_dir: Path, trust_remote_code: bool) -> Any:
    """The folder's tokenizer, or None when it ships none (a bare test model)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
    if not any((model_dir / name).exists() for name in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


# ---- HTTP -------------------------------------------------------------------------------------


def create_app(engine: ReferenceEngine) -> Any:
    """The ASGI app serving ``engine`` (Starlette, which FastAPI/SGLang build on).

    Handlers hand the work to the thread pool so several requests are in flight at once; the
    engine serialises the forward passes itself.
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def generate(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            # SGLang's RequestValidationError handler: 400 with its ErrorResponse body.
            message = f"the request body is not valid JSON: {exc}"
            return JSONResponse(
                {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, status_code=400
            )
        try:
            return JSONResponse(await run_in_threadpool(engine.generate, body))
        except RequestError as exc:
            return JSONResponse(exc.body, status_code=exc.status)

    async def health(request: Request) -> Response:
        healthy = await run_in_threadpool(engine.health)
        return Response(status_code=200 if healthy else 503)

    async def model_info(request: Request) -> Response:
        return JSONResponse(engine.model_info())

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST", "PUT"]),
            Route("/health", health, methods=["GET"]),
            Route("/health_generate", health, methods=["GET"]),
            Route("/model_info", model_info, methods=["GET"]),
            Route("/get_model_info", model_info, methods=["GET"]),
        ]
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (uvicorn serves on it); a clear error when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"--host/--port: cannot bind {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def serve(config: ReferenceEngineConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, flush the dumps; 0 on a clean stop, 1 if warmup failed."""
    import uvicorn

    stop_signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        # Before uvicorn runs this just records the signal. uvicorn swaps in its own handler while
        # serving and re-raises the signal after its graceful shutdown; it then lands here instead
        # of killing the process, so the writer is flushed and the exit code is 0.
        stop_signals.append(signum)
        if server is not None:
            server.should_exit = True

    server: Any = None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    load_started = time.monotonic()
    engine = ReferenceEngine.load(config)
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    print(
        f"reference engine: model {config.model} ({', '.join(engine.model.config.architectures or ['?'])}, "
        f"{engine.num_layers} layers, hidden {engine.hidden_size}, vocab {engine.vocab_size}, "
        f"{str(engine.model.dtype).removeprefix('torch.')} on {config.device}) loaded in {time.monotonic() - load_started:.1f}s; "
        f"aux layer ids {engine.aux_layer_ids} + final pre-norm state = {len(engine.aux_layer_ids) + 1} slots; "
        f"dumps -> {config.dump_dir}; listening on http://{host}:{port}; warmup {config.warmup_seconds:g}s",
        flush=True,
    )
    if engine.fail_rows_pending:
        print(f"TEST fault injection: requests for rows {sorted(engine.fail_rows_pending)} will answer 500", flush=True)
    if stop_signals:  # stopped while the model was loading
        engine.close()
        sock.close()
        print(f"reference engine stopped (signal {signal.Signals(stop_signals[0]).name}) before serving", flush=True)
        return 0

    server = uvicorn.Server(
        uvicorn.Config(create_app(engine), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=30)
    )

    def warmup_when_listening() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        engine.warmup()
        if engine.warmup_error is not None:
            server.should_exit = True  # SGLang kills itself when its warmup request fails

    threading.Thread(target=warmup_when_listening, name="warmup", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    reason = f"signal {signal.Signals(stop_signals[0]).name}" if stop_signals else "server stopped"
    print(f"reference engine stopped ({reason}); dumps flushed", flush=True)
    return 1 if engine.warmup_error is not None else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``serve-reference``, derived from :class:`ReferenceEngineConfig`."""
    add_model_arguments(parser, ReferenceEngineConfig)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m eagleflow serve-reference``."""
    return serve(model_from_args(ReferenceEngineConfig, args))
