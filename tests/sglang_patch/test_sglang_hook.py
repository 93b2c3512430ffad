"""Behaviour of the SGLang capture hook, driven through SGLang-shaped stand-ins (sglang_fakes)."""

from __future__ import annotations

import fnmatch
import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sglang_fakes as fakes
from sglang_patch import hook as capture_hook
from sglang_patch import hook_spec
from sglang_patch.dump_writer import dump_path, error_path

NUM_LAYERS = 6


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch):
    """A stand-in ``sglang`` package: ``__version__`` and the tensor-parallel rank the hook asks for."""

    def install(version: str = "0.5.20", tp_rank: int = 0) -> None:
        root = types.ModuleType("sglang")
        root.__version__ = version
        parallel_state = types.ModuleType("sglang.srt.distributed.parallel_state")
        parallel_state.get_tensor_model_parallel_rank = lambda: tp_rank
        for name, module in {
            "sglang": root,
            "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.distributed": types.ModuleType("sglang.srt.distributed"),
            "sglang.srt.distributed.parallel_state": parallel_state,
        }.items():
            monkeypatch.setitem(sys.modules, name, module)

    install()
    return install


def hooked_model(dump_dir: Path, aux: list[int], kind: str = "deepseek", dtype: torch.dtype = torch.float32):
    """A model with the capture hook registered from the launcher's own spec, like SGLang does."""
    model = fakes.build_model(kind, NUM_LAYERS, dtype)
    specs = json.loads(hook_spec.forward_hooks_argument(aux, NUM_LAYERS, dump_dir))
    hooked = fakes.register_forward_hooks(model, specs)
    assert hooked, "the spec's patterns matched no module"
    return model, hooked


def captured_hook(model: torch.nn.Module) -> capture_hook.HiddenStateCapture:
    for module in model.modules():
        for hook in module._forward_hooks.values():
            if isinstance(hook, capture_hook.HiddenStateCapture):
                return hook
    raise AssertionError("no capture hook registered")


def drain(model: torch.nn.Module) -> None:
    captured_hook(model).close()


def expected_slots(model: torch.nn.Module, aux: list[int]) -> torch.Tensor:
    return torch.stack([model.oracle[k] for k in [*aux, NUM_LAYERS]], dim=1)


@pytest.mark.parametrize("kind", ["deepseek", "kimi", "kimi-aliased"])
def test_dumps_equal_the_residual_stream_per_request(tmp_path: Path, fake_sglang, kind: str) -> None:
    aux = [0, 2, 5]
    model, hooked = hooked_model(tmp_path, aux, kind)
    prefix = "model" if kind == "deepseek" else "language_model.model"
    assert sorted(hooked) == sorted([f"{prefix}.embed_tokens", f"{prefix}.layers.1", f"{prefix}.layers.4", f"{prefix}.layers.5"])
    requests = {"row0-a": [5, 6, 7, 8, 9], "row1-b": [1, 2, 3], "row2-c": [11, 12, 13, 14, 15, 16, 17]}
    batch = fakes.extend_batch(requests)
    fakes.run(model, batch)
    drain(model)

    expected = expected_slots(model, aux)
    start = 0
    for rid, ids in requests.items():
        sample = load_file(dump_path(tmp_path, rid))
        assert sample["hidden_states"].shape == (len(ids), len(aux) + 1, 16)
        assert sample["hidden_states"].dtype == torch.bfloat16
        torch.testing.assert_close(sample["hidden_states"], expected[start : start + len(ids)].to(torch.bfloat16), rtol=0, atol=0)
        assert sample["token_ids"].tolist() == ids
        start += len(ids)
    # The slots differ from each other (no slot silently repeats another's tensor).
    assert not torch.equal(expected[:, 1], expected[:, 2])


def test_bf16_model_dumps_exact_model_dtype_states(tmp_path: Path, fake_sglang) -> None:
    aux = [1, 3]
    model, _ = hooked_model(tmp_path, aux, dtype=torch.bfloat16)
    fakes.run(model, fakes.extend_batch({"r": [3, 1, 4, 1, 5, 9]}))
    drain(model)
    sample = load_file(dump_path(tmp_path, "r"))
    assert torch.equal(sample["hidden_states"], expected_slots(model, aux))


def test_model_output_is_untouched(tmp_path: Path, fake_sglang) -> None:
    batch = fakes.extend_batch({"r0": [1, 2, 3, 4], "r1": [7, 8]})
    plain = fakes.build_model("deepseek", NUM_LAYERS)
    model, _ = hooked_model(tmp_path, [0, 3])
    assert torch.equal(fakes.run(model, batch), fakes.run(plain, batch))


