"""Behaviour of the SGLang capture hook, driven through SGLang-shaped stand-ins (sglang_fakes).

Most tests run against both layer-boundary APIs: 0.5.20's ``(hidden_states, residual)`` layers
and 0.5.23's residual stream with owed tensor-parallel sums.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sglang_fakes as fakes
from sglang_patch import hook as capture_hook
from sglang_patch import hook_spec
from sglang_patch.handoff import dump_path, error_path

NUM_LAYERS = 6
# One release per layer-boundary API: the last with (hidden_states, residual) layers, the pin.
RELEASE_OF_API = {fakes.LAYER_TUPLE: "0.5.20", fakes.RESIDUAL_STREAM: "0.5.23"}


@pytest.fixture(params=list(RELEASE_OF_API))
def api(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> fakes.FakeSGLang:
    """A stand-in ``sglang`` package of the release of the test's API (0.5.23 when it has none)."""
    sglang = fakes.FakeSGLang(monkeypatch)
    api = request.getfixturevalue("api") if "api" in request.fixturenames else fakes.RESIDUAL_STREAM
    sglang.install(RELEASE_OF_API[api])
    return sglang


def hooked_model(
    dump_dir: Path,
    aux: list[int],
    kind: str = "deepseek",
    dtype: torch.dtype = torch.float32,
    api: str = fakes.RESIDUAL_STREAM,
    hidden_states_dtype: str = "bf16",
    **build: object,
):
    """A model with the capture hook registered from the launcher's own spec, like SGLang does."""
    model = fakes.build_model(kind, NUM_LAYERS, dtype, layer_api=api, **build)
    specs = json.loads(hook_spec.forward_hooks_argument(aux, NUM_LAYERS, dump_dir, hidden_states_dtype=hidden_states_dtype))
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
def test_dumps_equal_the_residual_stream_per_request(tmp_path: Path, api: str, fake_sglang, kind: str) -> None:
    aux = [0, 2, 5]
    model, hooked = hooked_model(tmp_path, aux, kind, api=api)
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


def test_bf16_model_dumps_exact_model_dtype_states(tmp_path: Path, api: str, fake_sglang) -> None:
    aux = [1, 3]
    model, _ = hooked_model(tmp_path, aux, dtype=torch.bfloat16, api=api)
    fakes.run(model, fakes.extend_batch({"r": [3, 1, 4, 1, 5, 9]}))
    drain(model)
    sample = load_file(dump_path(tmp_path, "r"))
    assert torch.equal(sample["hidden_states"], expected_slots(model, aux))


