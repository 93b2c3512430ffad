"""The export's EAGLE-3.1 drafter, attention bias and rotary settings against SGLang's real source, per wheel.

As in ``test_sglang_drafter_source``: SGLang's own ``llama_eagle3.py`` and ``llama.py`` build the
class from the exported config and load the exported weights (``sglang_exec``). Here the drafter
is the ``eagle3.1`` variant (per-aux ``fc_norm``, ``norm_output``, no ``norm_before_fc``) with an
``o_proj`` bias and Kimi-K2's YaRN rotary, so every wheel that serves the variant must load each
of its weights, build what its config says, and hand ``get_rope`` the settings the reference
drafter computes with; older wheels are refused for it by name.
"""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.sglang_rules import rope_settings, sglang_rotary
from eagleflow.engine.sglang_serving import build_serving_command
from eagleflow.errors import UserError
from eagleflow.drafters.eagle3.sglang_export import SINCE
from eagleflow.export.step import ExportConfig, export
from eagleflow.export.manifest import ServedDrafter
from eagleflow.drafters.eagle3 import VARIANT_FLAGS
from sglang_exec import EAGLE3, LLAMA, load_into_sglang, sglang_ropes
from sglang_patch.hook_spec import parse_version
from sglang_wheels import find_class, find_function, get_wheel, pinned_version
from training_data import random_speculators_checkpoint

pytestmark = pytest.mark.sglang_source

AUX = [2, 4, 5]
DRAFT_VOCAB = 256
KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
             "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
# The releases that serve eagle3.1 (fc_norm and norm_output from 0.5.13), the pin among them.
EAGLE31_VERSIONS = sorted({"0.5.13.post1", "0.5.17", "0.5.20", "0.5.21", "0.5.22", "0.5.23", pinned_version()}, key=parse_version)
EAGLE31 = {"fc_norm": True, "norm_before_fc": False, "norm_output": True}


def test_the_variants_speculators_flags_are_the_checkpoint_settings_the_fixture_uses() -> None:
    assert VARIANT_FLAGS["eagle3.1"] == ("--fc-norm", "--no-norm-before-fc", "--norm-output")


@pytest.fixture(scope="module")
def exported(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An eagle3.1 drafter with an o_proj bias (q/k/v biases zero) and YaRN rotary, exported."""
    folder = tmp_path_factory.mktemp("eagle31")
    ckpt = random_speculators_checkpoint(
        random_tiny_model, folder / "checkpoint", False, AUX, DRAFT_VOCAB, draft_flags=EAGLE31,
        layer_settings={"attention_bias": True, "rope_parameters": dict(KIMI_YARN)},
    )
    weights = load_file(str(ckpt / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]:
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=folder / "drafter"))
    return folder / "drafter"


@pytest.mark.parametrize("version", EAGLE31_VERSIONS)
def test_every_serving_wheel_loads_the_eagle31_drafter_as_exported(exported: Path, version: str) -> None:
    model, params, skipped, loaded, _ = load_into_sglang(get_wheel(version), exported / "sglang")
    assert skipped == [], f"sglang {version} silently skips {skipped}"
    assert [name for name, p in params.items() if id(p) not in loaded] == ["model.embed_tokens.weight"]
    inner = model.model
    assert inner.fc_norm is not None and len(inner.fc_norm) == len(AUX) and getattr(inner, "input_norm", None) is None
    assert inner.norm_output and inner.fc.in_features == len(AUX) * 64
    for layer in (0, 1):
        assert f"model.layers.{layer}.self_attn.o_proj.bias" in params  # built from attention_bias, and loaded
        assert f"model.layers.{layer}.self_attn.qkv_proj.bias" not in params  # never built: the export drops zeros


@pytest.mark.parametrize("version", EAGLE31_VERSIONS)
def test_sglang_builds_the_rotary_the_reference_drafter_computes(exported: Path, version: str) -> None:
    config = json.loads((exported / "sglang" / "config.json").read_text())
    theta, scaling = rope_settings(config)
    rotary = sglang_rotary(config, int(config["head_dim"]))
    ropes = sglang_ropes(get_wheel(version), exported / "sglang")
    assert len(ropes) == config["num_hidden_layers"]
    for rope in ropes:
        assert (rope["base"], rope["rotary_dim"], rope["is_neox_style"]) == (theta, rotary.rotary_dim, rotary.neox)
        assert {k: rope["rope_scaling"][k] for k in KIMI_YARN} == {k: scaling[k] for k in KIMI_YARN} == KIMI_YARN


def test_a_wheel_before_fc_norm_is_refused_for_eagle31_by_name(exported: Path) -> None:
    assert "fc_norm" not in get_wheel("0.5.10").text(EAGLE3)  # it would serve the drafter without its norms
    drafter = ServedDrafter.from_export(exported)
    assert drafter.minimum_sglang == ".".join(map(str, SINCE["fc_norm"])) == "0.5.13"
    with pytest.raises(UserError, match=r"needs sglang >= 0.5.13 .* found sglang 0.5.10"):
        build_serving_command("/models/tiny", 30000, drafter, sglang_version="0.5.10", compute_caps=lambda: None)
    build_serving_command("/models/tiny", 30000, drafter, sglang_version="0.5.13.post1", compute_caps=lambda: None)


@pytest.mark.parametrize("version", sorted({"0.5.17", "0.5.20", "0.5.23", pinned_version()}, key=parse_version))
def test_sglang_keeps_the_drafts_own_embedding_when_the_widths_differ(version: str) -> None:
    """What the reference drafter follows: set_embed leaves a draft of another width its own embedding."""
    function = find_function(find_class(get_wheel(version).tree(LLAMA), "LlamaForCausalLM"), "set_embed")
    namespace: dict[str, object] = {"_is_xpu": False, "current_platform": types.SimpleNamespace(
        empty_cache=lambda: None, synchronize=lambda: None)}
    exec(ast.unparse(function), namespace)
    for hidden, target, shared in ((64, 32, False), (64, 64, True)):
        own = torch.nn.Parameter(torch.zeros(4, hidden))
        draft = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden, target_hidden_size=target),
                                      model=types.SimpleNamespace(embed_tokens=torch.nn.Embedding(4, hidden)))
        draft.model.embed_tokens.weight = own
        target_embed = torch.nn.Parameter(torch.ones(4, hidden))
        namespace["set_embed"](draft, target_embed)
        assert (draft.model.embed_tokens.weight is target_embed) == shared
