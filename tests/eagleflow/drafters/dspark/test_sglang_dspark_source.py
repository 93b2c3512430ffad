"""The export's DSpark drafter against the pinned SGLang's own DSpark classes, run from the wheel's source.

SGLang's ``models/dspark.py`` (on ``models/dflash.py``), ``dspark_config.py``, ``ragged_verify.py`` and the
drafting loop of ``dspark_draft.py`` with its kernels' torch paths run as they are on CPU, the rest of SGLang
stubbed (``sglang_dspark_exec``). The class is built from the exported ``config.json`` as SGLang's config loader
builds it (``transformers.AutoConfig``), in the verify mode a server would run (``cap-accept``, which builds the
confidence head; ``static``, SGLang's default, which does not); its real ``load_weights`` consumes the exported
tensors, so a name it would skip, a parameter it built and never assigned, or a head it refuses shows by name.

Then what runs on CPU runs, against the reference drafter (:mod:`eagleflow.drafters.dspark.reference`) on the
same block states: the Markov head's bias step by step (``step_bias``), SGLang's whole drafting loop
(``draft_markov_block``: base logits from ``compute_base_logits`` through the target's head, the chain from the
anchor, ``MarkovSampleStep``'s rounding and argmax, or ``MarkovGreedyStep``'s fused greedy path) and the
confidence head (``compute_confidence``). What cannot run here is the backbone's forward (its attention needs
SGLang's KV pool and a GPU backend): DFlash's source test checks the config it is built from, the parity test
against speculators (``test_dspark_export``) the function it computes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dspark_checkpoints import random_dspark_checkpoint
from eagleflow.drafters.dflash import layer_attention
from eagleflow.drafters.dspark.reference import DSparkDrafter, load_dspark_decoder
from eagleflow.export.step import ExportConfig, export
from sglang_dspark_exec import ServedDSpark, TargetHead, load_into_sglang_dspark, misrouted, wheel_definition
from sglang_wheels import get_wheel, pinned_version
from training_data import edit_folder

pytestmark = [pytest.mark.sglang_source, pytest.mark.usefixtures("one_torch_thread")]

AUX = [2, 4, 5]  # eagleflow's ids: SGLang's target_layer_ids [1, 3, 4] of the 8-layer tiny verifier
GAMMA = 5
RANK = 8
HEADS = ("vanilla", "gated", "rnn")
MARKOV_CLASS = {"vanilla": "VanillaMarkov", "gated": "GatedMarkovHead", "rnn": "RNNHead"}


@pytest.fixture(scope="module")
def verifier(random_tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(random_tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A two-layer DSpark drafter of the tiny verifier per Markov head type (layer 1 on full attention), exported."""
    folder, out = tmp_path_factory.mktemp("dspark"), {}
    for head in HEADS:
        checkpoint = random_dspark_checkpoint(
            random_tiny_model, folder / head / "checkpoint", AUX, head, RANK, block_size=GAMMA,
            layer_settings={"num_key_value_heads": 2}, full_attention_indices=[1],
        )
        export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=folder / head / "drafter"))
        out[head] = folder / head / "drafter" / "sglang"
    return out


@pytest.fixture(scope="module")
def served(exported: dict[str, Path]) -> dict[str, ServedDSpark]:
    return {head: load_into_sglang_dspark(get_wheel(pinned_version()), folder) for head, folder in exported.items()}


@pytest.mark.parametrize("head", HEADS)
def test_the_pinned_wheel_loads_every_exported_tensor_into_every_parameter_it_builds(head: str, exported: dict[str, Path]) -> None:
    weights = load_file(str(exported[head] / "model.safetensors"))
    sglang = load_into_sglang_dspark(get_wheel(pinned_version()), exported[head], weights=weights)  # its loads are these tensors
    assert sglang.skipped == [], f"sglang {pinned_version()} silently skips {sglang.skipped}"
    assert [name for name, p in sglang.params.items() if id(p) not in sglang.loaded] == []
    assert misrouted(sglang.params, weights, sglang.loads) == []
    heads = [name for name in weights if name.startswith(("markov_head.", "confidence_head."))]
    for name in heads:  # the heads are real torch modules: each holds the file's values
        assert torch.equal(sglang.params[name].to(weights[name].dtype), weights[name]), name
    assert sglang.params["confidence_head.proj.weight"].dtype == torch.float32  # SGLang's confidence head is float32


def test_in_sglangs_default_static_mode_the_confidence_head_is_not_built_and_its_tensors_skipped(exported: dict[str, Path]) -> None:
    static = load_into_sglang_dspark(get_wheel(pinned_version()), exported["gated"], mode="static")
    assert static.model.confidence_head is None
    assert sorted(static.skipped) == ["confidence_head.proj.bias", "confidence_head.proj.weight"]
    assert [name for name, p in static.params.items() if id(p) not in static.loaded] == []


