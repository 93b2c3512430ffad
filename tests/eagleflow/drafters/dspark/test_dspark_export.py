"""export of DSpark drafters: SGLang's DSPARK folder computes what speculators trained.

The checkpoints are speculators' own ``DSparkDraftModel`` of the random tiny verifier, one per Markov head type
(vanilla, gated, rnn), every saved weight random (``dspark_checkpoints``), at a shape that exercises what SGLang
reads: grouped KV heads, a rotary theta that is not the default, one full and one sliding layer (its window
longer than the sequence, where speculators' and SGLang's windows agree: see DFlash's export test). speculators'
own ``forward`` (every position that can anchor a block is an anchor; the Markov bias from the dataset's
tokens, as it trains) gives the logits and confidence logits it trained; the reference engine reads only the
exported folder, as SGLang's ``DSparkDraftModel`` reads it, and must give the same for the same previous tokens.
Drafting, the Markov chain runs on the draft's own tokens: each block's tokens and logits must be what
speculators' Markov head gives along that chain.

Each setting SGLang reads from the folder is then tampered with, and the served drafter either refuses by name
or stops computing what was trained; and the export refuses, by name, checkpoints SGLang would serve as another
function, leaving an earlier export as it was.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dspark_checkpoints import random_dspark_checkpoint, speculators_chain, speculators_forward
from eagleflow.drafters.dspark import expected_dspark_weights
from eagleflow.drafters.dspark.reference import load_dspark_decoder
from eagleflow.engine.serving_command import serving_engine_command
from eagleflow.engine.sglang_serving import speculative_flags
from eagleflow.errors import UserError
from eagleflow.evaluate.sweep import default_shape
from eagleflow.export import ServedDrafter
from eagleflow.export.step import ExportConfig, export
from training_data import edit_folder, tampered_checkpoint

AUX = [2, 4, 6]
GAMMA = 4
RANK = 16
LENGTH = 24
SHAPE = {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "sliding_window": 64}
HEADS = ("vanilla", "gated", "rnn")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def verifier(random_tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(random_tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("dspark")
    return {
        head: random_dspark_checkpoint(
            random_tiny_model, folder / head, AUX, head, RANK, block_size=GAMMA, layer_settings=SHAPE, full_attention_indices=[0]
        )
        for head in HEADS
    }


@pytest.fixture(scope="module")
def drafters(checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exported")
    for head, checkpoint in checkpoints.items():
        export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=out / head))
    return {head: out / head for head in HEADS}


def sequence(length: int = LENGTH) -> torch.Tensor:
    return torch.randint(5, 1000, (length,), generator=torch.Generator().manual_seed(1))


def served(folder: Path, verifier: Any, ids: torch.Tensor) -> tuple[Any, list[torch.Tensor], Any]:
    """The reference engine's drafter of ``folder`` with the context of ``ids`` written, each anchor's final-norm
    block states ``[γ, H]``, and its cache."""
    decoder = load_dspark_decoder(verifier, folder, None)
    with torch.no_grad(), decoder.capture() as hooks:
        verifier(input_ids=ids[None])
    cache = decoder.drafter.new_cache()
    decoder.drafter.add_context(hooks.aux(), torch.arange(len(ids)), cache)
    gamma = decoder.gamma
    return decoder.drafter, [decoder.drafter.block_hidden(int(ids[a]), a, gamma, cache) for a in range(len(ids) - gamma)], cache


def teacher_forced(folder: Path, verifier: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The served logits ``[anchors, γ, V]`` and confidence logits ``[anchors, γ]`` with each row's previous token
    the dataset's (training's Markov input)."""
    drafter, hidden, _ = served(folder, verifier, ids)
    gamma = len(hidden[0])
    previous = [ids[a : a + gamma].tolist() for a in range(len(hidden))]
    logits = torch.stack([drafter.markov_logits(h, p) for h, p in zip(hidden, previous, strict=True)])
    return logits, torch.stack([drafter.confidence_logits(h, p) for h, p in zip(hidden, previous, strict=True)])