def test_fp8_dumps_are_what_speculators_fp8_backend_reads(tmp_path: Path, api: str, fake_sglang) -> None:
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8
    from hs_connectors.transfer import FP8Transfer

    aux = [1, 3]
    model, _ = hooked_model(tmp_path, aux, dtype=torch.bfloat16, api=api, hidden_states_dtype="fp8")
    fakes.run(model, fakes.extend_batch({"row0-a": [3, 1, 4, 1, 5, 9], "row1-b": [2, 7]}))
    drain(model)
    sample = load_file(dump_path(tmp_path, "row0-a"))
    assert set(sample) == {"hidden_states", "hidden_states_scales", "token_ids"}
    # The bytes hs-connectors' own quantiser makes of the same bf16 states.
    values, scales = quantize_tensor_to_fp8(expected_slots(model, aux)[:6])
    assert sample["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(sample["hidden_states"].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(sample["hidden_states_scales"], scales)
    # And speculators' fp8 backend reads them back close to the model's states.
    (tmp_path / "hs_0.safetensors").write_bytes(dump_path(tmp_path, "row0-a").read_bytes())
    read = FP8Transfer(tmp_path).get_cached(0)
    assert read["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scales" not in read
    torch.testing.assert_close(read["hidden_states"], expected_slots(model, aux)[:6], rtol=0.07, atol=1e-3)


def test_fp8_is_quantised_after_the_last_captured_layer_and_only_fp8_reaches_the_host(
    tmp_path: Path, api: str, fake_sglang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests of one pass, the embedding slot included, quantised a few tokens at a time
    (chunks that end mid-request): every dump is hs-connectors' quantisation of that request's
    bf16 states, bit for bit, and the writer's budget held only the fp8 files' bytes."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    from sglang_patch import sample_file
    from sglang_patch.sample_file import sample_file_bytes

    aux, hidden = [0, 2, 5], 64
    monkeypatch.setattr(sample_file, "_CHUNK_ELEMENTS_CPU", 3 * (len(aux) + 1) * hidden)
    model, _ = hooked_model(tmp_path, aux, dtype=torch.bfloat16, api=api, hidden_states_dtype="fp8", hidden=hidden)
    requests = {"row0-a": [5, 6, 7, 8, 9, 10, 11], "row1-b": [1], "row2-c": [11, 12, 13, 14, 15, 16, 17, 18, 19]}
    fakes.run(model, fakes.extend_batch(requests))
    capture = captured_hook(model)
    assert capture._writer is not None
    peak = capture._writer.status().peak_pending_bytes
    drain(model)
    expected = expected_slots(model, aux)
    start = 0
    for rid, ids in requests.items():
        sample = load_file(dump_path(tmp_path, rid))
        values, scales = quantize_tensor_to_fp8(expected[start : start + len(ids)])
        assert torch.equal(sample["hidden_states"].view(torch.uint8), values.view(torch.uint8)), rid
        assert torch.equal(sample["hidden_states_scales"], scales), rid
        assert sample["token_ids"].tolist() == ids
        start += len(ids)
    assert peak == sum(sample_file_bytes(len(ids), len(aux) + 1, hidden, "fp8") for ids in requests.values())


def test_model_output_is_untouched(tmp_path: Path, api: str, fake_sglang) -> None:
    batch = fakes.extend_batch({"r0": [1, 2, 3, 4], "r1": [7, 8]})
    plain = fakes.build_model("deepseek", NUM_LAYERS, layer_api=api)
    model, _ = hooked_model(tmp_path, [0, 3], api=api)
    assert torch.equal(fakes.run(model, batch), fakes.run(plain, fakes.extend_batch({"r0": [1, 2, 3, 4], "r1": [7, 8]})))


def test_health_check_and_regeneration_requests_are_skipped(tmp_path: Path, api: str, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [2], api=api)
    requests = {"HEALTH_CHECK_1f3a": [1], "regen-row3-turn1-ab12cd34": [9, 9, 9], "row3-x": [4, 5, 6]}
    fakes.run(model, fakes.extend_batch(requests))
    drain(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row3-x.safetensors"]
    assert load_file(dump_path(tmp_path, "row3-x"))["token_ids"].tolist() == [4, 5, 6]


@pytest.mark.parametrize("mode", [fakes.ForwardMode.DECODE, fakes.ForwardMode.IDLE, fakes.ForwardMode.TARGET_VERIFY])
def test_non_extend_passes_write_nothing(tmp_path: Path, api: str, fake_sglang, mode) -> None:
    model, _ = hooked_model(tmp_path, [0, 2], api=api)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2]}, mode=mode))
    fakes.run(model, fakes.extend_batch({"row1-b": [3, 4, 5]}))  # the next prefill is still captured whole
    drain(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row1-b.safetensors"]
    assert load_file(dump_path(tmp_path, "row1-b"))["hidden_states"].shape[0] == 3


def test_tensor_parallel_rank_other_than_zero_writes_nothing(tmp_path: Path, api: str, fake_sglang) -> None:
    fake_sglang.set_thread_rank(1)
    dump_dir = tmp_path / "dumps"
    model, _ = hooked_model(dump_dir, [2], api=api)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2, 3]}))
    assert not dump_dir.exists()  # not even the writer was started on this rank


def run_ranks(models: list[torch.nn.Module], sglang: fakes.FakeSGLang, requests: dict[str, list[int]]) -> list[BaseException | None]:
    """One pass on every rank at once, each rank in its own thread; returns each rank's exception."""
    errors: list[BaseException | None] = [None] * len(models)

    def rank_main(rank: int) -> None:
        sglang.set_thread_rank(rank)
        try:
            fakes.run(models[rank], fakes.extend_batch(requests))
        except BaseException as exc:  # reported to the test, not lost in the thread
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank never finished its pass"
    return errors


