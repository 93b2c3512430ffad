"""One declaration per knob: every Param reaches a flag of its step, and a Param and the step flag it
sets are declared once (type, default, description), whatever step the flag belongs to."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from eagleflow.config import add_model_arguments, model_from_args, model_to_argv, schemas_of
from eagleflow.engine.process import ServerInfo
from eagleflow.run.pipeline import PIPELINE_PARAMS, PipelineConfig, param_schemas
from eagleflow.run.step_params import STEP_PARAMS, param_feeds

ENGINE = ServerInfo(url="http://127.0.0.1:30000", pid=None, host="", log_path="", dump_dir="/dumps", name="engine-0")
SHARD = {"name": "rows_0-40", "start": 0, "end": 40}
# Run-level Params the run resolves before a step sees them: empty in the form means "the verifier's own".
RESOLVED_BY_THE_RUN = {"aux_layer_ids"}
# Values the generic rule below cannot pick (bounds, or another field goes with them).
CHANGED = {
    "train_data_ratio": 0.8, "scheduler_warmup_ratio": 0.5, "noise_std": 0.1, "draft_config": "/models/draft.json",
    "eval_prompts": "/data/prompts.jsonl", "eval_sets": ["heldout", "file"], "eval_configs": "1,0,0,0 1,3,1,4",
    "eval_server_extra_args": ["--threads", "2"], "online_cache_gb": 1.5, "chat_template_kwargs": {"enable_thinking": False},
    "markov_head_type": "gated",
}
# Params that are valid only beside another one.
TOGETHER = {"eval_prompts": {"eval_sets": ["heldout", "file"]}, "eval_sets": {"eval_prompts": "/data/prompts.jsonl"},
            "block_size": {"draft_algorithm": "dflash"}, "markov_rank": {"draft_algorithm": "dspark"},
            "markov_head_type": {"draft_algorithm": "dspark"}}
# The one run-level Param no step config holds: it goes into the remote engines' record (launch_server's XCom),
# whose dump folder extraction and the capture check then take.
ENGINE_RECORD_ONLY = {"server_dump_dir"}
# Decides which tasks run, not what a step is given (build_vocab skips: tests/dags/test_dag.py's remote run).
TASKS_ONLY = {"stop_after_extraction"}
# Decide where the launched engines hand their samples (a store the launch starts or a connection names), checked
# where a run really launches: tests/dags/test_dag.py's online run, tests/operators/test_server.py.
LAUNCH_ONLY = {"sample_transport", "sample_store_conn_id"}


def step_configs(cfg: PipelineConfig) -> list[BaseModel]:
    """Every step config a run's operators turn into argv."""
    return [
        cfg.prepare_config(), cfg.regenerate_config(ENGINE.url, None), cfg.stats_config(),
        cfg.disk_check_config(Path("/hs"), 1), cfg.verify_capture_config(ENGINE),
        cfg.extract_config(ENGINE, SHARD), cfg.vocab_config(), cfg.train_config(), cfg.plot_config(), cfg.export_config(),
        cfg.evaluate_config(),
    ]


def changed_value(name: str, schema: dict[str, Any]) -> Any:
    """A valid value of Param ``name`` other than its default."""
    if name in CHANGED:
        return CHANGED[name]
    default = schema["default"]
    if default is None:  # an optional number: any value within its bounds
        bounds = schema.get("allOf", [{}])[0]
        low = bounds.get("minimum", bounds.get("exclusiveMinimum", 0))
        return {"integer": int(low) + 1, "number": low + 0.5}[next(t for t in schema["type"] if t != "null")]
    if "enum" in schema:
        return next(choice for choice in schema["enum"] if choice not in (default, None))
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 2 if default else 0.5
    raise AssertionError(f"say in CHANGED which value of Param {name} to try")


def parsed_back(config: BaseModel) -> BaseModel:
    """``config`` through its argv and its step's own ``--flags`` (what ``python -m eagleflow <step>`` reads)."""
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, type(config))
    return model_from_args(type(config), parser.parse_args(model_to_argv(config)))


def base(tmp_path: Path, model: Path) -> dict[str, Any]:
    return {"model_path": str(model), "dataset_input": str(tmp_path / "in.jsonl"), "output_root": str(tmp_path / "runs"),
            "run_name": "r"}


@pytest.mark.parametrize("name", sorted(STEP_PARAMS))
def test_every_step_param_reaches_its_flag_through_the_steps_own_parser(tmp_path: Path, random_tiny_model: Path, name: str) -> None:
    value = changed_value(name, param_schemas()[name])
    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), **TOGETHER.get(name, {}), name: value})
    fed = [config for config in step_configs(cfg) if param_feeds(name, type(config))]
    assert STEP_PARAMS[name] in {type(config) for config in fed}
    for config in fed:
        got = getattr(parsed_back(config), name)
        assert (str(got) if isinstance(got, Path) else got) == value, (name, type(config).__name__)


