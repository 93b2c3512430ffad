"""export of DFlash block drafters: SGLang's DFLASH folder computes what speculators trained.

The checkpoint is speculators' own ``DFlashDraftModel`` of the random tiny verifier (every saved weight
random), at a shape that exercises what SGLang reads: three layers mixing full and sliding attention,
GQA, a rotary theta that is not the default. speculators' own ``_backbone_forward`` (every position
that can anchor a block is an anchor) gives the block logits it trained; the reference engine reads only
the exported folder, as SGLang's ``DFlashDraftModel`` reads it, and must give the same at the draft
slots 1 .. B − 1. The aux states are the verifier's own, captured as the served drafter captures them
(the exported ``target_layer_ids``), so the capture's alignment is checked too.

The sliding window is longer than the sequence: SGLang counts ``sliding_window − 1`` keys left of each
query while speculators keeps ``sliding_window`` context tokens before the anchor for the whole block,
the same function only while the window covers the context.

Each setting SGLang reads from the folder is then tampered with, and the served drafter either refuses
by name or stops computing what was trained; and the export refuses, by name, checkpoints SGLang would
serve as another function, leaving an earlier export as it was.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.engine.capture import AuxStateCapture
from eagleflow.drafters.dflash.reference import load_dflash_decoder
from eagleflow.errors import UserError
from eagleflow.drafters.dflash import expected_dflash_weights
from eagleflow.export import ServedDrafter
from eagleflow.export.step import ExportConfig, export

from training_data import random_dflash_checkpoint

AUX = [2, 4, 6]
BLOCK = 4
LENGTH = 24
SHAPE = {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "sliding_window": 64}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def verifier(random_tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(random_tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoint(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dflash") / "checkpoint"
    return random_dflash_checkpoint(
        random_tiny_model, folder, AUX, block_size=BLOCK, num_layers=3, layer_settings=SHAPE, full_attention_indices=[0]
    )


@pytest.fixture(scope="module")
def drafter(checkpoint: Path, random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "drafter"
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out))
    return out


def sequence(length: int = LENGTH) -> torch.Tensor:
    return torch.randint(5, 1000, (length,), generator=torch.Generator().manual_seed(1))


def speculators_blocks(checkpoint: Path, verifier: Any, ids: torch.Tensor, attn: str = "sdpa") -> torch.Tensor:
    """speculators' block logits ``[anchors, B, V]`` with every position ``< T − B`` an anchor, over the verifier's
    aux states of ``ids`` at the trained layer ids."""
    from speculators.models.dflash import DFlashDraftModel

    config = DFlashDraftModel.config_class.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = attn
    model = DFlashDraftModel.from_pretrained(str(checkpoint), config=config).float().eval()
    with torch.no_grad(), AuxStateCapture(verifier, config.aux_hidden_state_layer_ids) as hooks:
        verifier(input_ids=ids[None])
    aux = hooks.aux()  # the states entering the trained layers, in the verifier's dtype (float32)
    anchors, length = len(ids) - model.block_size, len(ids)
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            aux[None], ids[None], torch.ones(1, length), torch.zeros(1, length, 64), torch.zeros(1, length, dtype=torch.long),
            max_anchors=anchors,
        )
    return logits[0].view(anchors, model.block_size, -1)


def served_blocks(folder: Path, verifier: Any, ids: torch.Tensor) -> torch.Tensor:
    """The reference engine's block logits ``[anchors, B, V]``: the exported folder, the verifier's embedding and
    head, the aux states the served drafter captures from the verifier."""
    decoder = load_dflash_decoder(verifier, folder, None)
    with torch.no_grad(), decoder.capture() as hooks:
        verifier(input_ids=ids[None])
    aux = hooks.aux()
    cache = decoder.drafter.new_cache()
    decoder.drafter.add_context(aux, torch.arange(len(ids)), cache)
    block = decoder.block_size
    return torch.stack([decoder.drafter.block_logits(int(ids[a]), a, block, cache) for a in range(len(ids) - block)])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_served_blocks_are_the_trained_ones(checkpoint: Path, drafter: Path, verifier: Any, attn: str) -> None:
    ids = sequence()
    expected = speculators_blocks(checkpoint, verifier, ids, attn)
    got = served_blocks(drafter / "sglang", verifier, ids)
    # Slot 0 (the bonus token) is never trained nor drafted from.
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[:, 1:].argmax(-1), expected[:, 1:].argmax(-1))


def test_attention_biases_are_served_as_trained(random_tiny_model: Path, verifier: Any, tmp_path: Path) -> None:
    """q/k/v/o biases (``attention_bias``): SGLang builds them into qkv_proj and o_proj, and the context's k/v use them too."""
    checkpoint = random_dflash_checkpoint(
        random_tiny_model, tmp_path / "checkpoint", AUX, block_size=3, layer_settings={**SHAPE, "attention_bias": True},
        full_attention_indices=[1],
    )
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=tmp_path / "drafter"))
    assert "layers.0.self_attn.v_proj.bias" in load_file(str(tmp_path / "drafter" / "sglang" / "model.safetensors"))
    ids = sequence()
    expected, got = speculators_blocks(checkpoint, verifier, ids), served_blocks(tmp_path / "drafter" / "sglang", verifier, ids)
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=1e-4, atol=1e-4)


