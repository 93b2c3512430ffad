"""The export against SGLang's real source: what ``LlamaForCausalLMEagle3`` reads and loads, per wheel.

SGLang's own ``llama_eagle3.py`` and ``llama.py`` run on CPU with stand-ins for the rest
(``sglang_exec``): the class is built from the exported ``config.json`` exactly as SGLang's
config loader builds it (``transformers.AutoConfig``) and its real ``load_weights`` consumes the
exported weights one by one, so a name SGLang would silently skip, a parameter left unloaded or a
setting it does not read shows up here. The target models' own ``set_eagle3_layers_to_capture``
checks which layers the exported aux ids make SGLang capture.
"""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleflow.config import model_to_argv
from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.sglang_serving import build_serving_command, speculative_flags
from eagleflow.errors import UserError
from eagleflow.drafters.eagle3.sglang_export import SINCE, TARGET_CAPTURE_RULES, captured_layer_ids, sglang_aux_layer_ids
from eagleflow.export.step import ExportConfig, export
from eagleflow.export.manifest import ServedDrafter
from sglang_exec import EAGLE3, load_into_sglang
from sglang_patch.hook_spec import parse_version
from sglang_wheels import Wheel, cli_flags, find_class, find_function, get_wheel, pinned_version
from training_data import random_speculators_checkpoint

pytestmark = pytest.mark.sglang_source

AUX = [2, 4, 5]
DRAFT_VOCAB = 256
# Releases that serve the drafter speculators 0.8.1 trains (norm_before_fc needs 0.5.17), the pin among them.
SERVING_VERSIONS = sorted({"0.5.17", "0.5.20", "0.5.21", "0.5.22", "0.5.23", pinned_version()}, key=parse_version)
# Each SINCE entry: the release before it and the release from it (the boundary, both sides).
BOUNDARIES = {"aux_layer_count": ("0.5.10", "0.5.13.post1"), "fc_norm": ("0.5.10", "0.5.13.post1"),
              "norm_output": ("0.5.10", "0.5.13.post1"), "norm_before_fc": ("0.5.16", "0.5.17")}
# What llama_eagle3.py must read for each setting.
SETTING_KEYS = {"aux_layer_count": "eagle_aux_hidden_state_layer_ids", "fc_norm": "fc_norm",
                "norm_output": "norm_output", "norm_before_fc": "norm_before_fc"}


@pytest.fixture(scope="module")
def exported(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer drafter of the tiny verifier (norm_before_fc, norm_output: speculators' defaults), exported."""
    folder = tmp_path_factory.mktemp("export")
    checkpoint = random_speculators_checkpoint(random_tiny_model, folder / "checkpoint", False, AUX, DRAFT_VOCAB)
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=folder / "drafter"))
    return folder / "drafter"


@pytest.mark.parametrize("version", SERVING_VERSIONS)
def test_sglang_loads_every_exported_weight_and_reads_every_setting(exported: Path, version: str) -> None:
    model, params, skipped, loaded, loads = load_into_sglang(get_wheel(version), exported / "sglang")
    assert skipped == [], f"sglang {version} silently skips {skipped}"
    # Every parameter of SGLang's draft gets a weight, but the embedding SGLang takes from the target.
    assert [name for name, p in params.items() if id(p) not in loaded] == ["model.embed_tokens.weight"]
    shards = {(name, shard) for p, _, shard in loads for name, q in params.items() if q is p and shard is not None}
    for layer in (0, 1):
        qkv, gate_up = f"model.layers.{layer}.self_attn.qkv_proj.weight", f"model.layers.{layer}.mlp.gate_up_proj.weight"
        assert {shard for name, shard in shards if name == qkv} == {"q", "k", "v"}
        assert {shard for name, shard in shards if name == gate_up} == {0, 1}
    # The settings SGLang reads are the ones the drafter was trained with.
    d2t = load_file(str(exported / "sglang" / "model.safetensors"))["d2t"]
    assert torch.equal(model.hot_token_id, d2t + torch.arange(DRAFT_VOCAB))
    assert model.model.num_aux_hidden_states == len(AUX) and model.model.fc.in_features == len(AUX) * 64
    assert model.model.norm_before_fc and model.model.input_norm is not None and model.model.norm_output
    assert model.model.fc_norm is None and not model.load_lm_head_from_target
    assert [layer.is_input_layer for layer in model.model.layers] == [True, False]
    assert model.config.draft_vocab_size == DRAFT_VOCAB and model.config.vocab_size == 1024