def test_health_check_and_regeneration_requests_are_skipped(tmp_path: Path, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [2])
    requests = {"HEALTH_CHECK_1f3a": [1], "regen-row3-turn1-ab12cd34": [9, 9, 9], "row3-x": [4, 5, 6]}
    fakes.run(model, fakes.extend_batch(requests))
    drain(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row3-x.safetensors"]
    assert load_file(dump_path(tmp_path, "row3-x"))["token_ids"].tolist() == [4, 5, 6]


@pytest.mark.parametrize("mode", [fakes.ForwardMode.DECODE, fakes.ForwardMode.IDLE, fakes.ForwardMode.TARGET_VERIFY])
def test_non_extend_passes_write_nothing(tmp_path: Path, fake_sglang, mode) -> None:
    model, _ = hooked_model(tmp_path, [0, 2])
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2]}, mode=mode))
    fakes.run(model, fakes.extend_batch({"row1-b": [3, 4, 5]}))  # the next prefill is still captured whole
    drain(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row1-b.safetensors"]
    assert load_file(dump_path(tmp_path, "row1-b"))["hidden_states"].shape[0] == 3


def test_tensor_parallel_rank_other_than_zero_writes_nothing(tmp_path: Path, fake_sglang) -> None:
    fake_sglang(tp_rank=1)
    dump_dir = tmp_path / "dumps"
    model, _ = hooked_model(dump_dir, [2])
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2, 3]}))
    assert not dump_dir.exists()  # not even the writer was started on this rank


def test_prefix_reuse_gives_an_error_file_not_a_short_dump(tmp_path: Path, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [2, 4])
    batch = fakes.extend_batch({"row0-a": [9, 9], "row1-b": [1, 2, 3]}, prefix_lens={"row0-a": 11})
    fakes.run(model, batch)
    drain(model)
    assert not dump_path(tmp_path, "row0-a").exists()
    record = json.loads(error_path(tmp_path, "row0-a").read_text())
    assert record["rid"] == "row0-a"
    assert record["extend_prefix_len"] == 11 and record["extend_seq_len"] == 2
    assert "prefix" in record["error"]
    assert load_file(dump_path(tmp_path, "row1-b"))["token_ids"].tolist() == [1, 2, 3]  # its neighbour is fine


def test_extend_lengths_from_device_tensors_when_cpu_mirrors_are_unset(tmp_path: Path, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [1])
    batch = fakes.extend_batch({"a": [1, 2, 3], "b": [4, 5]})
    batch.extend_seq_lens_cpu = batch.extend_prefix_lens_cpu = None  # SGLang's gpu-only path
    fakes.run(model, batch)
    drain(model)
    assert load_file(dump_path(tmp_path, "b"))["token_ids"].tolist() == [4, 5]


def test_allreduce_fusion_partial_sums_give_error_files(tmp_path: Path, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [3])
    # SGLang marks a layer output whose MLP all-reduce is deferred into the next layer.
    original = model.model.layers[2].forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out[0]._sglang_needs_allreduce_fusion = True
        return out

    model.model.layers[2].forward = forward
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2, 3]}))
    drain(model)
    assert not dump_path(tmp_path, "row0-a").exists()
    assert "--enforce-disable-flashinfer-allreduce-fusion" in json.loads(error_path(tmp_path, "row0-a").read_text())["error"]


def test_layer_count_mismatch_is_reported_per_request(tmp_path: Path, fake_sglang) -> None:
    model = fakes.build_model("deepseek", NUM_LAYERS)
    specs = hook_spec.forward_hooks_spec([2], NUM_LAYERS, tmp_path)
    specs[0]["config"]["num_layers"] = NUM_LAYERS + 1
    specs[0]["target_modules"] = ["model.layers.1", f"model.layers.{NUM_LAYERS - 1}"]
    fakes.register_forward_hooks(model, specs)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2]}))
    drain(model)
    assert "num_hidden_layers=6" in json.loads(error_path(tmp_path, "row0-a").read_text())["error"]


