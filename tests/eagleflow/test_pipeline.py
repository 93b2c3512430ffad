"""Bad Params: refused by Airflow's own form validation when a schema can say it, else by the
first task that reads them, always naming the Param, and never reaching outside the output root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamValidationError

from eagleflow.errors import UserError
from eagleflow.pipeline import PipelineConfig, param_schemas


def base(tmp_path: Path, model: Path) -> dict[str, Any]:
    return {"model_path": str(model), "dataset_input": str(tmp_path / "in.jsonl"), "output_root": str(tmp_path / "runs")}


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("run_name", "../escape", "one folder under the output root"),
        ("run_name", "/etc", "one folder under the output root"),
        ("shard_size", 0, "greater than or equal to 1"),
        ("concurrency", 300, "less than or equal to 256"),
        ("dump_queue_gb", 0, "greater than 0"),
        ("aux_layer_ids", [2, 2], "repeat [2]"),
        ("aux_layer_ids", [-1, 3], "0"),
        ("epochs", 0, "greater than or equal to 1"),
    ],
)
def test_bad_params_are_refused_by_the_form_and_by_the_config_naming_the_param(
    tmp_path: Path, random_tiny_model: Path, name: str, value: Any, words: str
) -> None:
    with pytest.raises(ParamValidationError):
        Param(**param_schemas()[name]).resolve(value)  # Airflow's trigger form and REST API
    with pytest.raises(UserError, match=f"Param {name}") as info:  # a run made without the form (CLI conf)
        PipelineConfig.from_params({**base(tmp_path, random_tiny_model), name: value})
    assert words in str(info.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape").exists()


def test_aux_ids_past_the_verifiers_depth_are_refused_when_a_task_reads_the_model(tmp_path: Path, random_tiny_model: Path) -> None:
    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "aux_layer_ids": [2, 9]})
    with pytest.raises(UserError, match=r"Param aux_layer_ids: aux layer ids \[9\] are outside 0..8"):
        cfg.check_model()


def test_dump_queue_budget_reaches_both_engines(tmp_path: Path, random_tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from eagleflow.engine import sglang_command
    from eagleflow.engine.launch import engine_command

    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "dump_queue_gb": 1.5, "run_name": "r"})
    argv, _ = engine_command(cfg, port=30001)
    assert "--dump-queue-bytes=1500000000" in argv

    # No SGLang (nor GPU) here: the two probes of the server's machine answer as a supported node would.
    monkeypatch.setattr(sglang_command, "detect_sglang_version", lambda python: "0.5.20")
    monkeypatch.setattr(sglang_command, "query_compute_caps", lambda: ["9.0"])
    argv, _ = engine_command(cfg.model_copy(update={"engine": "sglang"}), port=30001)
    hook = json.loads(argv[argv.index("--forward-hooks") + 1])[0]
    assert hook["config"]["max_pending_bytes"] == 1_500_000_000