@pytest.mark.parametrize("head", HEADS)
def test_the_served_blocks_are_the_trained_ones(head: str, checkpoints: dict[str, Path], drafters: dict[str, Path], verifier: Any) -> None:
    ids = sequence()
    trained = speculators_forward(checkpoints[head], verifier, ids)
    logits, confidence = teacher_forced(drafters[head] / "sglang", verifier, ids)
    # Every slot drafts, the anchor's included (sample_from_anchor).
    torch.testing.assert_close(logits, trained.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(confidence, trained.confidence, rtol=1e-4, atol=1e-4)
    print(f"{head}: teacher-forced logits max |diff| {(logits - trained.logits).abs().max():.2e}, "
          f"confidence {(confidence - trained.confidence).abs().max():.2e}")
    # Drafting: the chain runs on the draft's own tokens, the anchor first; speculators' head along the same chain.
    drafter, hidden, cache = served(drafters[head] / "sglang", verifier, ids)
    moved, worst = 0, 0.0
    for anchor in range(len(hidden)):
        block = drafter.draft_block(int(ids[anchor]), anchor, GAMMA, cache)
        assert block.previous == [int(ids[anchor]), *block.tokens[:-1]]
        expected = speculators_chain(trained.model, trained.base[anchor], trained.hidden[anchor], block.previous)
        torch.testing.assert_close(block.logits, expected, rtol=1e-4, atol=1e-4)
        assert block.tokens == expected.argmax(-1).tolist()
        moved += block.tokens != trained.base[anchor].argmax(-1).tolist()
        worst = max(worst, float((block.logits - expected).abs().max()))
    print(f"{head}: drafted chains' logits max |diff| {worst:.2e}, {moved} of {len(hidden)} blocks moved by the Markov bias")
    assert moved > len(hidden) // 2, "the Markov bias decides drafted tokens (else this test could not see it computed wrong)"


def test_the_folder_holds_what_sglang_reads_and_moves_with_its_drafter(drafters: dict[str, Path], tmp_path: Path) -> None:
    drafter = drafters["gated"]
    config = json.loads((drafter / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": GAMMA, "target_layer_ids": [1, 3, 5], "mask_token_id": 0, "num_target_layers": 8}
    assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                                   "sample_from_anchor")} == {
        "markov_rank": RANK, "markov_head_type": "gated", "enable_confidence_head": True, "confidence_head_with_markov": True,
        "sample_from_anchor": True,
    }
    assert config["tie_word_embeddings"] is False and "transformer_layer_config" not in config
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    weights = load_file(str(drafter / "sglang" / "model.safetensors"))
    expected = expected_dspark_weights(config)
    assert sorted(weights) == sorted(name for name, e in expected.items() if e.shape is not None)  # nothing missing, nothing dropped
    assert all(list(weights[name].shape) == list(expected[name].shape) for name in weights)
    assert "markov_head.gate_proj.weight" in weights and "markov_head.joint_proj.weight" not in weights
    manifest = json.loads((drafter / "export.json").read_text())["sglang"]
    assert {k: manifest[k] for k in ("algorithm", "target_layer_ids", "captures_layers", "block_size", "dspark_block_size", "num_steps")} == {
        "algorithm": "DSPARK", "target_layer_ids": [1, 3, 5], "captures_layers": AUX, "block_size": GAMMA + 1,
        "dspark_block_size": GAMMA, "num_steps": GAMMA,
    }
    moved = tmp_path / "elsewhere"
    shutil.copytree(drafter, moved)
    served_drafter = ServedDrafter.from_export(moved)
    # What an engine serves: the verify window (the bonus token and γ drafts), as SGLang's --speculative-num-draft-tokens.
    assert (served_drafter.path, served_drafter.algorithm, served_drafter.block_size) == (moved / "sglang", "DSPARK", GAMMA + 1)
    assert speculative_flags(served_drafter)[2:] == [
        "--speculative-draft-model-path", str(moved / "sglang"), "--speculative-dspark-block-size", str(GAMMA),
        "--speculative-num-draft-tokens", str(GAMMA + 1),
    ]
    argv, _ = serving_engine_command("reference", moved, 30000, served_drafter)
    assert {"--speculative-algorithm=DSPARK", f"--speculative-num-draft-tokens={GAMMA + 1}"} <= set(argv)
    assert default_shape("DSPARK", served_drafter.num_steps, served_drafter.block_size) == (1, 1, GAMMA + 1)  # the sweep's default


def _edit_config(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda folder: edit_folder(folder, config=edit)


def _edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    return lambda folder: edit_folder(folder, weights=edit)


def _swap(a: str, b: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(weights: dict[str, torch.Tensor]) -> None:
        weights[a], weights[b] = weights[b], weights[a]

    return edit


W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
# Each setting SGLang reads from the folder, tampered with (the gated drafter's): None when the served drafter computes
# another function without a word (as SGLang would), else the words of its refusal (where SGLang refuses too).
TAMPERED: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "Markov weights swapped": (_edit_weights(_swap(W1, W2)), None),
    "markov_w1 transposed": (_edit_weights(lambda w: w.update({W1: w[W1].T})), rf"{W1} is \[{RANK}, 1024\], not \[1024, {RANK}\]"),
    "markov_rank changed": (_edit_config(lambda c: c.update(markov_rank=8)), rf"{W1} is \[1024, {RANK}\], not \[1024, 8\]"),
    "markov_rank dropped": (_edit_config(lambda c: c.pop("markov_rank")), "markov_rank 0: SGLang's DSPARK requires a Markov head"),
    "markov_head_type dropped": (_edit_config(lambda c: c.pop("markov_head_type")), "no markov_head_type"),
    "markov_head_type changed": (_edit_config(lambda c: c.update(markov_head_type="vanilla")),
                                 r"holds markov_head.gate_proj.weight \[16, 80\], which its config.json does not build"),
    "gate_proj's bias dropped": (_edit_weights(lambda w: w.pop("markov_head.gate_proj.bias")), "no markov_head.gate_proj.bias"),
    "confidence head dropped": (_edit_weights(lambda w: [w.pop(k) for k in ("confidence_head.proj.weight", "confidence_head.proj.bias")]),
                                r"no confidence_head.proj.weight, which its config.json makes \[1, 80\]"),
    "confidence_head_with_markov switched off": (_edit_config(lambda c: c.update(confidence_head_with_markov=False)),
                                                 r"confidence_head.proj.weight is \[1, 80\], not \[1, 64\]"),
    "sample_from_anchor switched off": (_edit_config(lambda c: c.update(sample_from_anchor=False)), "sample_from_anchor False"),
    "target_layer_ids off by one": (_edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[2, 4, 6])), None),
    "mask_token_id changed": (_edit_config(lambda c: c["dflash_config"].update(mask_token_id=3)), None),
    "a bundled draft's key": (_edit_config(lambda c: c.update(dspark_markov_rank=RANK)), "dspark_markov_rank: a bundled DSpark draft"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_each_setting_sglang_reads_is_checked(
    case: str, checkpoints: dict[str, Path], drafters: dict[str, Path], verifier: Any, tmp_path: Path
) -> None:
    tamper, refusal = TAMPERED[case]
    folder = tmp_path / "sglang"
    shutil.copytree(drafters["gated"] / "sglang", folder)
    tamper(folder)
    ids = sequence(16)
    if refusal is not None:
        with pytest.raises(UserError, match=refusal):
            teacher_forced(folder, verifier, ids)
        return
    expected = speculators_forward(checkpoints["gated"], verifier, ids).logits
    got, _ = teacher_forced(folder, verifier, ids)
    assert (got - expected).abs().max() > 1e-2  # the parity test above would catch it


def _checkpoint_edit(config: dict[str, Any] | None = None, weights: Callable[[dict], None] | None = None):
    def make(checkpoint: Path, folder: Path) -> Path:
        return tampered_checkpoint(checkpoint, folder, config, weights)

    return make


def _drop(prefix: str | tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(weights: dict[str, Any]) -> None:
        for name in [n for n in weights if n.startswith(prefix)]:
            del weights[name]

    return edit


# Checkpoints SGLang would serve as another function, or not at all, and the words of the export's refusal.
REFUSED = {
    "sample_from_anchor False": (_checkpoint_edit({"sample_from_anchor": False}), "trained with sample_from_anchor False"),
    "no Markov head": (_checkpoint_edit({"markov_rank": 0, "enable_confidence_head": False}, _drop(("markov_head.", "confidence_head."))),
                       "markov_rank 0: SGLang's DSPARK requires the Markov head"),
    "no confidence head": (_checkpoint_edit({"enable_confidence_head": False}, _drop("confidence_head.")),
                           "trained without the confidence head"),
    "a Markov head SGLang does not serve": (_checkpoint_edit({"markov_head_type": "lstm"}), "markov_head_type 'lstm'"),
    # The backbone's rules are DFlash's, and hold for DSpark too.
    "aux id 0": (_checkpoint_edit({"aux_hidden_state_layer_ids": [0, 4, 6]}), "aux layer id 0"),
    "a reduced vocabulary": (_checkpoint_edit(weights=lambda w: w.update(d2t=torch.zeros(1024, dtype=torch.long))),
                             r"reduced draft vocabulary \(d2t\)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_export_refuses_what_sglang_would_serve_otherwise(
    case: str, checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path: Path
) -> None:
    make, words = REFUSED[case]
    out = tmp_path / "drafter"
    export(ExportConfig(checkpoint=checkpoints["vanilla"], verifier=random_tiny_model, out=out))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = make(checkpoints["vanilla"], tmp_path / "bad")
    with pytest.raises(UserError, match=f"cannot be served by SGLang: .*{words}"):
        export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=out))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # For vLLM the speculators folder is written and the refusal recorded.
    manifest = export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=tmp_path / "vllm", serve_with="vllm"))
    assert "path" not in manifest["sglang"] and manifest["sglang"]["refused"]


def test_a_checkpoint_whose_heads_are_not_its_configs_is_damaged(checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path: Path) -> None:
    """speculators saves what its config builds: an rnn head's joint_proj in a gated checkpoint is damage, named."""
    out = tmp_path / "drafter"
    export(ExportConfig(checkpoint=checkpoints["gated"], verifier=random_tiny_model, out=out))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = tampered_checkpoint(checkpoints["gated"], tmp_path / "bad", {"markov_head_type": "rnn"})
    for serve_with in ("sglang", "vllm"):
        with pytest.raises(UserError, match=r"holds markov_head.gate_proj.weight \[16, 80\].*no markov_head.joint_proj.weight"):
            export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=out, serve_with=serve_with))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.glob(".drafter*")), "no staging folder is left behind"