def test_the_folder_holds_what_sglang_reads_and_moves_with_its_drafter(drafter: Path, tmp_path: Path) -> None:
    config = json.loads((drafter / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    read = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "num_hidden_layers", "attention_bias",
            "layer_types", "sliding_window", "vocab_size")
    assert [key for key in read if key not in config] == []
    assert (config["num_key_value_heads"], config["rope_parameters"]["rope_theta"]) == (2, 50000.0)
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config["dflash_config"] == {"block_size": BLOCK, "target_layer_ids": [1, 3, 5], "mask_token_id": 0, "num_target_layers": 8}
    assert config["tie_word_embeddings"] is False and "transformer_layer_config" not in config
    weights = load_file(str(drafter / "sglang" / "model.safetensors"))
    assert sorted(weights) == sorted(expected_dflash_weights(config))  # nothing missing, nothing SGLang would drop
    manifest = json.loads((drafter / "export.json").read_text())["sglang"]
    assert {k: manifest[k] for k in ("path", "algorithm", "target_layer_ids", "captures_layers", "block_size", "num_steps")} == {
        "path": "sglang", "algorithm": "DFLASH", "target_layer_ids": [1, 3, 5], "captures_layers": AUX, "block_size": BLOCK,
        "num_steps": BLOCK - 1,
    }
    assert (manifest["minimum_sglang"], manifest["draft_window_size"], manifest["mask_token_id"]) == ("0.5.23", None, 0)
    moved = tmp_path / "elsewhere"
    shutil.copytree(drafter, moved)
    served = ServedDrafter.from_export(moved)
    assert (served.path, served.algorithm, served.block_size, served.num_steps) == (moved / "sglang", "DFLASH", BLOCK, BLOCK - 1)
    # Manifests written before DFlash carry neither: they are EAGLE-3's.
    old = json.loads((moved / "export.json").read_text())
    for key in ("algorithm", "block_size"):
        del old["sglang"][key]
    (moved / "export.json").write_text(json.dumps(old))
    assert (ServedDrafter.from_export(moved).algorithm, ServedDrafter.from_export(moved).block_size) == ("EAGLE3", None)


def _edit_config(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))

    return tamper


def _rename_weight(old: str, new: str) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        weights = load_file(str(folder / "model.safetensors"))
        weights[new] = weights.pop(old)
        save_file(weights, str(folder / "model.safetensors"))

    return tamper


def _drop(*keys: str) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        for key in keys:
            config.pop(key, None)

    return edit