@pytest.mark.parametrize("head", HEADS)
def test_sglang_reads_the_block_the_heads_and_the_context_we_meant(head: str, served: dict[str, ServedDSpark]) -> None:
    sglang = served[head]
    config, model = json.loads(json.dumps(sglang.config.to_dict())), sglang.model
    parsed = sglang.dspark_config.parse_dspark_draft_config(draft_hf_config=sglang.config)
    assert (parsed.gamma, parsed.target_layer_ids, parsed.mask_token_id, parsed.markov_rank, parsed.markov_head_type) == (
        GAMMA, [k - 1 for k in AUX], 0, RANK, head)
    runtime = sglang.dspark_config.resolve_runtime_config(
        draft_hf_config=sglang.config, speculative_num_draft_tokens=GAMMA + 1, target_vocab_size=config["vocab_size"])
    assert (runtime.gamma, runtime.verify_num_draft_tokens, runtime.mask_token_id) == (GAMMA, GAMMA + 1, 0)
    assert (model.gamma, model.block_size, model.sample_from_anchor) == (GAMMA, GAMMA, True)
    assert type(model.markov_head).__name__ == MARKOV_CLASS[head]
    assert (model.markov_head.markov_rank, model.markov_head.vocab_size) == (RANK, config["vocab_size"])
    assert (model.confidence_head.with_markov, model.confidence_head.proj.in_features) == (True, config["hidden_size"] + RANK)
    assert model.fc.in_features == len(AUX) * config["hidden_size"]
    ours = layer_attention(config, config["num_hidden_layers"])
    assert [(r["attn_type"].name == "ENCODER_ONLY", None if r["sliding_window_size"] in (-1, None) else r["sliding_window_size"])
            for r in sglang.attentions] == [(a.bidirectional, a.window_left) for a in ours] == [(False, 2047), (True, None)]


def block_states(folder: Path, verifier: Any) -> tuple[DSparkDrafter, int, torch.Tensor, Any]:
    """The reference drafter, an anchor token, the block's final-norm states ``[γ, H]`` after a short context."""
    decoder = load_dspark_decoder(verifier, folder, None)
    ids = torch.randint(5, 1000, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), decoder.capture() as hooks:
        verifier(input_ids=ids[None])
    cache = decoder.drafter.new_cache()
    decoder.drafter.add_context(hooks.aux(), torch.arange(len(ids)), cache)
    anchor = int(verifier(input_ids=ids[None]).logits[0, -1].argmax())
    return decoder.drafter, anchor, decoder.drafter.block_hidden(anchor, len(ids), GAMMA, cache), cache