def test_missing_target_module_is_reported_not_silently_short(tmp_path: Path, fake_sglang) -> None:
    model = fakes.build_model("deepseek", NUM_LAYERS)
    specs = hook_spec.forward_hooks_spec([2, 4], NUM_LAYERS, tmp_path)
    specs[0]["target_modules"] = [p for p in specs[0]["target_modules"] if not p.endswith("layers.3")]
    fakes.register_forward_hooks(model, specs)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2]}))
    drain(model)
    assert "layer ids [4]" in json.loads(error_path(tmp_path, "row0-a").read_text())["error"]
    assert not dump_path(tmp_path, "row0-a").exists()


def test_a_hook_failure_never_reaches_the_forward_pass(tmp_path: Path, fake_sglang, caplog) -> None:
    model, _ = hooked_model(tmp_path, [2])
    batch = fakes.extend_batch({"row0-a": [1, 2]})
    batch.rids = None  # nothing to name the dump after
    with caplog.at_level(logging.ERROR, logger="sglang_patch.hook"):
        out = fakes.run(model, batch)
    assert out.shape == (2, 50)
    assert "rids is None" in caplog.text
    # The next pass is captured normally.
    fakes.run(model, fakes.extend_batch({"row1-b": [3]}))
    drain(model)
    assert dump_path(tmp_path, "row1-b").exists()


def test_factory_refuses_unsupported_versions(tmp_path: Path, fake_sglang) -> None:
    config = {"aux_layer_ids": [2], "num_layers": NUM_LAYERS, "dump_dir": str(tmp_path)}
    for version in ("0.5.9", "0.5.21", "0.5.23", "0.4.10.post2", "0.0.0.dev0"):
        fake_sglang(version=version)
        with pytest.raises(hook_spec.UnsupportedSGLangVersion) as info:
            capture_hook.capture_hook_factory(config)
        assert ">=0.5.10,<0.5.21" in str(info.value) and repr(version) in str(info.value)
    for version in ("0.5.10", "0.5.10.post1", "0.5.15.post1", "0.5.20"):
        fake_sglang(version=version)
        assert isinstance(capture_hook.capture_hook_factory(config), capture_hook.HiddenStateCapture)


def test_factory_takes_the_dump_folder_from_the_environment(tmp_path: Path, fake_sglang, monkeypatch) -> None:
    config = {"aux_layer_ids": [2], "num_layers": NUM_LAYERS}
    monkeypatch.delenv(hook_spec.DUMP_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=hook_spec.DUMP_DIR_ENV):
        capture_hook.capture_hook_factory(config)
    monkeypatch.setenv(hook_spec.DUMP_DIR_ENV, str(tmp_path))
    assert capture_hook.capture_hook_factory(config).dump_dir == str(tmp_path)
    with pytest.raises(ValueError, match="num_layers"):
        capture_hook.capture_hook_factory({"aux_layer_ids": [2]})


def test_target_names_are_exact_for_both_layouts() -> None:
    names = hook_spec.target_module_names([3, 31, 59], 61)
    assert names == [
        "model.layers.2", "model.layers.30", "model.layers.58", "model.layers.60",
        "language_model.model.layers.2", "language_model.model.layers.30",
        "language_model.model.layers.58", "language_model.model.layers.60",
    ]
    assert not any(fnmatch.fnmatch("model.layers.20", p) for p in names)
    assert not any(fnmatch.fnmatch("vision_tower.model.layers.2", p) for p in names)
    assert hook_spec.target_module_names([0], 4) == [
        "model.embed_tokens", "model.layers.3", "language_model.model.embed_tokens", "language_model.model.layers.3",
    ]


def test_a_module_hooked_under_two_names_still_gives_one_whole_dump(tmp_path: Path, fake_sglang) -> None:
    aux = [0, 3]
    model = fakes.build_model("kimi-aliased", NUM_LAYERS)
    specs = hook_spec.forward_hooks_spec(aux, NUM_LAYERS, tmp_path)
    hooked = fakes.register_forward_hooks(model, specs, remove_duplicate=False)
    assert "model.layers.5" in hooked and "language_model.model.layers.5" in hooked  # each hook runs twice
    fakes.run(model, fakes.extend_batch({"r": [1, 2, 3]}))
    drain(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.safetensors"]
    assert torch.equal(load_file(dump_path(tmp_path, "r"))["hidden_states"], expected_slots(model, aux).to(torch.bfloat16))


def test_final_layer_id_as_aux_equals_the_final_slot(tmp_path: Path, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [NUM_LAYERS])
    fakes.run(model, fakes.extend_batch({"r": [1, 2, 3]}))
    drain(model)
    states = load_file(dump_path(tmp_path, "r"))["hidden_states"]
    assert torch.equal(states[:, 0], states[:, 1])
