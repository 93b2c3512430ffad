"""export: speculators checkpoints -> SGLang's drafter folder, computed as speculators trained it.

The checkpoints are speculators' own ``Eagle3DraftModel`` for the tiny verifier, two draft layers
so the later-layer norm is exercised, every weight randomised (a norm left at its initial ones
would hide a mix-up), saved with ``save_pretrained``. The comparison feeds both models the same
token ids and aux states: speculators' forward (its logits taken from its ``lm_head``) against
the reference engine's drafter reading only the exported folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagleflow.drafters.eagle3.draft_model import Eagle3Drafter
from eagleflow.errors import UserError
from eagleflow.drafters.eagle3 import sglang_export as sglang_drafter
from eagleflow.drafters.eagle3.sglang_export import NotServable, captured_layer_ids, sglang_aux_layer_ids, sglang_weights
from eagleflow.drafters.eagle3 import export_eagle3_sglang as export_sglang
from eagleflow.export.step import ExportConfig, export
from eagleflow.export.manifest import ServedDrafter

from training_data import random_speculators_checkpoint

AUX = [2, 4, 5]
DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def checkpoints(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    return {
        flag: random_speculators_checkpoint(random_tiny_model, folder / f"nbr-{flag}", flag, AUX, DRAFT_VOCAB)
        for flag in (False, True)
    }


def speculators_logits(checkpoint: Path, input_ids: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module]:
    """TTT step 0 of speculators' own forward, its draft-vocabulary logits, and its embedding."""
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(str(checkpoint), config=config).float().eval()
    seen: dict[str, torch.Tensor] = {}
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.setdefault("logits", out))
    with torch.no_grad():
        model(hidden_states=aux[None], input_ids=input_ids[None], document_ids=torch.zeros_like(input_ids)[None], ttt_steps=1)
    hook.remove()
    return seen["logits"][0].float(), model.embed_tokens