def test_an_older_sglang_would_drop_what_the_drafter_needs_so_serving_it_is_refused(exported: Path) -> None:
    _, _, skipped, _, _ = load_into_sglang(get_wheel("0.5.14"), exported / "sglang")
    assert skipped == ["input_norm.weight"]  # norm_before_fc: not read before 0.5.17
    drafter = ServedDrafter.from_export(exported)
    assert drafter.minimum_sglang == "0.5.17"
    with pytest.raises(UserError, match=r"needs sglang >= 0.5.17 .* found sglang 0.5.14"):
        build_serving_command("/models/tiny", 30000, drafter, sglang_version="0.5.14", compute_caps=lambda: None)
    argv, _ = build_serving_command("/models/tiny", 30000, drafter, sglang_version="0.5.20", compute_caps=lambda: None)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(exported / "sglang")


@pytest.mark.parametrize("setting", sorted(BOUNDARIES))
def test_each_setting_is_read_from_the_release_the_export_says(setting: str) -> None:
    before, since = BOUNDARIES[setting]
    assert parse_version(before) < SINCE[setting] <= parse_version(since)
    key = SETTING_KEYS[setting]
    assert key not in get_wheel(before).text(EAGLE3), f"sglang {before} already reads {key}"
    assert key in get_wheel(since).text(EAGLE3), f"sglang {since} does not read {key}"


def layers_to_capture(wheel: Wheel, architecture: str, ids: list[int], num_layers: int = 61) -> list[int]:
    """Run the target's own ``set_eagle3_layers_to_capture`` (found along its bases in its file)."""
    filename = f"sglang/srt/models/{TARGET_CAPTURE_RULES[architecture][0]}"
    tree = wheel.tree(filename)
    cls = find_class(tree, architecture)
    while not any(isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture" for n in cls.body):
        cls = find_class(tree, ast.unparse(cls.bases[0]))
    source = ast.unparse(find_function(cls, "set_eagle3_layers_to_capture"))
    namespace: dict[str, object] = {"Optional": object, "List": list}
    exec(source, namespace)
    received: list[list[int]] = []
    language_model = types.SimpleNamespace(set_eagle3_layers_to_capture=lambda got: received.append(list(got)))
    target = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True), config=types.SimpleNamespace(num_hidden_layers=num_layers),
        model=types.SimpleNamespace(), language_model=language_model,
    )
    namespace["set_eagle3_layers_to_capture"](target, list(ids))
    if received:  # a wrapper (Kimi-K2.5) hands the ids to its DeepseekV3ForCausalLM
        return layers_to_capture(wheel, "DeepseekV3ForCausalLM", received[0], num_layers)
    return list(target.model.layers_to_capture)


@pytest.mark.parametrize("version", SERVING_VERSIONS)
@pytest.mark.parametrize("architecture", sorted(TARGET_CAPTURE_RULES))
def test_exported_aux_ids_make_the_target_capture_the_trained_layers(version: str, architecture: str) -> None:
    wheel = get_wheel(version)
    for trained in ([3, 31, 59], [2, 30, 58], [2, 5, 9]):
        exported_ids = sglang_aux_layer_ids(trained, architecture)
        assert layers_to_capture(wheel, architecture, exported_ids) == trained, (architecture, trained, exported_ids)
        assert captured_layer_ids(exported_ids, architecture) == trained


@pytest.mark.parametrize("version", SERVING_VERSIONS)
def test_serving_flags_are_sglangs_and_the_reference_engine_takes_the_same_names(version: str) -> None:
    drafter = ServedDrafter(Path("/d"), num_steps=3, window=2048)
    ours = {flag for flag in speculative_flags(drafter) if flag.startswith("--")}
    assert ours <= cli_flags(get_wheel(version)), ours - cli_flags(get_wheel(version))
    reference = ReferenceEngineConfig(
        model=Path("/m"), speculative_algorithm="EAGLE3", speculative_draft_model_path=drafter.path, speculative_num_steps=3,
        speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_draft_window_size=2048,
    )
    reference_flags = {arg.split("=")[0] for arg in model_to_argv(reference) if arg.startswith("--speculative")}
    assert reference_flags == ours
    assert json.loads(json.dumps(speculative_flags(drafter)))[speculative_flags(drafter).index("--speculative-num-draft-tokens") + 1] == "4"
