"""The engines and configs the extraction tests share: a real reference engine per fixture, started
and checked for readiness with the same functions the operators use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import reference_engines
import torch

from eagleflow.engine.process import ServerInfo
from eagleflow.extract.config import ExtractConfig

AUX = [2, 4, 5]
HIDDEN = 64
ROWS = 24


def make_rows(n: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (int(torch.randint(8, 40, (1,), generator=generator)),), generator=generator).tolist() for _ in range(n)]



def config(dataset: Path, server: ServerInfo, model: Path, rows: str, **overrides: Any) -> ExtractConfig:
    values: dict[str, Any] = dict(
        dataset=dataset, server=server.url, dump_dir=Path(server.dump_dir), rows=rows, verifier=model,
        aux_layer_ids=AUX, concurrency=4, max_retries=1, progress_every=5,
    )
    values.update(overrides)
    return ExtractConfig(**values)


def launch_engine(model: Path, dump_dir: Path, log: Path, *extra: str, **kwargs: Any) -> ServerInfo:
    """:func:`reference_engines.launch_engine` capturing this module's :data:`AUX`."""
    return reference_engines.launch_engine(model, dump_dir, log, *extra, aux=kwargs.pop("aux", AUX), **kwargs)