@pytest.mark.parametrize("head", HEADS)
def test_sglang_drafts_the_block_the_reference_drafter_drafts(
    head: str, exported: dict[str, Path], served: dict[str, ServedDSpark], verifier: Any
) -> None:
    """The Markov bias step by step, then SGLang's own drafting loop over the same block states, its two greedy paths."""
    sglang = served[head]
    drafter, anchor, hidden, cache = block_states(exported[head], verifier)
    block = drafter.draft_block(anchor, len(cache.positions), GAMMA, cache)
    # step_bias along the reference's chain: the same bias, the same recurrent state.
    state, ours_state = sglang.model.markov_head.init_state(hidden[None]), drafter._state(hidden)
    worst = 0.0
    with torch.no_grad():
        for k, prev in enumerate(block.previous):
            bias, state = sglang.model.markov_head.step_bias(torch.tensor([prev]), hidden_states=hidden[None, k], state=state)
            ours, ours_state = drafter._bias(prev, hidden[k], ours_state)
            torch.testing.assert_close(bias[0], ours, rtol=1e-5, atol=1e-5)
            worst = max(worst, float((bias[0] - ours).abs().max()))
    # The worker's drafting: base logits through the target's head, the chain from the anchor.
    sglang.model.attach_shared_modules(embed_tokens=verifier.get_input_embeddings(), lm_head=TargetHead(verifier.lm_head.weight.detach()))
    with torch.no_grad():
        base, features = sglang.model.compute_base_logits(hidden)
        draft = sglang.dspark_draft
        tp_sync = type("OneRank", (), {"sync": staticmethod(lambda site, tokens: tokens)})()
        runs = {
            greedy: draft.draft_markov_block(
                markov_head=sglang.model.markov_head, base_logits=base[None], anchor_tokens=torch.tensor([anchor]),
                draft_hidden=hidden[None], step_temperatures=torch.zeros(1), noise=draft.DraftNoise(key=7, offset=torch.zeros(1, dtype=torch.long)),
                tp_sync=tp_sync, greedy_draft=greedy,
            )
            for greedy in (False, True)
        }
    tokens, logits = runs[False]
    assert tokens[0].tolist() == block.tokens == runs[True][0][0].tolist()
    torch.testing.assert_close(logits[0].float(), block.logits, rtol=1e-5, atol=1e-5)
    # The confidence head over the same rows: the anchor, then the drafted tokens.
    with torch.no_grad():
        confidence, raw = sglang.model.compute_confidence(anchor_tokens=torch.tensor([anchor]), draft_tokens=tokens, confidence_features=features)
    ours = drafter.confidence_logits(hidden, block.previous)
    torch.testing.assert_close(raw[0], ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(confidence[0], torch.sigmoid(ours), rtol=1e-5, atol=1e-5)  # identity temperatures
    print(f"{head}: bias max |diff| {worst:.2e}, step logits {(logits[0].float() - block.logits).abs().max():.2e}, "
          f"confidence {(raw[0] - ours).abs().max():.2e}; tokens {block.tokens}")


def tampered(exported: Path, tmp_path: Path, config: dict[str, Any] | None = None, weights: Any = None) -> Path:
    """A copy of the exported folder with ``config``'s keys set and its tensors edited by ``weights``."""
    folder = tmp_path / "sglang"
    shutil.copytree(exported, folder)
    edit_folder(folder, (lambda settings: settings.update(config)) if config else None, weights)
    return folder


W1 = "markov_head.markov_w1.weight"
# What SGLang's loader refuses, as the reference drafter does (test_dspark_export's tampering).
REFUSED = {
    "markov_w1 transposed": ("gated", None, lambda w: w.update({W1: w[W1].T}), AssertionError, "Attempted to load weight"),
    "markov_rank changed": ("gated", {"markov_rank": 4}, None, AssertionError, "Attempted to load weight"),
    "markov_head_type changed": ("gated", {"markov_head_type": "vanilla"}, None, ValueError,
                                 "DSpark unexpected markov weight 'markov_head.gate_proj"),
    "confidence head dropped": ("vanilla", None, lambda w: [w.pop(k) for k in ("confidence_head.proj.weight", "confidence_head.proj.bias")],
                                ValueError, "DSpark confidence head is enabled but the checkpoint is missing"),
    "markov_rank dropped": ("vanilla", {"markov_rank": None}, None, ValueError, "DSpark draft requires markov_rank > 0"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_sglang_refuses_what_the_reference_drafter_refuses(case: str, exported: dict[str, Path], tmp_path: Path) -> None:
    head, config, weights, error, words = REFUSED[case]
    with pytest.raises(error, match=words):
        load_into_sglang_dspark(get_wheel(pinned_version()), tampered(exported[head], tmp_path, config, weights))


def test_the_sts_recorder_sglang_collects_with_takes_the_reference_decoders_confidence(
    exported: dict[str, Path], verifier: Any, tmp_path: Path
) -> None:
    """SGLang's own ``StsDataRecorder`` (``dspark_sts.py``) fed by the decoder: the shards its fit script reads."""
    recorder_class = wheel_definition(
        get_wheel(pinned_version()), "sglang/srt/speculative/dspark_components/dspark_sts.py", "StsDataRecorder",
        {"torch": torch, "Path": Path},
    )
    sglang = recorder_class(path_stem=str(tmp_path / "sts"), gamma=GAMMA, flush_every=3)

    class OneRequest:  # the decoder serves one request: a batch of one row of SGLang's recorder
        def record(self, confidence_raw: torch.Tensor, num_correct_drafts: int) -> None:
            sglang.record(confidence_raw=confidence_raw.view(1, -1), num_correct_drafts=torch.tensor([num_correct_drafts]))

    decoder = load_dspark_decoder(verifier, exported["vanilla"], None)
    decoder.sts_recorder = OneRequest()
    output, _, stats = decoder.generate([5, 17, 42, 99, 7], 16, set(), True)
    sglang.flush()
    shards = [torch.load(path) for path in sorted(tmp_path.glob("sts.*.pt"))]
    logits = torch.cat([s["logits"] for s in shards])
    mask = torch.cat([s["prefix_mask"] for s in shards])
    assert logits.shape == mask.shape == (stats.verify_ct, GAMMA) and logits.dtype == torch.float32
    assert int(mask.sum()) == stats.correct_drafts  # each row: 1 for the drafts the target accepted, a prefix
    assert torch.equal(mask, mask.cummin(dim=1).values)