def test_simulated_tensor_parallel_pending_sums_every_rank_takes_part(tmp_path: Path, fake_sglang) -> None:
    """Two ranks, each layer's MLP output owed as a per-rank partial sum: every rank completes it
    for the snapshot, rank 0 alone writes, and the dumps are the whole residual stream."""
    aux = [0, 2, 5]
    group = fakes.TensorParallelGroup(2)
    models = []
    for rank in range(2):
        fake_sglang.set_thread_rank(rank)  # the factory runs once per rank's model-runner process
        models.append(hooked_model(tmp_path, aux, tp=fakes.TensorParallelRank(group, rank))[0])
    fake_sglang.set_thread_rank(0)
    requests = {"row0-a": [5, 6, 7, 8, 9], "row1-b": [1, 2, 3]}
    assert run_ranks(models, fake_sglang, requests) == [None, None]
    drain(models[0])

    expected = expected_slots(models[0], aux).to(torch.bfloat16)
    assert torch.equal(load_file(dump_path(tmp_path, "row0-a"))["hidden_states"], expected[:5])
    assert torch.equal(load_file(dump_path(tmp_path, "row1-b"))["hidden_states"], expected[5:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row0-a.safetensors", "row1-b.safetensors"]
    # Both ranks made the same collectives: the model's own 6 completions plus the hook's 3 snapshots.
    assert group.calls == [NUM_LAYERS + 3, NUM_LAYERS + 3]
    assert all(torch.equal(models[0].oracle[k], models[1].oracle[k]) for k in range(NUM_LAYERS + 1))


def test_the_fakes_catch_a_hook_that_snapshots_on_rank_zero_only(tmp_path: Path, fake_sglang) -> None:
    """The stand-ins are strict enough: rank 0 alone in the collective leaves the ranks out of step."""
    group = fakes.TensorParallelGroup(2, timeout=2.0)
    models = [fakes.build_model("deepseek", NUM_LAYERS, layer_api=fakes.RESIDUAL_STREAM, tp=fakes.TensorParallelRank(group, r))
              for r in range(2)]
    models[0].model.layers[2].register_forward_hook(lambda module, args, output: fakes.snapshot(output[0], args[2]))
    errors = run_ranks(models, fake_sglang, {"r": [1, 2, 3]})
    assert any(isinstance(e, threading.BrokenBarrierError) for e in errors), errors


def test_the_fakes_catch_a_hook_that_reads_a_ranks_partial_sum(fake_sglang) -> None:
    group = fakes.TensorParallelGroup(2)
    models = [fakes.build_model("deepseek", NUM_LAYERS, layer_api=fakes.RESIDUAL_STREAM, tp=fakes.TensorParallelRank(group, r))
              for r in range(2)]
    read: dict[int, torch.Tensor] = {}

    def wrong(module, args, output) -> None:  # the pending value without its all-reduce
        if fake_sglang.rank() == 0:
            stream = args[2].residual_stream
            read[module.layer_id] = stream.pending.value + stream.residual

    for model in models:
        model.model.layers[2].register_forward_hook(wrong)
    assert run_ranks(models, fake_sglang, {"r": [1, 2, 3]}) == [None, None]
    assert not torch.allclose(read[2], models[0].oracle[3])


@pytest.mark.parametrize(
    ("build", "flag"),
    [({"deferred_finalize": True}, "--moe-runner-backend flashinfer_trtllm"), ({"mhc": True}, "mHC")],
)
def test_layers_a_snapshot_refuses_give_error_files_naming_what_to_change(
    tmp_path: Path, fake_sglang, build: dict, flag: str
) -> None:
    model, _ = hooked_model(tmp_path, [3], **build)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2, 3]}))
    drain(model)
    assert not dump_path(tmp_path, "row0-a").exists()
    error = json.loads(error_path(tmp_path, "row0-a").read_text())["error"]
    assert "layer 2:" in error and "snapshot" in error and flag in error


def test_two_batch_overlap_gives_error_files(tmp_path: Path, api: str, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [3], api=api)
    batch = fakes.extend_batch({"row0-a": [1, 2, 3]})
    batch.can_run_tbo = True
    fakes.run(model, batch)
    drain(model)
    assert "--enable-two-batch-overlap" in json.loads(error_path(tmp_path, "row0-a").read_text())["error"]


def test_prefix_reuse_gives_an_error_file_not_a_short_dump(tmp_path: Path, api: str, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [2, 4], api=api)
    batch = fakes.extend_batch({"row0-a": [9, 9], "row1-b": [1, 2, 3]}, prefix_lens={"row0-a": 11})
    fakes.run(model, batch)
    drain(model)
    assert not dump_path(tmp_path, "row0-a").exists()
    record = json.loads(error_path(tmp_path, "row0-a").read_text())
    assert record["rid"] == "row0-a" and record["kind"] == "prefix_reused" and not record["retryable"]
    assert record["details"] == {"extend_prefix_len": 11, "extend_seq_len": 2}
    assert "prefix" in record["error"]
    assert load_file(dump_path(tmp_path, "row1-b"))["token_ids"].tolist() == [1, 2, 3]  # its neighbour is fine