def reference_logits(folder: Path, embed: torch.nn.Module, input_ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    drafter = Eagle3Drafter(folder, embed, torch.float32)
    drafter.window = ServedDrafter.from_export(folder.parent).window
    with torch.no_grad():
        logits, _ = drafter.forward(input_ids, aux, torch.arange(len(input_ids)), drafter.new_cache())
    return logits


def inputs(hidden: int, length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(5, 1000, (length,), generator=generator), torch.randn(length, len(AUX) * hidden, generator=generator)


def test_the_exported_drafter_computes_what_speculators_trained(checkpoints, random_tiny_model: Path, tmp_path: Path) -> None:
    manifest = export(ExportConfig(checkpoint=checkpoints[False], verifier=random_tiny_model, out=tmp_path / "drafter"))
    assert manifest["sglang"]["path"] == "sglang"  # relative to the drafter folder
    assert ServedDrafter.from_export(tmp_path / "drafter").path == tmp_path / "drafter" / "sglang"
    ids, aux = inputs(64)
    expected, embed = speculators_logits(checkpoints[False], ids, aux)
    got = reference_logits(tmp_path / "drafter" / "sglang", embed, ids, aux)
    assert got.shape == (len(ids), DRAFT_VOCAB)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_norm_before_residual_true_is_refused_and_would_be_another_function(
    checkpoints, random_tiny_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="norm_before_residual True: SGLang's draft layer keeps the pre-norm"):
        export(ExportConfig(checkpoint=checkpoints[True], verifier=random_tiny_model, out=tmp_path / "sglang-run"))
    assert not (tmp_path / "sglang-run" / "sglang").exists()
    # For vLLM the speculators folder is written and the refusal recorded.
    manifest = export(ExportConfig(checkpoint=checkpoints[True], verifier=random_tiny_model, out=tmp_path / "d", serve_with="vllm"))
    assert "norm_before_residual" in manifest["sglang"]["refused"]
    assert (tmp_path / "d" / "speculators" / "model.safetensors").is_file() and not (tmp_path / "d" / "sglang").exists()
    # What a naive export would serve: the same weights read as SGLang reads them compute something else.
    naive = tmp_path / "naive"
    shutil.copytree(checkpoints[True], naive)
    config = json.loads((naive / "config.json").read_text())
    (naive / "config.json").write_text(json.dumps({**config, "norm_before_residual": False}))
    export_sglang(naive, random_tiny_model, tmp_path / "naive-drafter" / "sglang")
    ids, aux = inputs(64)
    expected, embed = speculators_logits(checkpoints[True], ids, aux)
    drafter = Eagle3Drafter(tmp_path / "naive-drafter" / "sglang", embed, torch.float32)
    with torch.no_grad():
        got, _ = drafter.forward(ids, aux, torch.arange(len(ids)), drafter.new_cache())
    assert (got - expected).abs().max() > 0.5  # the comparison above would catch the mismatch


def test_export_from_the_training_folder_by_cli(checkpoints, random_tiny_model: Path, tmp_path: Path) -> None:
    train = tmp_path / "train"
    train.mkdir()
    (train / "result.json").write_text(json.dumps({"best_checkpoint": str(checkpoints[False])}))
    proc = subprocess.run(
        [sys.executable, "-m", "eagleflow", "export", "--train-dir", str(train), "--verifier", str(random_tiny_model),
         "--out", str(tmp_path / "drafter")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "drafter" / "export.json").read_text())
    assert manifest["checkpoint"] == str(checkpoints[False])
    served = ServedDrafter.from_export(tmp_path / "drafter")
    assert (served.num_steps, served.window, served.minimum_sglang) == (3, 2048, "0.5.17")
    assert sorted(p.name for p in (tmp_path / "drafter" / "speculators").iterdir()) == ["config.json", "config.py", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "drafter" / "sglang" / "model.safetensors"), "pt") as exported:
        names = set(exported.keys())
    assert names.isdisjoint(sglang_drafter.NOT_EXPORTED) and {"layers.1.hidden_norm.weight", "d2t"} <= names

    def export_again(checkpoint: Path) -> subprocess.CompletedProcess[str]:
        (train / "result.json").write_text(json.dumps({"best_checkpoint": str(checkpoint)}))
        return subprocess.run(
            [sys.executable, "-m", "eagleflow", "export", "--train-dir", str(train), "--verifier", str(random_tiny_model),
             "--out", str(tmp_path / "drafter")], capture_output=True, text=True, timeout=300,
        )

    # The same checkpoint again (a cleared task): reused at once, saying so, its files untouched.
    written = (tmp_path / "drafter" / "sglang" / "model.safetensors").stat().st_mtime_ns
    proc = export_again(checkpoints[False])
    assert proc.returncode == 0 and "export: reusing the finished result" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "drafter" / "sglang" / "model.safetensors").stat().st_mtime_ns == written
    # The weights deleted since: not reused (a folder without weights), made again, saying what was missing.
    (tmp_path / "drafter" / "sglang" / "model.safetensors").unlink()
    proc = export_again(checkpoints[False])
    assert proc.returncode == 0 and "reusing the finished" not in proc.stdout, proc.stdout + proc.stderr
    assert f"export: the finished result in {tmp_path / 'drafter'} is not as it was made: sglang/model.safetensors is missing; making it again" in proc.stdout
    with safe_open(str(tmp_path / "drafter" / "sglang" / "model.safetensors"), "pt") as exported:
        assert set(exported.keys()) == names
    # Its files rewritten (a retrained drafter): exported again.
    import shutil

    retrained = shutil.copytree(checkpoints[False], tmp_path / "retrained")
    proc = export_again(retrained)
    assert proc.returncode == 0 and "reusing" not in proc.stdout, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "drafter" / "export.json").read_text())["checkpoint"] == str(retrained)
    # No training folder: a clear error, nothing written.
    proc = subprocess.run(
        [sys.executable, "-m", "eagleflow", "export", "--train-dir", str(tmp_path / "none"), "--verifier",
         str(random_tiny_model), "--out", str(tmp_path / "none-out")], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "no finished training" in proc.stderr and not (tmp_path / "none-out").exists()


@pytest.mark.parametrize(
    ("architecture", "ids", "sglang_ids"),
    [("DeepseekV3ForCausalLM", [3, 31, 59], [3, 31, 59]), ("KimiK25ForConditionalGeneration", [2, 4, 5], [2, 4, 5]),
     ("LlamaForCausalLM", [2, 16, 29], [1, 15, 28]), ("Qwen3ForCausalLM", [1, 2, 3], [0, 1, 2])],
)
def test_aux_ids_follow_the_targets_capture_rule(architecture: str, ids: list[int], sglang_ids: list[int]) -> None:
    assert sglang_aux_layer_ids(ids, architecture) == sglang_ids
    assert captured_layer_ids(sglang_ids, architecture) == ids  # what SGLang's target then captures


@pytest.mark.parametrize(
    ("architecture", "ids", "reason"),
    [("LlamaForCausalLM", [0, 4], "id 0"), ("DeepseekV3ForCausalLM", [1, 4], "starting with 1"),
     ("MistralForCausalLM", [2, 4], "not one whose SGLang capture rule")],
)
def test_aux_ids_sglang_cannot_capture_are_refused(architecture: str, ids: list[int], reason: str) -> None:
    with pytest.raises(NotServable, match=reason):
        sglang_aux_layer_ids(ids, architecture)


def test_later_layers_input_norm_is_also_hidden_norm_and_nothing_else_changes() -> None:
    weights = {"layers.0.input_layernorm.weight": 0, "layers.1.input_layernorm.weight": 1, "layers.12.input_layernorm.weight": 2,
               "fc.weight": 3, "embed_tokens.weight": 4, "t2d": 5, "d2t": 6}
    assert sglang_weights(weights) == {
        "layers.0.input_layernorm.weight": 0, "layers.1.input_layernorm.weight": 1, "layers.1.hidden_norm.weight": 1,
        "layers.12.input_layernorm.weight": 2, "layers.12.hidden_norm.weight": 2, "fc.weight": 3, "d2t": 6,
    }
