"""A real reference engine for the tests that need one, started and awaited with the functions the operators use."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from eagleflow.config import model_to_argv
from eagleflow.engine.process import Readiness, ServerInfo, check_ready, free_port, pid_alive, start_server, stop_server
from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.reference.faults import faults_env

# How the tests' engines compute (capturing, serving training, evaluating), where a test is not about the
# engine's own numerics (those keep the checkpoint's bf16: test_reference_engine, test_verify_capture,
# test_reference_logprobs). float32:
# CPUs without AVX-512 BF16 emulate bf16 matmuls, and a bf16 prefill costs 3x a float32 one here;
# the dumps are stored in bf16 (or fp8) either way. One torch thread: the engine shares 2 cores.
ENGINE_COMPUTE_FLAGS = ["--threads", "1", "--dtype", "float32"]


def launch_engine(
    model: Path, dump_dir: Path, log: Path, *extra: str, aux: list[int], port: int | None = None, name: str = "engine-0",
    faults: dict[str, Any] | None = None,
) -> ServerInfo:
    """A reference engine capturing ``aux`` into ``dump_dir``, once it is ready (``extra``: more of its flags;
    ``faults``: the test-only faults it injects, :class:`~eagleflow.engine.reference.faults.EngineFaults`' fields)."""
    port = port or free_port()
    engine = ReferenceEngineConfig(model=model, dump_dir=dump_dir, aux_layers=aux, port=port, warmup_seconds=0)
    argv = [sys.executable, "-m", "eagleflow", "serve-reference", *model_to_argv(engine), *ENGINE_COMPUTE_FLAGS, *extra]
    info = start_server(argv, faults_env(**faults or {}), log, log.with_suffix(".json"), f"http://127.0.0.1:{port}", dump_dir, name)
    deadline = time.monotonic() + 120
    try:
        while check_ready(info).state is not Readiness.READY:
            assert time.monotonic() < deadline and pid_alive(info.pid), log.read_text()[-3000:]
            time.sleep(0.3)
    except BaseException:  # never became ready: no engine outlives the test
        stop_server(info.pid, grace=10)
        raise
    return info