def test_extend_lengths_from_device_tensors_when_cpu_mirrors_are_unset(tmp_path: Path, api: str, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [1], api=api)
    batch = fakes.extend_batch({"a": [1, 2, 3], "b": [4, 5]})
    batch.extend_seq_lens_cpu = batch.extend_prefix_lens_cpu = None  # SGLang's gpu-only path
    fakes.run(model, batch)
    drain(model)
    assert load_file(dump_path(tmp_path, "b"))["token_ids"].tolist() == [4, 5]


def test_allreduce_fusion_partial_sums_give_error_files(tmp_path: Path, fake_sglang) -> None:
    fake_sglang.install("0.5.20")
    model, _ = hooked_model(tmp_path, [3], api=fakes.LAYER_TUPLE)
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


def test_layer_count_mismatch_is_reported_per_request(tmp_path: Path, api: str, fake_sglang) -> None:
    model = fakes.build_model("deepseek", NUM_LAYERS, layer_api=api)
    specs = hook_spec.forward_hooks_spec([2], NUM_LAYERS, tmp_path)
    specs[0]["config"]["num_layers"] = NUM_LAYERS + 1
    specs[0]["target_modules"] = ["model.layers.1", f"model.layers.{NUM_LAYERS - 1}"]
    fakes.register_forward_hooks(model, specs)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2]}))
    drain(model)
    assert "num_hidden_layers=6" in json.loads(error_path(tmp_path, "row0-a").read_text())["error"]


def test_missing_target_module_is_reported_not_silently_short(tmp_path: Path, api: str, fake_sglang) -> None:
    model = fakes.build_model("deepseek", NUM_LAYERS, layer_api=api)
    specs = hook_spec.forward_hooks_spec([2, 4], NUM_LAYERS, tmp_path)
    specs[0]["target_modules"] = [p for p in specs[0]["target_modules"] if not p.endswith("layers.3")]
    fakes.register_forward_hooks(model, specs)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2]}))
    drain(model)
    assert "layer ids [4]" in json.loads(error_path(tmp_path, "row0-a").read_text())["error"]
    assert not dump_path(tmp_path, "row0-a").exists()


def test_a_hook_failure_never_reaches_the_forward_pass(tmp_path: Path, api: str, fake_sglang, caplog) -> None:
    model, _ = hooked_model(tmp_path, [2], api=api)
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
    for version in ("0.5.9", "0.5.24", "0.5.24.post1", "0.6.0", "0.4.10.post2", "0.0.0.dev0"):
        fake_sglang.install(version)
        with pytest.raises(hook_spec.UnsupportedSGLangVersion) as info:
            capture_hook.capture_hook_factory(config)
        assert ">=0.5.10,<0.5.24" in str(info.value) and repr(version) in str(info.value)
    for version, api in (("0.5.10", "layer_tuple"), ("0.5.10.post1", "layer_tuple"), ("0.5.15.post1", "layer_tuple"),
                         ("0.5.20", "layer_tuple"), ("0.5.21", "residual_stream"), ("0.5.22", "residual_stream"),
                         ("0.5.23", "residual_stream")):
        fake_sglang.install(version)
        capture = capture_hook.capture_hook_factory(config)
        assert isinstance(capture, capture_hook.HiddenStateCapture) and capture._reader.api == api, version


def test_factory_refuses_a_release_whose_layer_api_is_not_its_versions(tmp_path: Path, fake_sglang, monkeypatch) -> None:
    config = {"aux_layer_ids": [2], "num_layers": NUM_LAYERS, "dump_dir": str(tmp_path)}
    fake_sglang.install("0.5.22")
    monkeypatch.delitem(sys.modules, "sglang.srt.layers.layer_boundary.residual.batch")
    with pytest.raises(hook_spec.UnsupportedSGLangVersion, match="residual_stream layer API, but .*snapshot is missing"):
        capture_hook.capture_hook_factory(config)


def test_factory_takes_the_dump_folder_and_dtype_from_its_config(tmp_path: Path, fake_sglang, monkeypatch) -> None:
    config = {"aux_layer_ids": [2], "num_layers": NUM_LAYERS}
    monkeypatch.delenv(hook_spec.DUMP_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=hook_spec.DUMP_DIR_ENV):
        capture_hook.capture_hook_factory(config)
    monkeypatch.setenv(hook_spec.DUMP_DIR_ENV, str(tmp_path))
    capture = capture_hook.capture_hook_factory(config)
    assert capture.dump_dir == str(tmp_path) and capture.hidden_states_dtype == "bf16"
    with pytest.raises(ValueError, match="num_layers"):
        capture_hook.capture_hook_factory({"aux_layer_ids": [2]})
    assert capture_hook.capture_hook_factory({**config, "hidden_states_dtype": "fp8"}).hidden_states_dtype == "fp8"
    with pytest.raises(ValueError, match=r"'fp16' is not one of \['bf16', 'fp8'\]"):
        capture_hook.capture_hook_factory({**config, "hidden_states_dtype": "fp16"})


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


