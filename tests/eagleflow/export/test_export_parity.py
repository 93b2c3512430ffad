"""Export parity beyond the demo's shape: EAGLE-3.1 norms, attention biases, rotary settings, draft width.

Each case is a speculators ``Eagle3DraftModel`` of the tiny verifier at a shape that exercises it
(every weight random), exported; the reference engine's drafter, reading only the exported folder
as SGLang's ``LlamaForCausalLMEagle3`` reads it, must give speculators' own logits, for TTT step 0
over every position and for step 1 (fed step 0's hidden state, so ``norm_output`` counts) at the
last one. Where SGLang would serve another function, the export must refuse by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.drafters.eagle3.draft_model import Eagle3Drafter
from eagleflow.errors import UserError
from eagleflow.export.step import ExportConfig, export

from training_data import random_speculators_checkpoint, train_once

AUX = [2, 4, 5]
DRAFT_VOCAB = 256
HIDDEN = 64  # the tiny verifier's
EAGLE31 = {"fc_norm": True, "norm_before_fc": False, "norm_output": True}
# Kimi-K2's verifier rotary (YaRN, its config's keys and values), and plainer ones.
KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
             "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
ROPES = {
    "kimi-yarn": KIMI_YARN,
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
}


def checkpoint(verifier: Path, folder: Path, **kwargs: Any) -> Path:
    return random_speculators_checkpoint(verifier, folder, False, AUX, DRAFT_VOCAB, **kwargs)


def inputs(length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(5, 1000, (length,), generator=generator), torch.randn(length, len(AUX) * HIDDEN, generator=generator)


def speculators_steps(folder: Path, ids: torch.Tensor, aux: torch.Tensor) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """speculators' own forward over two TTT steps: each step's draft-vocabulary logits, and its embedding."""
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(str(folder), config=config).float().eval()
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[0].float()))
    with torch.no_grad():
        model(hidden_states=aux[None], input_ids=ids[None], document_ids=torch.zeros_like(ids)[None], ttt_steps=2)
    hook.remove()
    return seen, model.embed_tokens


def reference_steps(sglang: Path, embed: torch.nn.Module, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """The reference drafter: step 0 over all positions, then step 1 at the last (speculators feeds it token 0 there)."""
    drafter = Eagle3Drafter(sglang, embed, torch.float32)
    cache = drafter.new_cache()
    with torch.no_grad():
        logits0, hidden = drafter.forward(ids, aux, torch.arange(len(ids)), cache)
        logits1, _ = drafter.forward(torch.tensor([0]), hidden[-1:], torch.tensor([len(ids)]), cache)
    return [logits0, logits1]


def assert_parity(checkpoint_dir: Path, drafter: Path) -> None:
    ids, aux = inputs()
    expected, embed = speculators_steps(checkpoint_dir, ids, aux)
    got = reference_steps(drafter / "sglang", embed, ids, aux)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1][0], expected[1][-1], rtol=1e-4, atol=1e-4)


def exported_config(drafter: Path) -> dict[str, Any]:
    return json.loads((drafter / "sglang" / "config.json").read_text())


def test_eagle31_fc_norm_and_norm_output_are_served_as_trained(random_tiny_model: Path, tmp_path: Path) -> None:
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt", draft_flags=EAGLE31)
    manifest = export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    config = exported_config(tmp_path / "drafter")
    assert (config["fc_norm"], config["norm_output"], config["eagle_config"]["norm_before_fc"]) == (True, True, False)
    names = set(load_file(str(tmp_path / "drafter" / "sglang" / "model.safetensors")))
    assert {f"fc_norm.{i}.weight" for i in range(len(AUX))} <= names and "input_norm.weight" not in names
    assert set(manifest["sglang"]["sglang_features"]) >= {"fc_norm", "norm_output"}
    assert_parity(ckpt, tmp_path / "drafter")


@pytest.mark.e2e
def test_the_train_step_trains_eagle31_and_the_export_serves_it_as_trained(
    trained_data: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """draft_algorithm eagle3.1 through ``python -m eagleflow train`` (real speculators training), exported."""
    run = train_once(trained_data, tiny_model, tmp_path, 1, "--draft-algorithm", "eagle3.1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    trained = json.loads((run.best_checkpoint / "config.json").read_text())
    assert {k: trained[k] for k in EAGLE31} == EAGLE31
    export(ExportConfig(checkpoint=run.best_checkpoint, verifier=tiny_model, out=tmp_path / "drafter"))
    config = exported_config(tmp_path / "drafter")
    assert (config["fc_norm"], config["norm_output"], config["eagle_config"]["norm_before_fc"]) == (True, True, False)
    assert_parity(run.best_checkpoint, tmp_path / "drafter")
    # The reference engine serves it: greedy speculative decoding is greedy decoding, and drafts are accepted.
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagleflow.engine.reference_config import ReferenceEngineConfig
    from eagleflow.engine.reference.runner import ReferenceEngine
    from eagleflow.export.manifest import ServedDrafter

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    drafter = ServedDrafter.from_export(tmp_path / "drafter")
    plain = ReferenceEngine(model, tokenizer, ReferenceEngineConfig(model=tiny_model, dtype="float32"))
    speculative = ReferenceEngine(model, tokenizer, ReferenceEngineConfig(
        model=tiny_model, dtype="float32", speculative_algorithm="EAGLE3", speculative_draft_model_path=drafter.path,
        speculative_num_steps=drafter.num_steps, speculative_draft_window_size=drafter.window,
    ))
    correct = 0
    for row, ids in enumerate(load_from_disk(str(run.dataset))["input_ids"][-4:]):
        body = {"rid": f"row-{row}", "input_ids": [int(t) for t in ids[:24]], "sampling_params": {"max_new_tokens": 32, "temperature": 0.0}}
        expected, got = plain.generate(dict(body)), speculative.generate(dict(body))
        assert got["output_ids"] == expected["output_ids"], row
        correct += got["meta_info"]["spec_num_correct_drafts"]
    assert correct > 0


def test_fc_norm_follows_the_config_flag_not_the_weights(random_tiny_model: Path, tmp_path: Path) -> None:
    """SGLang builds fc_norm from the flag; weights without it are skipped, so the reference drafter ignores them too."""
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt", draft_flags=EAGLE31)
    export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    sglang = tmp_path / "drafter" / "sglang"
    ids, aux = inputs()
    _, embed = speculators_steps(ckpt, ids, aux)
    with_flag = reference_steps(sglang, embed, ids, aux)[0]
    config = exported_config(tmp_path / "drafter")
    (sglang / "config.json").write_text(json.dumps({**config, "fc_norm": False}))
    without_flag = reference_steps(sglang, embed, ids, aux)[0]
    assert (with_flag - without_flag).abs().max() > 0.1  # the norms are in the folder, unused
    # The legacy flag name SGLang also reads switches them on again.
    (sglang / "config.json").write_text(json.dumps({**config, "fc_norm": False, "use_aux_norm": True}))
    torch.testing.assert_close(reference_steps(sglang, embed, ids, aux)[0], with_flag)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_settings_are_served_as_trained(rope: str, random_tiny_model: Path, tmp_path: Path) -> None:
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt", layer_settings={"rope_parameters": dict(ROPES[rope])})
    export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    served = exported_config(tmp_path / "drafter")["rope_parameters"]
    assert {k: served[k] for k in ROPES[rope]} == ROPES[rope]
    assert_parity(ckpt, tmp_path / "drafter")


def test_rope_theta_and_scaling_without_rope_parameters_are_carried(random_tiny_model: Path, tmp_path: Path) -> None:
    """A layer config as transformers before 5 wrote it: rope_theta and rope_scaling at its top level."""
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt", layer_settings={"rope_parameters": dict(KIMI_YARN)})
    config = json.loads((ckpt / "config.json").read_text())
    layer = config["transformer_layer_config"]
    scaling = {k: v for k, v in layer.pop("rope_parameters").items() if k not in ("rope_type", "rope_theta")}
    layer.update(rope_theta=KIMI_YARN["rope_theta"], rope_scaling={**scaling, "type": "yarn"})
    (ckpt / "config.json").write_text(json.dumps(config))
    export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    served = exported_config(tmp_path / "drafter")["rope_parameters"]
    assert (served["rope_type"], served["rope_theta"], served["factor"]) == ("yarn", 50000.0, 32.0)
    assert_parity(ckpt, tmp_path / "drafter")


def test_rotary_sglang_computes_otherwise_is_refused(random_tiny_model: Path, tmp_path: Path) -> None:
    """transformers' YaRN honours attention_factor; SGLang's reads attn_factor and ignores it."""
    rope = {**ROPES["yarn-mscale"], "attention_factor": 0.5}
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt", layer_settings={"rope_parameters": rope})
    with pytest.raises(UserError, match=r"cannot be served by SGLang: rotary settings .*scale 1.20794 served, 0.5 trained"):
        export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    manifest = export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "d", serve_with="vllm"))
    assert "rotary settings" in manifest["sglang"]["refused"]


def test_an_o_proj_bias_is_served_and_qkv_or_mlp_biases_are_refused(random_tiny_model: Path, tmp_path: Path) -> None:
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt", layer_settings={"attention_bias": True, "mlp_bias": True})
    with pytest.raises(UserError, match=r"builds no layers\.0\.mlp\.down_proj\.bias, .*layers\.0\.self_attn\.k_proj\.bias"):
        export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "refused"))
    # Zero q/k/v and MLP biases: SGLang dropping them changes nothing; the o_proj bias it loads.
    weights = load_file(str(ckpt / "model.safetensors"))
    for name in [n for n in weights if n.endswith(".bias") and "o_proj" not in n]:
        weights[name] = torch.zeros_like(weights[name])
    assert all(weights[f"layers.{i}.self_attn.o_proj.bias"].abs().max() > 0.01 for i in (0, 1))
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    names = set(load_file(str(tmp_path / "drafter" / "sglang" / "model.safetensors")))
    assert {n for n in names if n.endswith(".bias")} == {"layers.0.self_attn.o_proj.bias", "layers.1.self_attn.o_proj.bias"}
    assert exported_config(tmp_path / "drafter")["attention_bias"] is True
    assert_parity(ckpt, tmp_path / "drafter")


def test_a_draft_of_another_width_than_the_verifier_is_refused(random_tiny_model: Path, tmp_path: Path) -> None:
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "target_hidden_size": 4096}))
    with pytest.raises(UserError, match=r"hidden_size 64 \(target_hidden_size 4096\) is not the verifier's 64: .*set_embed"):
        export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))


def test_a_folder_of_another_width_keeps_its_own_embedding_as_sglang_does(random_tiny_model: Path, tmp_path: Path) -> None:
    """SGLang's set_embed keeps the draft's embed_tokens when target_hidden_size != hidden_size."""
    ckpt = checkpoint(random_tiny_model, tmp_path / "ckpt")
    export(ExportConfig(checkpoint=ckpt, verifier=random_tiny_model, out=tmp_path / "drafter"))
    same, narrow = tmp_path / "drafter" / "sglang", tmp_path / "narrow"
    shutil.copytree(same, narrow)
    weights = load_file(str(same / "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, : len(AUX) * 32].contiguous()  # a 32-wide target
    weights["input_norm.weight"] = weights["input_norm.weight"][: len(AUX) * 32].contiguous()
    own = torch.randn(1024, HIDDEN, generator=torch.Generator().manual_seed(3))
    save_file({**weights, "embed_tokens.weight": own}, str(narrow / "model.safetensors"))
    config = json.loads((same / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "target_hidden_size": 32}))
    ids, aux = inputs()
    aux = aux[:, : len(AUX) * 32]
    target_embedding = torch.nn.Embedding(1024, HIDDEN)
    got = reference_steps(narrow, target_embedding, ids, aux)
    # The same computation, handed the draft's own embedding as if it were the target's.
    save_file(weights, str(same / "model.safetensors"))
    expected = reference_steps(same, torch.nn.Embedding.from_pretrained(own), ids, aux)
    torch.testing.assert_close(got, expected)
    save_file(weights, str(narrow / "model.safetensors"))  # no embedding of its own: SGLang would serve garbage
    with pytest.raises(UserError, match="keeps the draft's own embed_tokens, but the folder has no"):
        Eagle3Drafter(narrow, target_embedding, torch.float32)