# Each setting SGLang reads from the folder, tampered with: None when the served drafter computes another
# function without a word (as SGLang would), else the words of its refusal.
TAMPERED: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "target_layer_ids off by one": (_edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[2, 4, 6])), None),
    "layer_types dropped": (_edit_config(_drop("layer_types")), None),
    "rope settings dropped": (_edit_config(_drop("rope_parameters", "rope_theta")), None),
    "mask_token_id changed": (_edit_config(lambda c: c["dflash_config"].update(mask_token_id=3)), None),
    "hidden_norm renamed": (_rename_weight("hidden_norm.weight", "encoder_norm.weight"), "no hidden_norm.weight"),
    "k_norm renamed": (_rename_weight("layers.1.self_attn.k_norm.weight", "layers.1.self_attn.key_norm.weight"),
                       "no layers.1.self_attn.k_norm.weight"),
    "use_sliding_window switched off": (_edit_config(lambda c: c.update(use_sliding_window=False)),
                                        "sliding_attention layers need sliding_window"),
    "attention_bias switched on": (_edit_config(lambda c: c.update(attention_bias=True)), "self_attn.q_proj.bias"),
    "target_layer_ids dropped": (_edit_config(lambda c: c["dflash_config"].pop("target_layer_ids")), "no dflash_config.target_layer_ids"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_each_setting_sglang_reads_is_checked(
    case: str, checkpoint: Path, drafter: Path, verifier: Any, tmp_path: Path
) -> None:
    tamper, refusal = TAMPERED[case]
    folder = tmp_path / "sglang"
    shutil.copytree(drafter / "sglang", folder)
    tamper(folder)
    ids = sequence(16)
    if refusal is not None:
        with pytest.raises(UserError, match=refusal):
            served_blocks(folder, verifier, ids)
        return
    expected = speculators_blocks(checkpoint, verifier, ids)
    got = served_blocks(folder, verifier, ids)
    assert (got[:, 1:] - expected[:, 1:]).abs().max() > 1e-2  # the parity test above would catch it


def _checkpoint_edit(config_edit: Callable[[dict[str, Any]], None] | None = None, weights_edit: Callable[[dict], None] | None = None):
    def make(checkpoint: Path, folder: Path) -> Path:
        shutil.copytree(checkpoint, folder)
        if config_edit is not None:
            _edit_config(config_edit)(folder)
        if weights_edit is not None:
            weights = load_file(str(folder / "model.safetensors"))
            weights_edit(weights)
            save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    return make


def _reduced_vocabulary(weights: dict[str, Any]) -> None:
    """What speculators saves for a 256-token draft vocabulary: its head and both maps."""
    weights.update({"lm_head.weight": torch.randn(256, 64), "d2t": torch.zeros(256, dtype=torch.long), "t2d": torch.zeros(1024, dtype=torch.bool)})


# Checkpoints SGLang would serve as another function, and the words of the export's refusal.
REFUSED = {
    "reduced vocabulary": (_checkpoint_edit(lambda c: c.update(draft_vocab_size=256), _reduced_vocabulary), "reduced draft vocabulary"),
    "a vocabulary mapping": (_checkpoint_edit(weights_edit=lambda w: w.update(d2t=torch.zeros(1024, dtype=torch.long))),
                             r"reduced draft vocabulary \(d2t\)"),
    "aux id 0": (_checkpoint_edit(lambda c: c.update(aux_hidden_state_layer_ids=[0, 4, 6])), "aux layer id 0"),
    "aux id n": (_checkpoint_edit(lambda c: c.update(aux_hidden_state_layer_ids=[2, 4, 8])), "aux layer id 8 is the final"),
    "aux ids out of order": (_checkpoint_edit(lambda c: c.update(aux_hidden_state_layer_ids=[4, 2, 6])), "not in increasing order"),
    "a block of one": (_checkpoint_edit(lambda c: c.update(block_size=1)), "block_size 1: a block holds the bonus token"),
    "sample_from_anchor": (_checkpoint_edit(lambda c: c.update(sample_from_anchor=True)), "sample_from_anchor True"),
    "non-causal sliding": (_checkpoint_edit(lambda c: c.update(sliding_window_non_causal=True)), r"sliding_window_non_causal True.*\[1, 2\]"),
    "another activation": (_checkpoint_edit(lambda c: c["transformer_layer_config"].update(hidden_act="gelu")), "hidden_act 'gelu'"),
    "no mask token": (_checkpoint_edit(lambda c: c.update(mask_token_id=None)), "no mask_token_id"),
    "mask token beyond the vocabulary": (_checkpoint_edit(lambda c: c.update(mask_token_id=1024)), "mask token id 1024 is not below"),
    "a rotary SGLang computes otherwise": (
        _checkpoint_edit(lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_type": "dynamic", "rope_theta": 50000.0, "factor": 2.0})),
        "rotary settings",
    ),
}
# A missing or unknown weight, or one of another shape, is damage for every engine, not SGLang's
# refusal: test_export_self_checks.py.


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_export_refuses_what_sglang_would_serve_otherwise(
    case: str, checkpoint: Path, random_tiny_model: Path, tmp_path: Path
) -> None:
    make, words = REFUSED[case]
    out = tmp_path / "drafter"
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = make(checkpoint, tmp_path / "bad")
    with pytest.raises(UserError, match=f"cannot be served by SGLang: .*{words}"):
        export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=out))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.glob(".drafter*")), "no staging folder is left behind"
    # For vLLM the speculators folder is written and the refusal recorded.
    manifest = export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=tmp_path / "vllm", serve_with="vllm"))
    assert "path" not in manifest["sglang"] and manifest["sglang"]["refused"]
    assert (tmp_path / "vllm" / "speculators" / "model.safetensors").is_file() and not (tmp_path / "vllm" / "sglang").exists()


