"""The export's DFlash drafter against the pinned SGLang's own ``DFlashDraftModel``, run from the wheel's source.

SGLang's ``models/dflash.py`` and ``speculative/dflash_utils.py`` run as they are on CPU, with the rest
of SGLang stubbed (``sglang_dflash_exec``): the class is built from the exported ``config.json`` as
SGLang's config loader builds it (``transformers.AutoConfig``), so the block size, context layers,
per-layer attention and rotary settings are what SGLang's own parser reads; its real ``load_weights``
consumes the exported tensors one by one, so a name it would silently skip, or a parameter it built
and never assigned, shows up by name. Then the part of its forward that runs on CPU runs:
``project_target_hidden`` (its ``fc`` and SGLang's own ``RMSNorm.forward_native``), against what the
reference computes.

What cannot run here: the decoder layers' forward. Each attention is a ``RadixAttention``, which reads
and writes SGLang's paged KV pool through an attention backend (FlashInfer, Triton, FA3: GPU kernels),
and the context the block attends to is not an input of the model's forward at all: the DFLASH worker
writes the context tokens' K/V into that pool beforehand (``kv_proj_only`` and friends, driven by
``dflash_worker_v2.py``). Stand-ins for those would compute our attention, not SGLang's, so instead
each layer's ``RadixAttention`` records the arguments SGLang builds it with (window, attention type),
and those are compared with the rules the reference drafter computes by (``sglang_rules.dflash``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.verifier import rms_norm
from eagleflow.export.step import ExportConfig, export
from eagleflow.drafters.dflash import layer_attention
from eagleflow.sglang_rules import sglang_rotary
from sglang_dflash_exec import load_into_sglang_dflash, misrouted
from sglang_wheels import get_wheel, pinned_version
from training_data import random_dflash_checkpoint

pytestmark = pytest.mark.sglang_source

AUX = [2, 4, 5]  # eagleflow's ids: SGLang's target_layer_ids [1, 3, 4] of the 8-layer tiny verifier
BLOCK = 4
WINDOW = 16
# Non-default settings, so that SGLang falling back to a default of its own would show: grouped KV heads,
# a rotary base other than get_rope_config's 10000, a window other than speculators' 2048, and one layer
# of each attention kind (speculators' CLI puts every layer on sliding attention unless told otherwise).
LAYER_SETTINGS = {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                  "sliding_window": WINDOW}
FULL_ATTENTION = [1]


@pytest.fixture(scope="module")
def exported(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer DFlash drafter of the tiny verifier (layer 0 sliding, layer 1 full), exported: its SGLang folder."""
    folder = tmp_path_factory.mktemp("dflash")
    checkpoint = random_dflash_checkpoint(
        random_tiny_model, folder / "checkpoint", AUX, block_size=BLOCK, layer_settings=LAYER_SETTINGS,
        full_attention_indices=FULL_ATTENTION,
    )
    manifest = export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=folder / "drafter"))
    assert "path" in manifest["sglang"], f"the export refused the SGLang folder: {manifest['sglang']}"
    return folder / "drafter" / manifest["sglang"]["path"]


