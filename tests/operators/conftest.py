"""Fixtures for the operator tests: a run's Params, a settable health endpoint, and
cleanup of every process group a test starts (engines outlive their launch by design)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture()
def process_groups() -> Iterator[list[int]]:
    """Process groups (= engine pids, session leaders) a test started; SIGKILLed and reaped afterwards."""
    started: list[int] = []
    yield started
    for pgid in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pgid, 0)


@pytest.fixture()
def params(tmp_path: Path, random_tiny_model: Path) -> dict[str, Any]:
    """A run's Params: the reference engine on the tiny model, any free port, one torch thread."""
    return {
        "engine": "reference",
        "model_path": str(random_tiny_model),
        "dataset_input": str(tmp_path / "unused.jsonl"),
        "output_root": str(tmp_path / "out"),
        "server_port": 0,
        # One thread: the engine shares 2 cores with this test process.
        "server_extra_args": ["--threads", "1"],
    }


class HealthServer:
    """A real HTTP server on 127.0.0.1 whose ``/health_generate`` answers ``status``."""

    def __init__(self) -> None:
        self.status = 503
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.requests += 1
                self.send_response(outer.status if self.path == "/health_generate" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def health() -> Iterator[HealthServer]:
    server = HealthServer()
    yield server
    server.close()
