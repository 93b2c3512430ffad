"""Bad Params: refused by Airflow's own form validation when a schema can say it, else by the
first task that reads them, always naming the Param, and never reaching outside the output root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamValidationError

from eagleflow.config import bounds_text
from eagleflow.engine.process import ServerInfo
from eagleflow.errors import UserError
from eagleflow.run.pipeline import PipelineConfig, param_schemas


def base(tmp_path: Path, model: Path) -> dict[str, Any]:
    return {"model_path": str(model), "dataset_input": str(tmp_path / "in.jsonl"), "output_root": str(tmp_path / "runs")}


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("run_name", "../escape", "one folder under the output root"),
        ("run_name", "/etc", "one folder under the output root"),
        ("shard_size", 0, "greater than or equal to 1"),
        ("shard_size", -5, "greater than or equal to 1"),
        ("noise_std", -0.5, "greater than or equal to 0"),
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
    schema = param_schemas()[name]
    with pytest.raises(ParamValidationError) as refused:
        Param(**schema).resolve(value)  # Airflow's trigger form and REST API
    if isinstance(value, (int, float)):  # refused, saying which bound, where the form would have clamped it
        assert "the minimum of" in str(refused.value) or "the maximum of" in str(refused.value), refused.value
    # The form's number field clamps into a top-level minimum/maximum, silently: bounds live under allOf instead,
    # and the help under the field says them, where the value is typed (the form checks no bound itself).
    assert not {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(schema), schema
    if isinstance(value, (int, float)):
        assert schema["description"].endswith(" " + bounds_text(schema["allOf"][0])), schema["description"]
    with pytest.raises(UserError, match=f"Param {name}") as info:  # a run made without the form (CLI conf)
        PipelineConfig.from_params({**base(tmp_path, random_tiny_model), name: value})
    assert words in str(info.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape").exists()


def test_aux_ids_past_the_verifiers_depth_are_refused_when_a_task_reads_the_model(tmp_path: Path, random_tiny_model: Path) -> None:
    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "aux_layer_ids": [2, 9]})
    with pytest.raises(UserError, match=r'Param aux_layer_ids \("Aux layer ids"\): aux layer ids \[9\] are outside 0..8'):
        cfg.check_model()


def test_dump_queue_budget_reaches_both_engines(tmp_path: Path, random_tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from eagleflow.engine import sglang_command
    from eagleflow.run.launch import engine_command

    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "dump_queue_gb": 1.5, "run_name": "r"})
    argv, _ = engine_command(cfg, port=30001)
    assert "--dump-queue-bytes=1500000000" in argv

    # No SGLang (nor GPU) here: the two probes of the server's machine answer as a supported node would.
    monkeypatch.setattr(sglang_command, "detect_sglang_version", lambda python: "0.5.20")
    monkeypatch.setattr(sglang_command, "query_compute_caps", lambda: ["9.0"])
    argv, _ = engine_command(cfg.model_copy(update={"engine": "sglang"}), port=30001)
    hook = json.loads(argv[argv.index("--forward-hooks") + 1])[0]
    assert hook["config"]["max_pending_bytes"] == 1_500_000_000


# ---- what Params may point at (README: "Where a run may write and listen") -----------------------


def test_output_paths_must_be_absolute_outside_system_folders_and_inside_the_deployments_root(
    tmp_path: Path, random_tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EAGLEFLOW_OUTPUT_ROOT", raising=False)
    params = base(tmp_path, random_tiny_model)
    for value, words in (("runs", "is not an absolute path"), ("/", "is a system folder"), ("/etc", "is a system folder"),
                         ("/usr/local/runs", "is a system folder"), (f"{tmp_path}{'/..' * len(tmp_path.parts)}/etc/runs", "is a system folder")):
        with pytest.raises(UserError, match='Param output_root \\("Output root"\\): ') as info:
            PipelineConfig.from_params({**params, "output_root": value})
        assert words in str(info.value), value
    PipelineConfig.from_params(params)  # no deployment root: any other absolute folder

    root = tmp_path / "deployment-root"
    (root / "runs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    monkeypatch.setenv("EAGLEFLOW_OUTPUT_ROOT", str(root))
    assert PipelineConfig.from_params({**params, "output_root": str(root / "runs")}).layout.root.parent == root / "runs"
    for value in (str(tmp_path / "outside"), f"{root}/../outside", str(root / "link" / "runs")):
        with pytest.raises(UserError, match=r'Param output_root \("Output root"\): .* is outside \$EAGLEFLOW_OUTPUT_ROOT') as info:
            PipelineConfig.from_params({**params, "output_root": value})
        if "link" in value:
            assert f"resolves to {tmp_path / 'outside' / 'runs'}" in str(info.value)
    remote = {**params, "output_root": str(root / "runs"), "server_urls": ["http://gpu-node-1:30000"]}
    with pytest.raises(UserError, match=r"Param server_dump_dir \(\"Remote engines' dump folder\"\): '/shared/dumps' is outside \$EAGLEFLOW_OUTPUT_ROOT"):
        PipelineConfig.from_params({**remote, "server_dump_dir": "/shared/dumps"})
    PipelineConfig.from_params({**remote, "server_dump_dir": str(root / "dumps")})
    assert not (tmp_path / "outside" / "runs").exists() and not (tmp_path / "runs").exists()  # nothing was created


@pytest.mark.parametrize(
    ("engine", "extra", "flag", "param"),
    [
        ("reference", ["--host", "0.0.0.0"], "--host", "server_extra_args"),
        ("reference", ["--ho", "0.0.0.0"], "--host", "server_extra_args"),  # argparse reads a unique prefix as the whole flag
        ("reference", ["--hos=0.0.0.0"], "--host", "server_extra_args"),
        ("reference", ["--dump-d", "/tmp/elsewhere"], "--dump-dir", "server_extra_args"),
        ("reference", ["--po", "8080"], "--port", "server_extra_args"),
        ("reference", ["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm", "server_extra_args"),
        ("reference", ["--po", "8080"], "--port", "eval_server_extra_args"),
        ("sglang", ["--host", "0.0.0.0"], "--host", "server_extra_args"),
        ("sglang", ["--ho", "0.0.0.0"], "--host", "server_extra_args"),
        ("sglang", ["--forward-ho", "[]"], "--forward-hooks", "server_extra_args"),
        ("sglang", ["--enable-dp-att"], "--enable-dp-attention", "server_extra_args"),
        ("sglang", ["--ho", "0.0.0.0"], "--host", "eval_server_extra_args"),
        # the evaluation's, from export.json
        ("sglang", ["--speculative-num-steps", "5"], "--speculative-num-steps", "eval_server_extra_args"),
    ],
)
def test_server_extra_args_may_not_set_what_the_run_sets(
    tmp_path: Path, random_tiny_model: Path, engine: str, extra: list[str], flag: str, param: str
) -> None:
    import re

    from eagleflow.run.pipeline import param_name

    with pytest.raises(UserError, match=re.escape(f"{param_name(param)}: ")) as info:
        PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "engine": engine, param: extra})
    assert flag in str(info.value)
    if engine == "reference":  # the same rule where a step builds the command itself (evaluate --server-extra-args)
        from eagleflow.engine import serving_engine_command

        with pytest.raises(UserError, match=flag):
            serving_engine_command("reference", random_tiny_model, 30001, None, extra_args=extra)


def test_allowed_extra_args_pass(tmp_path: Path, random_tiny_model: Path) -> None:
    for engine, extra in (("reference", ["--threads", "1", "--warmup-seconds", "3", "--th", "1", "--context-length", "64"]),
                          ("sglang", ["--trust-remote-code", "--mem-fraction-static", "0.8"])):
        cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "engine": engine, "server_extra_args": extra})
        assert cfg.server_extra_args == extra
        assert cfg.evaluate_config().eval_server_extra_args == []  # the capture engines' arguments only
        cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), "engine": engine, "eval_server_extra_args": extra})
        assert cfg.evaluate_config().eval_server_extra_args == extra and cfg.server_extra_args == []


def test_the_reference_engines_refusals_match_its_own_argparse_exactly() -> None:
    """Every prefix of every serve-reference option, as the engine's real parser reads it: refused exactly
    when the parser would set a flag the run owns (an ambiguous prefix fails in the parser itself)."""
    import argparse
    import contextlib
    import io

    from eagleflow.config import add_model_arguments
    from eagleflow.engine.extra_args import REFERENCE_OWNED, reference_options, refused_match
    from eagleflow.engine.reference_config import ReferenceEngineConfig

    parser = argparse.ArgumentParser(prog="serve-reference")
    add_model_arguments(parser, ReferenceEngineConfig)
    flag_of = {}
    for action in parser._actions:
        action.required, action.type, action.choices = False, None, None  # any value parses: only the flag matters
        action.default = argparse.SUPPRESS  # a namespace holds only what was given
        for option in action.option_strings:
            flag_of[action.dest] = flag_of.get(action.dest) or option
    options = reference_options()
    checked = 0
    for option in sorted(options):
        for end in range(3, len(option) + 1):
            for arg in (option[:end], option[:end] + "=x"):
                with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.suppress(SystemExit):
                    namespace, _ = parser.parse_known_args([arg] if "=" in arg else [arg, "x"])
                    set_flags = {flag_of[dest] for dest in vars(namespace)}
                    owned = bool(set_flags & set(REFERENCE_OWNED))
                    assert (refused_match(arg, REFERENCE_OWNED, options) is not None) == owned, (arg, set_flags)
                    checked += 1
    assert checked > 300  # the ambiguous prefixes are the parser's own errors


def test_a_huge_param_value_is_quoted_as_an_excerpt(tmp_path: Path, random_tiny_model: Path) -> None:
    params = {**base(tmp_path, random_tiny_model), "output_root": "x" * 1_000_000, "run_name": "y" * 1_000_000,
              "server_urls": ["z" * 1_000_000], "server_dump_dir": "/d"}
    with pytest.raises(UserError) as info:
        PipelineConfig.from_params(params)
    message = str(info.value)
    assert len(message) < 2000, message[:3000]
    from eagleflow.run.pipeline import param_name

    for name in ("output_root", "run_name", "server_urls"):
        assert f"{param_name(name)}: " in message
    assert "… (999800 more characters)" in message


# What every run sets, in the form's first section (Airflow's "Run Parameters", the one it opens).
RUN_ESSENTIALS = {"engine", "model_path", "dataset_input", "output_root", "run_name"}
# What a run cannot start without: the only Params the form marks required.
REQUIRED = {"model_path", "dataset_input", "output_root"}
SECTIONS = {"Engine", "Data", "Extraction", "Training", "Evaluation", "Regeneration"}


def test_the_form_has_sections_human_labels_and_requires_only_what_a_run_cannot_start_without() -> None:
    from eagleflow.run.pipeline import PIPELINE_PARAMS
    from eagleflow.run.step_params import STEP_PARAMS

    schemas = param_schemas()
    owners = {**dict.fromkeys(PIPELINE_PARAMS, PipelineConfig), **STEP_PARAMS}
    assert set(schemas) == set(owners)
    for name, schema in schemas.items():
        # A label written for people, not pydantic's title-cased id ("Lr", "Ttt Steps").
        assert owners[name].model_fields[name].title, f"Param {name} has no title of its own"
        required = isinstance(schema["type"], str) or "null" not in schema["type"]  # Airflow's own rule
        assert required == (name in REQUIRED), (name, schema["type"])
        if name in RUN_ESSENTIALS:
            assert "section" not in schema, name
        else:
            assert schema.get("section") in SECTIONS, (name, schema.get("section"))
        if "enum" in schema and not required:
            assert None in schema["enum"], name
    assert {s.get("section") for s in schemas.values()} == SECTIONS | {None}


def test_a_param_left_empty_takes_its_default(tmp_path: Path, random_tiny_model: Path) -> None:
    empty = {name: None for name in ("shard_size", "concurrency", "server_urls", "epochs", "hidden_states_dtype")}
    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), **empty, "run_name": "r"})
    assert (cfg.shard_size, cfg.server_urls) == (2000, [])
    engine = ServerInfo(url="http://127.0.0.1:1", pid=None, host="", log_path="", dump_dir="/d", name="engine-0")
    assert cfg.extract_config(engine, {"name": "rows_0-2", "start": 0, "end": 2}).concurrency == 8
    assert cfg.hidden_states_dtype == "bf16" and cfg.train_config().epochs == 5
    for name in empty:
        Param(**param_schemas()[name]).resolve(None)  # and Airflow's form takes the empty field


def test_stopping_after_extraction_is_refused_for_online_training_which_extracts_nothing(tmp_path: Path, random_tiny_model: Path) -> None:
    conf = {**base(tmp_path, random_tiny_model), "stop_after_extraction": True}
    assert PipelineConfig.from_params(conf).stop_after_extraction
    with pytest.raises(UserError, match="stop_after_extraction with hidden_states_source engine"):
        PipelineConfig.from_params({**conf, "hidden_states_source": "engine"})


def test_each_path_param_is_refused_in_plain_words_naming_its_label(tmp_path: Path, random_tiny_model: Path) -> None:
    """What the first task checks (``check_paths``), each refusal naming the Param by name and label."""
    from eagleflow.run.param_checks import check_paths

    (tmp_path / "in.jsonl").write_text("")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "a-file").write_text("x")
    cases = [
        ({"model_path": str(tmp_path / "models" / "Kimi-K2.5")}, 'Param model_path ("Verifier model folder"): ', "Kimi-K2.5 does not exist"),
        ({"model_path": str(tmp_path / "a-file")}, "model_path", "a-file is not a folder (give the model's folder: config.json, weights, tokenizer)"),
        ({"model_path": str(tmp_path / "not-a-model")}, "model_path", "not-a-model has no config.json (is it a model folder?)"),
        ({"dataset_input": str(tmp_path / "gone.jsonl")}, 'Param dataset_input ("Dataset input"): ', "gone.jsonl does not exist"),
        ({"dataset_input": str(tmp_path)}, "dataset_input", "is not a file"),
        ({"eval_prompts": str(tmp_path / "prompts.jsonl"), "eval_sets": ["heldout", "file"]}, "eval_prompts", "prompts.jsonl does not exist"),
        ({"output_root": str(tmp_path / "a-file")}, 'Param output_root ("Output root"): ', "a-file is not a folder"),
    ]
    for changed, name, why in cases:
        cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), **changed})
        with pytest.raises(UserError) as info:
            check_paths(cfg)
        assert name in str(info.value) and str(info.value).endswith(why), (changed, str(info.value))
    check_paths(PipelineConfig.from_params(base(tmp_path, random_tiny_model)))  # all there: nothing to say
