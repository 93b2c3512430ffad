"""The SGLang server command line: argv/env content, version-dependent flags, refusals."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from eagleflow.engine import sglang_command
from eagleflow.config import model_to_argv
from eagleflow.errors import UserError
from sglang_patch import hook_spec

def config(tmp_path: Path, **overrides) -> sglang_command.SGLangServerConfig:
    values = dict(
        model_path=str(tmp_path / "kimi"), dump_dir=tmp_path / "dumps", aux_layer_ids=[3, 31, 59], num_layers=61,
        sglang_version="0.5.23", python="/opt/sglang/bin/python", hook_pythonpath="",
    )
    values.update(overrides)
    return sglang_command.SGLangServerConfig(**values)


def build(cfg: sglang_command.SGLangServerConfig, caps: list[str] | None = None, **kwargs):
    return sglang_command.build_command(cfg, compute_caps=lambda: caps, **kwargs)


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_argv_has_the_seed_tuning_and_the_capture_requirements(tmp_path: Path) -> None:
    argv, env = build(config(tmp_path))
    assert all(isinstance(a, str) for a in argv)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert option(argv, "--model-path") == str(tmp_path / "kimi")
    assert option(argv, "--tp-size") == "8"
    assert option(argv, "--host") == "127.0.0.1"
    assert option(argv, "--port") == "30000"
    assert option(argv, "--attention-backend") == "triton"
    assert option(argv, "--num-continuous-decode-steps") == "4"
    assert "--disable-radix-cache" in argv
    assert option(argv, "--chunked-prefill-size") == "-1"
    assert option(argv, "--cuda-graph-backend-decode") == "disabled"
    assert option(argv, "--cuda-graph-backend-prefill") == "disabled"
    assert "--enforce-disable-flashinfer-allreduce-fusion" in argv
    assert env == {
        "NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "PYTHONUNBUFFERED": "1",
        "SGLANG_HS_DUMP_DIR": str(tmp_path / "dumps"),
    }


def test_forward_hooks_spec_points_at_the_hook(tmp_path: Path) -> None:
    argv, _ = build(config(tmp_path))
    (spec,) = json.loads(option(argv, "--forward-hooks"))
    assert set(spec) == {"name", "target_modules", "hook_factory", "config"}
    assert spec["hook_factory"] == "sglang_patch.hook:capture_hook_factory"
    assert spec["config"] == {
        "aux_layer_ids": [3, 31, 59], "num_layers": 61, "dump_dir": str(tmp_path / "dumps"), "hidden_states_dtype": "bf16",
    }
    argv, _ = build(config(tmp_path, hidden_states_dtype="fp8"))
    assert json.loads(option(argv, "--forward-hooks"))[0]["config"]["hidden_states_dtype"] == "fp8"
    # Both module layouts: DeepSeek-V3 (model.layers.N) and Kimi-K2.5 (language_model.model.layers.N).
    assert "model.layers.60" in spec["target_modules"]
    assert "language_model.model.layers.60" in spec["target_modules"]
    assert "language_model.model.layers.2" in spec["target_modules"]  # id 3 = layer 2's output


@pytest.mark.parametrize(
    ("version", "present", "absent"),
    [
        ("0.5.10", ["--disable-cuda-graph", "--disable-piecewise-cuda-graph"], ["--cuda-graph-backend-decode"]),
        ("0.5.13.post1", ["--disable-cuda-graph", "--disable-piecewise-cuda-graph"], ["--cuda-graph-backend-prefill"]),
        ("0.5.14", ["--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"], ["--disable-piecewise-cuda-graph"]),
        ("0.5.20", ["--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"], ["--disable-cuda-graph"]),
        ("0.5.23", ["--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"], ["--disable-cuda-graph"]),
    ],
)
def test_cuda_graph_flags_follow_the_version(tmp_path: Path, version: str, present: list[str], absent: list[str]) -> None:
    argv, _ = build(config(tmp_path, sglang_version=version))
    for flag in present:
        assert flag in argv
    for flag in absent:
        assert flag not in argv


@pytest.mark.parametrize("version", ["0.5.9", "0.5.24", "0.5.24.post1", "0.6.0", "0.4.10"])
def test_unsupported_versions_are_refused_naming_the_range(tmp_path: Path, version: str) -> None:
    with pytest.raises(UserError, match=r">=0\.5\.10,<0\.5\.24") as info:
        build(config(tmp_path, sglang_version=version))
    assert repr(version) in str(info.value)


def test_version_is_asked_from_the_server_interpreter_when_not_given(tmp_path: Path) -> None:
    asked: list[str] = []

    def probe(python: str) -> str:
        asked.append(python)
        return "0.5.12"

    argv, _ = build(config(tmp_path, sglang_version=None), version_probe=probe)
    assert asked == ["/opt/sglang/bin/python"]
    assert "--disable-piecewise-cuda-graph" in argv
    build(config(tmp_path), version_probe=lambda python: pytest.fail("probe called although the version was given"))


def test_extra_args_are_appended_as_separate_items(tmp_path: Path) -> None:
    extra = ["--trust-remote-code", "--mem-fraction-static", "0.85", "--served-model-name", "kimi; rm -rf /"]
    argv, _ = build(config(tmp_path, extra_args=extra))
    assert argv[-len(extra):] == extra  # kept verbatim, one argv item each: nothing reaches a shell


def test_a_second_engine_on_the_node_starts_after_the_first_ones_gpus(tmp_path: Path) -> None:
    assert "--base-gpu-id" not in build(config(tmp_path))[0]  # the first engine: SGLang's default, GPU 0
    argv, _ = build(config(tmp_path, tp_size=4, base_gpu_id=4))
    assert option(argv, "--base-gpu-id") == "4" and option(argv, "--tp-size") == "4"


def test_flashinfer_is_refused_on_sm120(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="SM120") as info:
        build(config(tmp_path, attention_backend="flashinfer"), caps=["12.0", "12.0"])
    assert "hung" in str(info.value) and "triton" in str(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["--attention-backend", "flashinfer"],
        ["--attention-backend=flashinfer"],
        ["--prefill-attention-backend", "flashinfer"],
        ["--decode-attention-backend=flashinfer"],
    ],
)
def test_flashinfer_in_extra_args_is_refused_on_sm120(tmp_path: Path, extra: list[str]) -> None:
    with pytest.raises(UserError, match="SM120"):
        build(config(tmp_path, extra_args=extra), caps=["12.0"])


def test_flashinfer_is_allowed_elsewhere(tmp_path: Path) -> None:
    argv, _ = build(config(tmp_path, attention_backend="flashinfer"), caps=["9.0"])  # Hopper
    assert option(argv, "--attention-backend") == "flashinfer"
    argv, _ = build(config(tmp_path, attention_backend="flashinfer"), caps=None)  # no nvidia-smi here
    assert option(argv, "--attention-backend") == "flashinfer"
    argv, _ = build(config(tmp_path, extra_args=["--decode-attention-backend", "flashinfer"]), caps=["10.0"])
    assert argv[-2:] == ["--decode-attention-backend", "flashinfer"]


def test_gpu_probe_is_not_run_for_other_backends(tmp_path: Path) -> None:
    sglang_command.build_command(
        config(tmp_path), compute_caps=lambda: pytest.fail("nvidia-smi probed although no flashinfer")
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp-size", "4"], "tp_size"),
        (["--port=31000"], "port"),
        (["--model", "x"], "model_path"),
        (["--attention-backend", "fa3"], "attention_backend"),
        (["--chunked-prefill-size", "8192"], "-1"),
        (["--forward-hooks", "[]"], "capture hook"),
        (["--cuda-graph-backend-prefill", "tc_piecewise"], "CUDA graphs off"),
        (["--enable-dp-attention"], "rank 0"),
        (["--enable-two-batch-overlap"], "never fire"),
        (["--pp-size", "2"], "pipeline"),
        (["--enable-piecewise-cuda-graph"], "replay"),
        (["--moe-runner-backend", "flashinfer_trtllm"], "deferred MoE finalize"),
        (["--moe-runner-backend=flashinfer_trtllm"], "deferred MoE finalize"),
    ],
)
def test_extra_args_that_would_break_capture_are_refused(tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        build(config(tmp_path, extra_args=extra))
    assert extra[0].partition("=")[0] in str(info.value)


def test_other_moe_runner_backends_are_kept(tmp_path: Path) -> None:
    argv, _ = build(config(tmp_path, extra_args=["--moe-runner-backend", "triton"]))
    assert argv[-2:] == ["--moe-runner-backend", "triton"]


def test_mhc_models_are_refused_before_the_server_starts(tmp_path: Path) -> None:
    model = tmp_path / "dsv4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 8, "hc_mult": 4}))
    with pytest.raises(UserError, match=r"mHC model \(hc_mult=4 .*cannot be captured"):
        build(config(tmp_path, model_path=str(model), num_layers=None, aux_layer_ids=[2]))
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 8, "hc_mult": 1}))
    build(config(tmp_path, model_path=str(model), num_layers=None, aux_layer_ids=[2]))


def test_layer_count_from_config_json(tmp_path: Path) -> None:
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8}))
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"num_hidden_layers": 61},
    }))
    argv, _ = build(config(tmp_path, model_path=str(deepseek), num_layers=None, aux_layer_ids=[2, 4, 6]))
    assert json.loads(option(argv, "--forward-hooks"))[0]["config"]["num_layers"] == 8
    assert sglang_command.read_num_layers(str(kimi)) == 61
    with pytest.raises(UserError, match="--num-layers"):
        sglang_command.read_num_layers(str(tmp_path / "missing"))


def test_aux_ids_beyond_the_model_or_repeated_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--aux-layer-ids: aux layer ids \[62\] are outside 0\.\.61"):
        build(config(tmp_path, aux_layer_ids=[3, 62]))
    with pytest.raises(ValueError, match=r"repeat \[3\]"):
        config(tmp_path, aux_layer_ids=[3, 3])


def test_pythonpath_leads_with_the_hook_package(tmp_path: Path) -> None:
    _, env = build(config(tmp_path, hook_pythonpath=None), base_env={"PYTHONPATH": "/srv/lib"})
    root = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (root / "sglang_patch" / "hook.py").is_file()
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/srv/lib"]
    _, env = build(config(tmp_path, hook_pythonpath=""))
    assert "PYTHONPATH" not in env


def test_bad_config_values_are_refused(tmp_path: Path) -> None:
    for field, value in [("tp_size", 0), ("port", 70000), ("aux_layer_ids", []), ("num_layers", 0)]:
        with pytest.raises(ValueError, match=field):
            config(tmp_path, **{field: value})


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_detect_sglang_version_asks_the_interpreter(tmp_path: Path) -> None:
    fake_python = executable(tmp_path / "python", "#!/bin/sh\necho 0.5.17\n")
    assert sglang_command.detect_sglang_version(str(fake_python)) == "0.5.17"
    # This environment has no sglang (it does not install on CPU): a clear error, not a traceback.
    with pytest.raises(UserError, match="no sglang installed"):
        sglang_command.detect_sglang_version(sys.executable)


def test_compute_caps_come_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", '#!/bin/sh\n[ "$1" = "--query-gpu=compute_cap" ] || exit 3\nprintf "12.0\\n12.0\\n"\n')
    monkeypatch.setenv("PATH", str(bin_dir))
    assert sglang_command.query_compute_caps() == ["12.0", "12.0"]
    with pytest.raises(UserError, match="SM120"):
        sglang_command.build_command(config(tmp_path, attention_backend="flashinfer"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert sglang_command.query_compute_caps() is None


def test_cli_flags_round_trip_and_print_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, extra_args=["--trust-remote-code", "--mem-fraction-static", "0.85"])
    parser = argparse.ArgumentParser()
    sglang_command.add_arguments(parser)
    # A value that starts with "--" must be attached with "=" (argparse would take it for a flag).
    flags = model_to_argv(cfg.model_copy(update={"extra_args": []}))
    args = parser.parse_args([*flags, "--extra-args=--trust-remote-code,--mem-fraction-static,0.85"])
    assert sglang_command.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    argv, env = build(cfg)
    assert printed == {"argv": argv, "env": env}
    assert hook_spec.HOOK_FACTORY in option(printed["argv"], "--forward-hooks")