class Served:
    """What the pinned wheel's ``DFlashDraftModel`` built from a folder and how its ``load_weights`` took the file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.config: dict[str, Any] = json.loads((folder / "config.json").read_text())
        self.weights = load_file(str(folder / "model.safetensors"))
        (self.model, self.params, self.skipped, loaded, self.loads, self.attentions,
         self.ropes) = load_into_sglang_dflash(get_wheel(pinned_version()), folder, self.weights)
        self.unassigned = [name for name, p in self.params.items() if id(p) not in loaded]

    def misrouted(self) -> list[str]:
        """Each load whose tensor is not the file's tensor of the parameter (and shard) it went to."""
        return misrouted(self.params, self.weights, self.loads)

    def attention_mismatches(self) -> list[str]:
        """Each layer whose ``RadixAttention`` SGLang builds otherwise than :func:`layer_attention` says."""
        ours = layer_attention(self.config, int(self.config["num_hidden_layers"]))
        found = []
        for layer, (record, meant) in enumerate(zip(self.attentions, ours, strict=True)):
            window = None if record["sliding_window_size"] in (-1, None) else record["sliding_window_size"]
            kind = record["attn_type"].name
            assert kind in ("ENCODER_ONLY", "DECODER"), kind
            if ((kind == "ENCODER_ONLY"), window) != (meant.bidirectional, meant.window_left):
                found.append(f"layer {layer}: sglang {kind} window {window}, ours {meant}")
        return found

    def projection(self, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's ``project_target_hidden`` of ``aux`` and the reference's: ``rms_norm(aux @ fc.T) * hidden_norm``."""
        ours = rms_norm(aux @ self.weights["fc.weight"].T, self.weights["hidden_norm.weight"], float(self.config["rms_norm_eps"]))
        with torch.no_grad():
            return self.model.project_target_hidden(aux), ours


@pytest.fixture(scope="module")
def served(exported: Path) -> Served:
    return Served(exported)


def tampered(exported: Path, tmp_path: Path, config: dict[str, Any] | None = None, rename: dict[str, str] | None = None) -> Path:
    """A copy of the exported folder with ``config.json`` replaced and tensors renamed."""
    folder = tmp_path / "sglang"
    shutil.copytree(exported, folder)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    if rename:
        weights = load_file(str(folder / "model.safetensors"))
        save_file({rename.get(k, k): v for k, v in weights.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_the_pinned_wheel_loads_every_exported_tensor_into_every_parameter_it_builds(served: Served) -> None:
    assert served.skipped == [], f"sglang {pinned_version()} silently skips {served.skipped}"
    assert served.unassigned == [], f"sglang {pinned_version()} never assigns {served.unassigned}"
    assert served.misrouted() == []
    assert len(served.loads) == len(served.weights)
    # A fused parameter is assigned once one shard reaches it: each must get all of its shards.
    names = {id(p): name for name, p in served.params.items()}
    shards: dict[str, set[Any]] = {}
    for param, _, shard in served.loads:
        if shard is not None:
            shards.setdefault(names[id(param)], set()).add(shard)
    assert shards == {f"layers.{i}.{fused}.weight": parts for i in range(2)
                      for fused, parts in (("self_attn.qkv_proj", {"q", "k", "v"}), ("mlp.gate_up_proj", {0, 1}))}
    for name, param in served.params.items():  # the ones a real loader filled (fc, the norms) hold the file's values
        if param.numel():
            assert torch.equal(param, served.weights[name]), name


def test_sglang_reads_the_block_context_layers_and_attention_we_meant(served: Served) -> None:
    dflash, model = served.config["dflash_config"], served.model
    assert model.block_size == dflash["block_size"] == BLOCK
    assert model.draft_config.target_layer_ids == dflash["target_layer_ids"] == [k - 1 for k in AUX]
    assert model.draft_config.mask_token_id == dflash["mask_token_id"]
    assert model.num_context_features == len(dflash["target_layer_ids"])
    assert model.fc.in_features == len(AUX) * served.config["hidden_size"]
    assert [(r["layer_id"], r["num_heads"], r["num_kv_heads"], r["head_dim"]) for r in served.attentions] == [
        (i, served.config["num_attention_heads"], 2, served.config["head_dim"]) for i in range(2)]
    ours = layer_attention(served.config, 2)
    assert [(a.bidirectional, a.window_left) for a in ours] == [(False, WINDOW - 1), (True, None)]  # one of each kind
    assert served.attention_mismatches() == []


def test_sglang_builds_the_rotary_the_reference_drafter_computes(served: Served) -> None:
    head_dim = int(served.config["head_dim"])
    rotary = sglang_rotary(served.config, head_dim)
    assert len(served.ropes) == served.config["num_hidden_layers"]
    for rope in served.ropes:
        # get_rope (layers/rotary_embedding/factory.py) narrows rotary_dim by a partial_rotary_factor below 1.
        factor = rope["partial_rotary_factor"]
        rotary_dim = int(rope["rotary_dim"] * factor) if factor < 1.0 else rope["rotary_dim"]
        assert (rope["head_size"], rope["base"], rotary_dim, rope["is_neox_style"]) == (
            head_dim, 50000.0, rotary.rotary_dim, rotary.neox)
        assert (rope["rope_scaling"] or {}).get("rope_type", "default") == "default"
        assert torch.allclose(1.0 / rope["base"] ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim), rotary.inv_freq)


def test_sglang_projects_the_context_as_the_reference_drafter_does(served: Served) -> None:
    """``project_target_hidden`` (SGLang's fc and RMSNorm code) against the formula and the reference drafter's cache.

    The reference drafter writes each context token's keys and values (``add_context``); SGLang writes
    them from ``project_target_hidden`` through ``kv_proj_only`` (the k and v rows of the fused
    ``qkv_proj``, here the file's ``k_proj``/``v_proj``), ``apply_k_norm`` (its own code, its RMSNorm
    holding the loaded ``k_norm``) and the rotary (checked above against ``get_rope``'s arguments).
    """
    from eagleflow.drafters.dflash.reference import DFlashDrafter

    torch.manual_seed(0)
    hidden, vocab, tokens = served.config["hidden_size"], served.config["vocab_size"], 7
    aux = torch.randn(tokens, len(AUX) * hidden)
    sglang, ours = served.projection(aux)
    torch.testing.assert_close(sglang, ours, rtol=1e-5, atol=1e-5)

    drafter = DFlashDrafter(served.folder, torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False), torch.float32)
    cache, positions = drafter.new_cache(), torch.arange(3, 3 + tokens)
    drafter.add_context(aux, positions, cache)
    kv_heads, head_dim = served.config["num_key_value_heads"], served.config["head_dim"]
    for i, layer in enumerate(served.model.layers):
        with torch.no_grad():
            k = layer.self_attn.apply_k_norm(sglang @ served.weights[f"layers.{i}.self_attn.k_proj.weight"].T)
        v = sglang @ served.weights[f"layers.{i}.self_attn.v_proj.weight"].T
        heads = lambda x: x.view(tokens, kv_heads, head_dim).transpose(0, 1)  # noqa: E731
        torch.testing.assert_close(drafter.rotary.apply(heads(k), positions), cache.keys[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(heads(v), cache.values[i], rtol=1e-5, atol=1e-5)


def test_without_layer_types_sglang_serves_every_layer_bidirectional_and_unwindowed(exported: Path, served: Served, tmp_path: Path) -> None:
    config = {k: v for k, v in served.config.items() if k != "layer_types"}
    dropped = Served(tampered(exported, tmp_path, config=config))
    assert [(r["attn_type"].name, r["sliding_window_size"]) for r in dropped.attentions] == [("ENCODER_ONLY", -1)] * 2
    # The check reads the trained layer types: the sliding layer is now served as another function.
    dropped.config = served.config
    assert dropped.attention_mismatches() == [f"layer 0: sglang ENCODER_ONLY window None, ours {layer_attention(served.config, 2)[0]}"]


def test_without_use_sliding_window_sglang_refuses_the_sliding_layer(exported: Path, served: Served, tmp_path: Path) -> None:
    """transformers' Qwen3Config drops ``sliding_window`` unless ``use_sliding_window``: SGLang then has no window."""
    config = {k: v for k, v in served.config.items() if k != "use_sliding_window"}
    with pytest.raises(ValueError, match="sliding_attention layers require config.sliding_window"):
        Served(tampered(exported, tmp_path, config=config))


def test_a_renamed_weight_is_skipped_silently_and_its_parameter_left_unassigned(exported: Path, tmp_path: Path) -> None:
    renamed = Served(tampered(exported, tmp_path, rename={"hidden_norm.weight": "encoder_norm.weight"}))
    assert renamed.skipped == ["encoder_norm.weight"]
    assert renamed.unassigned == ["hidden_norm.weight"]
    renamed.weights["hidden_norm.weight"] = renamed.weights.pop("encoder_norm.weight")  # what we meant it to be
    sglang, ours = renamed.projection(torch.randn(3, len(AUX) * renamed.config["hidden_size"]))
    assert not torch.allclose(sglang, ours, rtol=1e-3, atol=1e-3)  # served with a norm of ones