def test_a_family_eagleflow_does_not_export_is_refused_by_its_reason(checkpoint: Path, random_tiny_model: Path, tmp_path: Path) -> None:
    bad = _checkpoint_edit(lambda c: c.update(speculators_model_type="dflash2"))(checkpoint, tmp_path / "dflash2")
    with pytest.raises(UserError, match="DFlash2's training objective is unpublished"):
        export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=tmp_path / "drafter"))


def test_a_dflash_checkpoint_without_its_block_size_is_damaged(checkpoint: Path, random_tiny_model: Path, tmp_path: Path) -> None:
    bad = _checkpoint_edit(_drop("block_size"))(checkpoint, tmp_path / "torn")
    with pytest.raises(UserError, match=r"config.json: no block_size \(the tokens of one draft block\)"):
        export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=tmp_path / "drafter"))


def test_a_block_size_that_is_not_the_trained_one_is_refused_and_the_good_export_stays(
    checkpoint: Path, drafter: Path, random_tiny_model: Path, tmp_path: Path
) -> None:
    """A checkpoint's config.json edited to another block size than its training ran with (the train step's record
    says which) is refused by name, whatever --serve-with says; the export already in --out is kept as it was."""
    train = tmp_path / "train"
    epoch = _checkpoint_edit(lambda c: c.update(block_size=4096))(checkpoint, train / "checkpoints" / "0")
    (train / ".made-from.json").write_text(json.dumps({"inputs": {"settings": {"block_size": BLOCK}}}))
    out = tmp_path / "drafter"
    shutil.copytree(drafter, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for serve_with in ("sglang", "vllm"):
        with pytest.raises(UserError, match=rf"config.json: block_size 4096 is not the block size its weights were trained with \({BLOCK}, recorded"):
            export(ExportConfig(checkpoint=epoch, verifier=random_tiny_model, out=out, serve_with=serve_with))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # The block size it was trained with exports as before.
    _edit_config(lambda c: c.update(block_size=BLOCK))(epoch)
    export(ExportConfig(checkpoint=epoch, verifier=random_tiny_model, out=tmp_path / "again"))
    assert json.loads((tmp_path / "again" / "sglang" / "config.json").read_text())["dflash_config"]["block_size"] == BLOCK
