"""export checks a checkpoint against itself before it writes anything (issue 48).

Each checkpoint here is real (speculators' own EAGLE-3 or DFlash draft of the random tiny verifier)
and then made to disagree with itself, as a hand-edited config or a damaged copy would: a config
naming 4 aux layers over an ``fc`` trained for 3, eagle3.1 weights under an eagle3 config and the
reverse, an ``fc`` or a ``q_proj`` cut short, a tensor gone or one no config builds. Every engine
would load each and serve another function without a word, so the export refuses each whatever
``--serve-with`` says, naming the file, the tensor, both shapes and the config keys, and an earlier
export stays exactly as it was, with no staging folder beside it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleflow.errors import UserError
from eagleflow.export.step import ExportConfig, export

from training_data import folder_snapshot, random_dflash_checkpoint, random_speculators_checkpoint, staging_leftovers, tampered_checkpoint

AUX = [2, 4, 5]
DFLASH_AUX = [2, 4, 6]
EAGLE3 = {"norm_before_fc": True, "fc_norm": False, "norm_output": True}  # speculators 0.9.0's defaults
EAGLE31 = {"norm_before_fc": False, "fc_norm": True, "norm_output": True}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    return {
        "eagle3": random_speculators_checkpoint(random_tiny_model, folder / "eagle3", False, AUX, 256, draft_flags=EAGLE3),
        "eagle3.1": random_speculators_checkpoint(random_tiny_model, folder / "eagle31", False, AUX, 256, draft_flags=EAGLE31),
        "dflash": random_dflash_checkpoint(random_tiny_model, folder / "dflash", DFLASH_AUX),
    }


def _cut(name: str, rows: int | None = None, columns: int | None = None) -> Callable[[dict[str, Any]], None]:
    def edit(weights: dict[str, Any]) -> None:
        weights[name] = weights[name][:rows, :columns].clone()

    return edit


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda weights: weights.pop(name)


# case -> (checkpoint, config keys set, weights edit, the words of the refusal (a regex)).
DISAGREEING: dict[str, tuple[str, dict[str, Any] | None, Callable[[dict[str, Any]], None] | None, str]] = {
    "4 aux layers over an fc of 3": (
        "eagle3", {"eagle_aux_hidden_state_layer_ids": [2, 3, 4, 5]}, None,
        r"fc\.weight is \[64, 192\], not \[64, 256\] \(config\.json: eagle_aux_hidden_state_layer_ids \[2, 3, 4, 5\]: "
        r"4 aux layers × hidden_size 64\)",
    ),
    "eagle3.1 weights under an eagle3 config": (
        "eagle3.1", {"norm_before_fc": True, "fc_norm": False}, None,
        r"no input_norm\.weight, which config\.json makes \[192\] \(norm_before_fc true, .*; holds fc_norm\.0\.weight, fc_norm\.1\.weight, fc_norm\.2\.weight \[64\], "
        r"which config\.json does not build \(fc_norm false",
    ),
    "eagle3 weights under an eagle3.1 config": (
        "eagle3", {"norm_before_fc": False, "fc_norm": True}, None,
        r"holds input_norm\.weight \[192\], which config\.json does not build \(norm_before_fc false.*; "
        r"no fc_norm\.0\.weight, fc_norm\.1\.weight, fc_norm\.2\.weight, which config\.json makes \[64\] \(fc_norm true",
    ),
    "an fc cut to 2 of 3 aux layers": (
        "eagle3", None, _cut("fc.weight", columns=128),
        r"fc\.weight is \[64, 128\], not \[64, 192\] \(config\.json: eagle_aux_hidden_state_layer_ids \[2, 4, 5\]: 3 aux layers",
    ),
    "a first-layer q_proj without the embedding half": (
        "eagle3", None, _cut("layers.0.self_attn.q_proj.weight", columns=64),
        r"layers\.0\.self_attn\.q_proj\.weight is \[64, 64\], not \[64, 128\] \(config\.json: num_attention_heads 4 × head_dim 16, "
        r"2 × hidden_size 64",
    ),
    "a reduced vocabulary without its d2t": (
        "eagle3", None, _drop("d2t"), r"no d2t, which config\.json makes \[256\] \(draft_vocab_size 256 of vocab_size 1024\)",
    ),
    "dflash: an fc cut to 2 of 3 aux layers": (
        "dflash", None, _cut("fc.weight", columns=128),
        r"fc\.weight is \[64, 128\], not \[64, 192\] \(config\.json: aux_hidden_state_layer_ids \[2, 4, 6\]: 3 aux layers",
    ),
    "dflash: a q_proj of half the heads": (
        "dflash", None, _cut("layers.1.self_attn.q_proj.weight", rows=32),
        r"layers\.1\.self_attn\.q_proj\.weight is \[32, 64\], not \[64, 64\] \(config\.json: num_attention_heads 4 × head_dim 16",
    ),
    "dflash: a missing weight": (
        "dflash", None, _drop("layers.1.mlp.up_proj.weight"),
        r"no layers\.1\.mlp\.up_proj\.weight, which config\.json makes \[128, 64\] \(intermediate_size 128, hidden_size 64\)",
    ),
    "dflash: a weight no config builds": (
        "dflash", None, lambda w: w.update({"layers.0.extra.weight": torch.ones(4)}),
        r"holds layers\.0\.extra\.weight \[4\], which nothing in config\.json builds",
    ),
}


@pytest.mark.parametrize("case", list(DISAGREEING))
def test_a_checkpoint_that_disagrees_with_itself_is_refused_for_every_engine(
    case: str, checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path: Path
) -> None:
    family, config, weights, words = DISAGREEING[case]
    out = tmp_path / "run" / "drafter"
    export(ExportConfig(checkpoint=checkpoints[family], verifier=random_tiny_model, out=out))
    before = folder_snapshot(out)
    bad = tampered_checkpoint(checkpoints[family], tmp_path / "bad", config, weights)
    for engine in ("sglang", "vllm"):
        with pytest.raises(UserError) as caught:
            export(ExportConfig(checkpoint=bad, verifier=random_tiny_model, out=out, serve_with=engine))
        message = str(caught.value)
        assert message.startswith(f"{bad / 'model.safetensors'}: "), message
        assert re.search(words, message), message
        assert "its config and weights disagree" in message and "whatever --serve-with says" in message
        assert folder_snapshot(out) == before, engine
        assert staging_leftovers(out) == [], engine


@pytest.mark.parametrize(
    ("family", "config", "weights", "engine", "words"),
    [
        ("eagle3", {"eagle_aux_hidden_state_layer_ids": [2, 3, 4, 5]}, None, "vllm", "fc.weight is [64, 192], not [64, 256]"),
        ("dflash", None, _cut("fc.weight", columns=128), "sglang", "fc.weight is [64, 128], not [64, 192]"),
    ],
    ids=["eagle3 4 aux ids, serve_with vllm", "dflash fc of 2 aux layers, serve_with sglang"],
)
def test_the_refusal_is_exit_2_with_one_message_and_no_traceback(
    family: str, config: dict[str, Any] | None, weights: Any, engine: str, words: str,
    checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "drafter"
    export(ExportConfig(checkpoint=checkpoints[family], verifier=random_tiny_model, out=out))
    before = folder_snapshot(out)
    bad = tampered_checkpoint(checkpoints[family], tmp_path / "bad", config, weights)
    proc = subprocess.run(
        [sys.executable, "-m", "eagleflow", "export", "--checkpoint", str(bad), "--verifier", str(random_tiny_model),
         "--out", str(out), "--serve-with", engine], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"{bad / 'model.safetensors'}: {words}" in proc.stderr, proc.stderr[-2000:]
    assert folder_snapshot(out) == before and staging_leftovers(out) == []


def test_a_config_speculators_would_not_build_is_refused_naming_it(
    checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path: Path
) -> None:
    both = tampered_checkpoint(checkpoints["eagle3"], tmp_path / "both", {"norm_before_fc": True, "fc_norm": True})
    with pytest.raises(UserError, match=r"config\.json: unusable draft config \(ValueError: norm_before_fc and fc_norm are both true"):
        export(ExportConfig(checkpoint=both, verifier=random_tiny_model, out=tmp_path / "drafter", serve_with="vllm"))
    assert not (tmp_path / "drafter").exists() and staging_leftovers(tmp_path / "drafter") == []


def test_checkpoints_that_agree_with_themselves_still_export(checkpoints: dict[str, Path], random_tiny_model: Path, tmp_path: Path) -> None:
    """Each variant and family as speculators saves it, and a full-vocabulary EAGLE-3 (no d2t, t2d)."""
    for name, checkpoint in checkpoints.items():
        manifest = export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=tmp_path / name))
        assert manifest["sglang"]["path"] == "sglang", name
    identity = (torch.zeros(1024, dtype=torch.long), torch.ones(1024, dtype=torch.bool))
    full = random_speculators_checkpoint(random_tiny_model, tmp_path / "full", False, AUX, 1024, vocab_mapping=identity)
    manifest = export(ExportConfig(checkpoint=full, verifier=random_tiny_model, out=tmp_path / "full-drafter"))
    assert "d2t" not in manifest["sglang"]["weights"] and manifest["sglang"]["path"] == "sglang"
