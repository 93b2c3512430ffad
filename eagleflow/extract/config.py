"""Flags of ``python -m eagleflow extract`` (one shard of rows), declared once."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from eagleflow.config import AuxLayerIds, SampleStoreAddress, StoredHiddenStatesDtype
from eagleflow.engine import EngineRequestSettings
from eagleflow.errors import excerpt_repr


class ExtractConfig(EngineRequestSettings):
    """Flags of ``python -m eagleflow extract``."""

    dataset: Path = Field(description="training dataset folder (prepare-dataset output)")
    server: str = Field(description="engine base URL, e.g. http://127.0.0.1:30000")
    engine_name: str = Field("", description="the engine's name (engine-0, …), for the log and the manifest")
    dump_dir: Path = Field(description="folder where the engine writes <rid>.safetensors")
    sample_store: SampleStoreAddress
    rows: str = Field(description="START:END, end exclusive")
    verifier: Path = Field(description="verifier model folder (hidden size)")
    aux_layer_ids: AuxLayerIds = Field(description="captured layer ids; the files hold one more slot, the final state")
    hidden_states_dtype: StoredHiddenStatesDtype
    manifest: Path | None = Field(None, description="shard manifest path; default: the run folder's shards/rows_S-E.json beside --dataset")
    concurrency: int = Field(8, ge=1, le=256, title="Requests in flight", description="/generate requests kept in flight per shard")
    server_pid: int | None = Field(None, description="engine process id on this machine, watched so a dead engine stops the shard at once")
    dump_wait: float = Field(
        60.0, ge=0,
        description="seconds to wait for a dump after the answer when no live capture writer is in --dump-dir; "
        "while the engine's writer holds the request the wait goes on (a line every this many seconds)",
    )
    lock_wait: float = Field(
        30.0, ge=0, description="seconds to wait for another extraction of this shard to exit before refusing (one at a time)"
    )
    reextract_complete_shards: bool = Field(
        False,
        title="Re-extract complete shards",
        description="Extract a shard again even when it is complete (a cleared, finished shard otherwise extracts nothing "
        "and starts no engine). Its files are moved to shards/previous/<shard>/ first and deleted once the new ones are complete.",
    )
    progress_every: int = Field(50, ge=1, description="print a progress line every this many rows")
    progress_interval: float = Field(30.0, gt=0, description="or every this many seconds")

    @field_validator("rows")
    @classmethod
    def _rows_range(cls, value: str) -> str:
        parse_rows(value)
        return value


def parse_rows(text: str) -> tuple[int, int]:
    """``"0:2000"`` -> ``(0, 2000)``; end exclusive, start < end."""
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError as exc:
        raise ValueError(f"expected START:END, got {excerpt_repr(text)}") from exc
    if not 0 <= start < end:
        raise ValueError(f"expected 0 <= START < END, got {excerpt_repr(text)}")
    return start, end
