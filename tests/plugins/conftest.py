"""Fixtures for the UI plugin tests: a run folder shaped like a real one, and real Airflow logins."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"

# A 1x1 PNG: the routes serve chart files, they do not look inside them.
TINY_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f80f00000101000518d84e0000000049454e44ae426082"
)


def write_manifest(shards: Path, **fields: Any) -> None:
    """A shard manifest in the extractor's format (DESIGN.md §3.5 plus per-row failures)."""
    data = {"state": "success", "done": 0, "skipped": 0, "failed": [], "tokens": 0, "bytes": 0, "seconds": 0.0,
            "updated": time.time() - 60, **fields}
    (shards / f"{data['name']}.json").write_text(json.dumps(data))


def _record_dflash_metrics(metrics: Path) -> list[dict[str, Any]]:
    import io
    import logging

    from eagleflow.metrics import read_records
    from eagleflow.train.recorder import MetricsRecorder

    metrics.unlink(missing_ok=True)
    recorder = MetricsRecorder(metrics, stream=io.StringIO(), clock=time.time)
    logger = logging.getLogger("eagleflow.test.plugins.dflash")
    logger.handlers, logger.propagate, logger.level = [recorder], False, logging.INFO
    try:
        for line in (FIXTURES / "dflash" / "metric_dicts.jsonl").read_text().splitlines():
            entry = json.loads(line)
            logger.info(entry["msg"], extra={"step": entry["step"]})
    finally:
        logger.handlers = []
        recorder.close()
    return read_records(metrics)


@pytest.fixture()
def record_dflash_metrics() -> Any:
    """``record(metrics)``: the real DFlash training's metric dicts (``fixtures/metrics/dflash``) through the
    training step's recorder into ``metrics``, as speculators logs them; returns the records written."""
    return _record_dflash_metrics


@pytest.fixture()
def output_root(tmp_path: Path) -> Path:
    """``<root>/demo``: three shard manifests, metrics from the real fixture run, two charts; plus
    a file outside the run and one outside the output root, for traversal attempts."""
    root = tmp_path / "runs"
    run = root / "demo"
    shards = run / "shards"
    shards.mkdir(parents=True)
    # A resumed shard: its last attempt extracted 38 rows (8,664 tokens) and skipped 2 done before;
    # the totals count all 40. The other two were written before manifests had totals.
    write_manifest(shards, name="rows_0-40", start=0, end=40, done=38, skipped=2, tokens=8664, bytes=8664 * 4 * 64 * 2,
                   total_tokens=9120, total_bytes=9120 * 4 * 64 * 2, seconds=12.0, engine="engine-1 at http://127.0.0.1:30001")
    write_manifest(shards, name="rows_40-80", start=40, end=80, state="failed", done=39, tokens=9001,
                   bytes=9001 * 512, seconds=11.5,
                   failed=[{"row": 57, "reason": "engine answered 400: <script>alert(1)</script>"}])
    write_manifest(shards, name="rows_80-120", start=80, end=120, state="running", done=7, tokens=1500,
                   bytes=1500 * 512, seconds=3.0)
    (run / "train").mkdir()
    shutil.copyfile(FIXTURES / "metrics.jsonl", run / "train" / "metrics.jsonl")
    (run / "train" / "train.log").write_text("step 0 epoch 0 loss 9.1\n")
    (run / "train-progress").mkdir()
    for name in ("loss", "acc"):
        (run / "train-progress" / f"{name}.png").write_bytes(TINY_PNG)
        (run / "train-progress" / f"{name}.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    (run / "dataset" / "hidden_states").mkdir(parents=True)
    (run / "dataset" / "hidden_states" / "hs_0.safetensors").write_bytes(b"\0" * 16)
    (root / "other-run").mkdir()
    (root / "other-run" / "secret.json").write_text('{"secret": "other run"}')
    (tmp_path / "outside.json").write_text('{"secret": "outside the output root"}')
    return root


@dataclass
class AirflowLogin:
    """The API server's auth manager and a valid JWT for a user it knows."""

    auth_manager: Any
    token: str

    def new_token(self) -> str:
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

        return self.auth_manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))


@pytest.fixture(scope="session")
def airflow_login(airflow_db: Path) -> AirflowLogin:
    """Airflow's configured auth manager (SimpleAuthManager here), initialised as the API server
    does, and a token it signed. Token checks read the metadata DB (revoked tokens), hence airflow_db."""
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    auth_manager = init_auth_manager()
    token = auth_manager.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    return AirflowLogin(auth_manager, token)
