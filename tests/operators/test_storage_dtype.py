"""The hidden_states_dtype Param reaches every step that writes, checks or sizes hidden-state files."""

from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from eagleflow.errors import UserError


def parsed(module: Any, argv: list[str]) -> argparse.Namespace:
    """``argv`` read back by the step's own parser (so a misspelt flag fails here)."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_stats_extract_and_both_engines_get_the_storage_dtype(
    params: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, health: Any
) -> None:
    from eagleflow.data import stats
    from eagleflow.run.launch import engine_command
    from eagleflow.extract import shard
    from eagleflow.run.pipeline import PipelineConfig
    from operators.dataset import DatasetStatsOperator
    from operators.extract import ShardExtractOperator

    context = {"params": {**params, "hidden_states_dtype": dtype}, "run_id": "manual__1"}
    assert parsed(stats, DatasetStatsOperator(task_id="s").step_argv(context)).hidden_states_dtype == dtype
    health.status = 200  # the shard takes a ready engine
    server = {"url": health.url, "pid": None, "host": "", "log_path": "", "dump_dir": str(tmp_path / "d"), "name": "engine-0"}
    extract = ShardExtractOperator(task_id="e", shard={"name": "rows_0-4", "start": 0, "end": 4}, engines=[server])
    assert parsed(shard, extract.step_argv(context)).hidden_states_dtype == dtype

    cfg = PipelineConfig.from_params(context["params"], context["run_id"])
    argv, _ = engine_command(cfg, 30001)
    assert f"--hidden-states-dtype={dtype}" in argv  # serve-reference's own flag
    # SGLang: the hook spec carries it into the server (its interpreter is a stand-in that names 0.5.23).
    fake_python = tmp_path / "sglang-python"
    fake_python.write_text("#!/bin/sh\necho 0.5.23\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("EAGLEFLOW_SGLANG_PYTHON", str(fake_python))
    argv, _ = engine_command(cfg.model_copy(update={"engine": "sglang"}), 30001)
    (spec,) = json.loads(argv[argv.index("--forward-hooks") + 1])
    assert spec["config"]["hidden_states_dtype"] == dtype


def test_an_unknown_storage_dtype_is_refused_naming_the_param(params: dict[str, Any]) -> None:
    from eagleflow.run.pipeline import PipelineConfig, param_schemas

    with pytest.raises(UserError, match="Param hidden_states_dtype"):
        PipelineConfig.from_params({**params, "hidden_states_dtype": "fp16"})
    schema = param_schemas()["hidden_states_dtype"]
    # None: the field left empty in the form, which takes the default
    assert schema["enum"] == ["bf16", "fp8", None] and schema["default"] == "bf16" and schema["title"]