def test_every_run_param_changes_what_a_step_or_the_plan_gets(tmp_path: Path, random_tiny_model: Path) -> None:
    """The Params that are no step's flag (folders, engines, shards) still reach something."""
    from eagleflow.run.launch import engine_command
    from eagleflow.layout import plan_shards

    def seen(**changed: Any) -> list[Any]:
        cfg = PipelineConfig.from_params({**params, **changed})
        engine = engine_command(cfg, port=30001)[0] if cfg.engine == "reference" else None  # SGLang's needs SGLang
        return [model_to_argv(c) for c in step_configs(cfg)] + [cfg.engine_plan(), plan_shards(10_000, cfg.shard_size), engine]

    (tmp_path / "verifier").symlink_to(random_tiny_model)
    params = {**base(tmp_path, random_tiny_model), "aux_layer_ids": [2, 4]}
    remote = {"server_urls": ["http://gpu-node-1:30000"], "server_dump_dir": str(tmp_path / "shared")}
    changes = {"engine": "sglang", "model_path": str(tmp_path / "verifier"), "dataset_input": str(tmp_path / "other.jsonl"),
               "output_root": str(tmp_path / "elsewhere"), "run_name": "s", "regenerate_responses": True,
               "aux_layer_ids": [1, 3], "hidden_states_dtype": "fp8", "shard_size": 500, "dump_queue_gb": 2.0,
               "server_port": 30005, "tp_size": 4, "server_extra_args": ["--threads", "2"], "warmup_timeout": 60.0,
               "num_engines": 2, "server_urls": remote["server_urls"],
               # a second drafter reading another layer: the capture takes the union
               "drafters": ["eagle3", {"name": "wide", "aux_layer_ids": [1, 2, 4]}]}
    assert set(changes) | ENGINE_RECORD_ONLY | TASKS_ONLY | LAUNCH_ONLY == set(PIPELINE_PARAMS)
    for name, value in changes.items():
        extra = {"server_dump_dir": remote["server_dump_dir"]} if name == "server_urls" else {}
        assert seen(**extra, **{name: value}) != seen(**extra), name


def comparable(schema: dict[str, Any]) -> dict[str, Any]:
    """What a flag and its Param must share: type (a Param may add null), default, description and bounds."""
    kept = {k: v for k, v in schema.items() if k not in ("title", "section", "enum", "type")}
    types = schema.get("type")
    kept["type"] = sorted(t for t in ([types] if isinstance(types, str) else types or []) if t != "null")
    kept["enum"] = [e for e in schema.get("enum", []) if e is not None]
    return kept


def test_a_step_flag_and_its_param_are_one_declaration(tmp_path: Path, random_tiny_model: Path) -> None:
    cfg = PipelineConfig.from_params(base(tmp_path, random_tiny_model))
    params = param_schemas()
    checked = 0
    for config in step_configs(cfg):
        model = type(config)
        for name in model.model_fields:
            if name not in params or name in RESOLVED_BY_THE_RUN:
                continue
            if name in STEP_PARAMS and not param_feeds(name, model):
                continue  # another flag of the same name (evaluate's train_data_ratio: read from the training folder)
            flag = comparable(schemas_of(model, (name,))[name])
            assert flag == comparable(params[name]), f"{model.__name__}.{name} is declared apart from Param {name}"
            checked += 1
    assert checked >= len(STEP_PARAMS)
    # No run-level field shadows a step's Param under the same name.
    assert not set(PIPELINE_PARAMS) & set(STEP_PARAMS)


def test_a_shared_declaration_is_one_knob_and_a_different_one_is_not() -> None:
    from eagleflow.data.prepare import PrepareConfig
    from eagleflow.data.regenerate import RegenerateConfig
    from eagleflow.data.vocab import VocabConfig
    from eagleflow.evaluate.config import EvaluateConfig
    from eagleflow.export.step import ExportConfig
    from eagleflow.train.config import TrainConfig

    assert param_feeds("skip_bad_rows", PrepareConfig) and param_feeds("skip_bad_rows", RegenerateConfig)
    assert param_feeds("draft_vocab_size", VocabConfig) and param_feeds("serve_with", ExportConfig)
    assert param_feeds("train_data_ratio", TrainConfig) and not param_feeds("train_data_ratio", EvaluateConfig)

    class Apart(BaseModel):  # the same name declared anew is another flag: the Param does not set it
        skip_bad_rows: bool = False

    assert not param_feeds("skip_bad_rows", Apart)
    assert typing.get_args(EvaluateConfig.model_fields["engine"].annotation) == ("reference", "sglang")
