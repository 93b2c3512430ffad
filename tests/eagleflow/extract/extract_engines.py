"""The engines and configs the extraction tests share: a real reference engine per fixture, started
and checked for readiness with the same functions the operators use."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagleflow.config import model_to_argv
from eagleflow.engine.process import Readiness, ServerInfo, check_ready, free_port, pid_alive, start_server
from eagleflow.engine.reference.config import ReferenceEngineConfig
from eagleflow.extract.config import ExtractConfig

AUX = [2, 4, 5]
HIDDEN = 64
ROWS = 24


def make_rows(n: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (int(torch.randint(8, 40, (1,), generator=generator)),), generator=generator).tolist() for _ in range(n)]



def config(dataset: Path, server: ServerInfo, model: Path, rows: str, **overrides: Any) -> ExtractConfig:
    values: dict[str, Any] = dict(
        dataset=dataset, server=server.url, dump_dir=Path(server.dump_dir), rows=rows, model=model,
        aux_layer_ids=AUX, concurrency=4, max_retries=1, progress_every=5,
    )
    values.update(overrides)
    return ExtractConfig(**values)


def launch_engine(model: Path, dump_dir: Path, log: Path, *extra: str) -> ServerInfo:
    port = free_port()
    engine = ReferenceEngineConfig(model=model, dump_dir=dump_dir, aux_layers=AUX, port=port, warmup_seconds=0)
    argv = [sys.executable, "-m", "eagleflow", "serve-reference", *model_to_argv(engine), *extra]
    info = start_server(argv, {}, log, log.with_suffix(".json"), f"http://127.0.0.1:{port}", dump_dir)
    deadline = time.monotonic() + 120
    while check_ready(info).state is not Readiness.READY:
        assert time.monotonic() < deadline and pid_alive(info.pid), log.read_text()[-3000:]
        time.sleep(0.3)
    return info