def test_a_module_hooked_under_two_names_still_gives_one_whole_dump(tmp_path: Path, api: str, fake_sglang) -> None:
    aux = [0, 3]
    model = fakes.build_model("kimi-aliased", NUM_LAYERS, layer_api=api)
    specs = hook_spec.forward_hooks_spec(aux, NUM_LAYERS, tmp_path)
    hooked = fakes.register_forward_hooks(model, specs, remove_duplicate=False)
    assert "model.layers.5" in hooked and "language_model.model.layers.5" in hooked  # each hook runs twice
    fakes.run(model, fakes.extend_batch({"r": [1, 2, 3]}))
    drain(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.safetensors"]
    assert torch.equal(load_file(dump_path(tmp_path, "r"))["hidden_states"], expected_slots(model, aux).to(torch.bfloat16))


def test_final_layer_id_as_aux_equals_the_final_slot(tmp_path: Path, api: str, fake_sglang) -> None:
    model, _ = hooked_model(tmp_path, [NUM_LAYERS], api=api)
    fakes.run(model, fakes.extend_batch({"r": [1, 2, 3]}))
    drain(model)
    states = load_file(dump_path(tmp_path, "r"))["hidden_states"]
    assert torch.equal(states[:, 0], states[:, 1])


def test_layer_states_are_copied_out_at_once_so_no_batch_tensor_is_held(tmp_path: Path, api: str, fake_sglang) -> None:
    """Three requests in one batch: the dumps are exact, and between layers the hook holds no
    tensor of the batch (the capture keeps one layer's state on the GPU, only while copying it)."""
    aux = [1, 3]
    model, _ = hooked_model(tmp_path, aux, api=api)
    capture = captured_hook(model)
    held: list[list[str]] = []
    layers = model.model.layers
    layers[2].register_forward_hook(lambda *_: held.append([k for k, v in vars(capture).items() if isinstance(v, torch.Tensor)]))
    requests = {"row0-a": [5, 6, 7, 8, 9], "row1-b": [1, 2], "row2-c": [11, 12, 13, 14, 15, 16, 17]}
    fakes.run(model, fakes.extend_batch(requests))
    drain(model)
    assert held == [[]]
    expected = expected_slots(model, aux).to(torch.bfloat16)
    start = 0
    for rid, ids in requests.items():
        assert torch.equal(load_file(dump_path(tmp_path, rid))["hidden_states"], expected[start : start + len(ids)])
        start += len(ids)


def test_a_writer_behind_its_budget_costs_a_pass_one_bounded_wait_not_one_per_request(tmp_path: Path, fake_sglang) -> None:
    from sglang_patch.dump_writer import DumpWriter
    from sglang_patch.sample_file import sample_file_bytes

    one = sample_file_bytes(4, 2, 16)
    wait = 1.0  # the writer's wait_seconds; the two queued dumps stay for 3 of them
    model = fakes.build_model("deepseek", NUM_LAYERS)
    capture = capture_hook.HiddenStateCapture(
        [2], NUM_LAYERS, tmp_path, tp_rank=lambda: 0,
        writer_factory=lambda d, **kw: DumpWriter(d, max_pending_bytes=2 * one, wait_seconds=wait, threads=1, write_delay=3 * wait, **kw),
    )
    for name in ("model.layers.1", "model.layers.5"):
        model.get_submodule(name).register_forward_hook(capture)
    fakes.run(model, fakes.extend_batch({"row0-a": [1, 2, 3, 4], "row1-b": [5, 6, 7, 8]}))  # fills the budget
    started = time.monotonic()
    fakes.run(model, fakes.extend_batch({f"row{i}-c": [1, 2, 3, 4] for i in range(2, 7)}))
    # One wait, not five; the bound is a second wait, so a loaded machine's slow pass is not mistaken for one.
    assert time.monotonic() - started < 2 * wait, "five requests waited once, not five times"
    capture.close()
    for i in range(2, 7):
        record = json.loads(error_path(tmp_path, f"row{i}-c").read_text())
        assert record["kind"] == "writer_behind" and record["retryable"]
    assert dump_path(tmp_path, "row0-a").exists() and dump_path(tmp_path, "row1-b").exists()
