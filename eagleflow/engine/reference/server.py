"""``python -m eagleflow serve-reference``: the reference engine's HTTP server and its life.

Like SGLang, ``/generate`` is served as soon as the port is open; only the health checks wait
for the warmup (one real forward, then ``--warmup-seconds``). SIGTERM/SIGINT stop it after
every queued dump is written, with exit code 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.engine.context import model_list
from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.reference.protocol import RequestError, body_limit, invalid_json_body, parse_json_body
from eagleflow.engine.reference.runner import ReferenceEngine
from eagleflow.errors import UserError
from eagleflow.startup import collector_paused


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

    limit = body_limit(engine.limits)

    async def read_json(request: Request) -> Any:
        """The body as JSON, read no further than :func:`body_limit`; raises RequestError (413) or ValueError."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"the request body ({declared} bytes) is larger than the engine's limit of {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"the request body is larger than the engine's limit of {limit} bytes")
            chunks.append(chunk)
        return parse_json_body(b"".join(chunks))

    def json_route(handle: Callable[[Any], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A POST route that reads a JSON body; a bad or oversized body, or a refused request, is SGLang's error answer."""

        async def route(request: Request) -> Response:
            try:
                body = await read_json(request)
            except ValueError as exc:  # the body's JSON only: an engine's own ValueError stays a 500
                return JSONResponse(invalid_json_body(exc), status_code=400)
            except RequestError as exc:
                return JSONResponse(exc.body, status_code=exc.status)
            try:
                return await handle(body)
            except RequestError as exc:
                return JSONResponse(exc.body, status_code=exc.status)

        return route

    @json_route
    async def generate(body: Any) -> Response:
        return JSONResponse(await run_in_threadpool(engine.generate, body))

    @json_route
    async def abort_request(body: Any) -> Response:
        # SGLang's /abort_request: {"rid"}; 200 whether or not the request was still there.
        if isinstance(body, dict) and isinstance(body.get("rid"), str):
            engine.abort(body["rid"])
        return Response(status_code=200)

    async def health(request: Request) -> Response:
        healthy = await run_in_threadpool(engine.health)
        return Response(status_code=200 if healthy else 503)

    async def model_info(request: Request) -> Response:
        return JSONResponse(engine.model_info())

    async def server_info(request: Request) -> Response:
        return JSONResponse(engine.server_info())

    async def models(request: Request) -> Response:
        # SGLang's served model name defaults to its --model-path; a card's "created" is the answer's time.
        return JSONResponse(model_list(str(engine.config.model), engine.limits.context_length, int(time.time())))

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST", "PUT"]),
            Route("/abort_request", abort_request, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/health_generate", health, methods=["GET"]),
            Route("/model_info", model_info, methods=["GET"]),
            Route("/get_model_info", model_info, methods=["GET"]),
            Route("/server_info", server_info, methods=["GET"]),
            Route("/get_server_info", server_info, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
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
    with collector_paused():  # torch, transformers and the model: the engine's start-up (eagleflow.startup)
        engine = ReferenceEngine.load(config)
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    print(
        f"reference engine: model {config.model} ({', '.join(engine.model.config.architectures or ['?'])}, "
        f"{engine.num_layers} layers, hidden {engine.hidden_size}, vocab {engine.vocab_size}, context {engine.limits.context_length}, "
        f"{str(engine.model.dtype).removeprefix('torch.')} on {config.device}) loaded in {time.monotonic() - load_started:.1f}s; "
        + (
            f"aux layer ids {engine.aux_layer_ids} + final pre-norm state = {len(engine.aux_layer_ids) + 1} slots; "
            f"dumps -> {config.dump_dir}; "
            if engine.aux_layer_ids is not None
            else "no capture; "
        )
        + (
            f"{config.speculative_algorithm} drafter {config.speculative_draft_model_path}"
            + (f", {config.speculative_num_steps} steps of topk {config.speculative_eagle_topk}" if config.speculative_algorithm == "EAGLE3" else "")
            + f", {engine.speculative.draft_tokens_per_round} draft tokens verified per round; "
            if engine.speculative is not None
            else ""
        )
        + f"listening on http://{host}:{port}; warmup {config.warmup_seconds:g}s",
        flush=True,
    )
    for line in engine.faults.settings.announce():
        print(line, flush=True)
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
