"""DFlash block decoding in the reference engine: lossless, counted as SGLang counts it, its context right.

The target is the trained tiny verifier in float32 (greedy decoding has one answer whichever way the
forward passes are grouped); the drafter is speculators' ``DFlashDraftModel`` of it with random weights,
through ``eagleflow export``. A random drafter is rarely accepted, so the decoding loop's acceptance
paths are driven by an oracle that drafts greedy decoding's own tokens, right for a varying number of
slots per round. The e2e test trains a drafter with ``eagleflow train --draft-algorithm dflash``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleflow.drafters.dflash.reference import DFlashCache, DFlashDrafter, load_dflash_decoder
from eagleflow.errors import UserError
from eagleflow.export import ServedDrafter
from eagleflow.export.step import ExportConfig, export

from greedy_decoding import greedy, stop_ids
from training_data import copy_dataset, random_dflash_checkpoint

AUX = [2, 4, 6]
BLOCK = 4
MAX_NEW_TOKENS = 40
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def drafter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dflash")
    checkpoint = random_dflash_checkpoint(tiny_model, folder / "checkpoint", AUX, block_size=BLOCK, full_attention_indices=[1])
    export(ExportConfig(checkpoint=checkpoint, verifier=tiny_model, out=folder / "drafter"))
    return folder / "drafter" / "sglang"


def assert_counts(output: list[int], stats: Any, block: int) -> None:
    """SGLang's counts: each verify commits its accepted drafts (at most B − 1) and one target token."""
    assert stats.draft_tokens_per_round == block - 1
    assert 0 <= stats.correct_drafts <= (block - 1) * stats.verify_ct
    produced = 1 + stats.verify_ct + stats.correct_drafts  # the prefill's token, then each round's
    assert 0 <= produced - len(output) < block  # only the last round is cut (a stop token, max_new_tokens)
    meta = stats.meta_info(len(output))
    if stats.verify_ct:
        assert meta["spec_num_proposed_drafts"] == (block - 1) * stats.verify_ct
        assert meta["spec_accept_rate"] == pytest.approx(stats.correct_drafts / ((block - 1) * stats.verify_ct))


def test_block_decoding_is_greedy_decoding(target: tuple[Any, Any], drafter: Path, prompts: list[list[int]]) -> None:
    model = target[0]
    decoder = load_dflash_decoder(model, drafter, None)
    assert (decoder.block_size, decoder.draft_tokens_per_round) == (BLOCK, BLOCK - 1)
    stops = stop_ids(model)
    for ids in prompts:
        for ignore_eos in (True, False):
            output, finish, stats = decoder.generate(ids, MAX_NEW_TOKENS, stops, ignore_eos)
            assert output == greedy(model, ids, MAX_NEW_TOKENS, set() if ignore_eos else stops), (ids, ignore_eos)
            assert finish["type"] == ("stop" if output[-1] in stops and not ignore_eos else "length")
            assert_counts(output, stats, BLOCK)


def test_the_reference_engine_serves_dflash_as_sglang_answers(target: tuple[Any, Any], drafter: Path, prompts: list[list[int]], tmp_path: Path) -> None:
    """``--speculative-algorithm DFLASH``: greedy decoding's tokens, with SGLang's spec fields (B − 1 drafts per verify)."""
    from eagleflow.engine.reference_config import ReferenceEngineConfig
    from eagleflow.engine.reference.runner import ReferenceEngine

    model, tokenizer = target
    plain = ReferenceEngine(model, tokenizer, ReferenceEngineConfig(model=tmp_path, dtype="float32"))
    config = ReferenceEngineConfig(
        model=tmp_path, dtype="float32", speculative_algorithm="DFLASH", speculative_draft_model_path=drafter,
        speculative_num_draft_tokens=BLOCK,
    )
    speculative = ReferenceEngine(model, tokenizer, config)
    verified = 0
    for i, ids in enumerate(prompts):
        for ignore_eos in (False, True):
            body = {"rid": f"p{i}", "input_ids": ids,
                    "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": ignore_eos}}
            expected, got = plain.generate(dict(body)), speculative.generate(dict(body))
            assert got["output_ids"] == expected["output_ids"]
            assert got["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
            meta = got["meta_info"]
            if "spec_verify_ct" in meta:  # none when the first token already finished the request
                assert meta["spec_num_proposed_drafts"] == (BLOCK - 1) * meta["spec_verify_ct"]
                assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
                verified += 1
    assert verified >= len(prompts)


class Oracle:
    """A drafter whose drafts are greedy decoding's tokens, right for ``k`` slots in round ``k`` (cycling
    0 .. B − 1), then wrong; it runs the real drafter too and records each round's position and context."""

    def __init__(self, real: DFlashDrafter, prompt_length: int, expected: list[int], block: int) -> None:
        self.real, self.prompt_length, self.expected, self.block = real, prompt_length, expected, block
        self.rounds: list[tuple[int, int, int]] = []  # (position, context length, slots right)
        self.cache: DFlashCache | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def block_logits(self, bonus: int, position: int, block_size: int, cache: DFlashCache) -> torch.Tensor:
        logits = self.real.block_logits(bonus, position, block_size, cache)
        right = len(self.rounds) % block_size
        self.rounds.append((position, cache.length, right))
        self.cache = cache
        assert bonus == self.expected[position - self.prompt_length]
        oracle = torch.zeros_like(logits)
        for slot in range(1, block_size):
            token = self.expected[position - self.prompt_length + slot]
            oracle[slot, token if slot <= right else (token + 1) % logits.shape[-1]] = 1.0
        return oracle


@pytest.mark.parametrize("block", [2, BLOCK, 7])
def test_accepted_drafts_are_committed_and_their_context_is_the_targets(
    target: tuple[Any, Any], drafter: Path, prompts: list[list[int]], block: int
) -> None:
    model = target[0]
    ids = prompts[0]
    expected = greedy(model, ids, MAX_NEW_TOKENS + block)
    decoder = load_dflash_decoder(model, drafter, block)
    oracle = Oracle(decoder.drafter, len(ids), expected, block)
    decoder.drafter = oracle  # type: ignore[assignment]
    output, _, stats = decoder.generate(ids, MAX_NEW_TOKENS, set(), True)
    assert output == expected[:MAX_NEW_TOKENS]
    assert_counts(output, stats, block)
    assert stats.verify_ct == len(oracle.rounds) and stats.correct_drafts == sum(right for *_, right in oracle.rounds)
    # Each round drafts after the committed tokens, which are all in the context and nothing else.
    committed = len(ids)
    for position, context, right in oracle.rounds:
        assert position == context == committed
        committed += right + 1
    # The context written round by round is what one pass of the target over the same tokens gives.
    assert oracle.cache is not None
    tokens = (ids + output)[: oracle.cache.length]
    with torch.no_grad(), decoder.capture() as hooks:
        model(input_ids=torch.tensor([tokens]))
    fresh = decoder.drafter.new_cache()
    oracle.real.add_context(hooks.aux(), torch.arange(len(tokens)), fresh)
    assert torch.equal(oracle.cache.positions, fresh.positions)
    for got, want in zip(oracle.cache.keys + oracle.cache.values, fresh.keys + fresh.values, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_block_size_is_the_exports_unless_given(target: tuple[Any, Any], drafter: Path, tmp_path: Path) -> None:
    from eagleflow.engine.reference_config import ReferenceEngineConfig
    from eagleflow.drafters.dflash.reference import dflash_decoder

    model = target[0]
    assert load_dflash_decoder(model, drafter, 6).draft_tokens_per_round == 5
    flags = {"model": tmp_path, "speculative_algorithm": "DFLASH", "speculative_draft_model_path": drafter}
    assert dflash_decoder(model, ReferenceEngineConfig(**flags)).block_size == BLOCK
    assert dflash_decoder(model, ReferenceEngineConfig(**flags, speculative_num_draft_tokens=3)).block_size == 3
    assert dflash_decoder(model, ReferenceEngineConfig(**flags, speculative_dflash_block_size=5)).block_size == 5
    with pytest.raises(UserError, match="block size 1: a block holds the bonus token and at least one draft"):
        load_dflash_decoder(model, drafter, 1)
    with pytest.raises(UserError, match="has no config.json"):
        load_dflash_decoder(model, tmp_path, None)


def test_a_folder_whose_context_layers_the_target_lacks_is_refused(target: tuple[Any, Any], drafter: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sglang"
    shutil.copytree(drafter, folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 3, 9]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 3, 9\]"):
        load_dflash_decoder(target[0], folder, None)


def train_dflash(dataset: Path, verifier: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``eagleflow train --draft-algorithm dflash`` (real speculators training), 2 layers, blocks of ``BLOCK``."""
    import os

    argv = [sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(verifier),
            "--out", str(out), "--aux-layer-ids", ",".join(map(str, AUX)), "--draft-algorithm", "dflash",
            "--num-layers", "2", "--block-size", str(BLOCK), "--max-anchors", "64", "--total-seq-len", "256",
            "--num-workers", "0", "--lr", "3e-3", "--device", "cpu", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.e2e
def test_a_trained_dflash_drafter_is_served_as_trained_and_accepted(
    trained_data: Path, tiny_model: Path, target: tuple[Any, Any], prompts: list[list[int]], tmp_path: Path
) -> None:
    """``eagleflow train --draft-algorithm dflash`` from the reference engine's captured states, exported: what
    SGLang would serve otherwise is refused before training, its metrics are speculators' block metrics, its
    blocks are speculators', and block decoding with it is greedy decoding with drafts accepted."""
    from eagleflow.evaluate.prompts import held_out_prompts
    from eagleflow.metrics.records import read_records

    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    # SGLang serves a block drafter through the target's own head: a reduced vocabulary is refused before training.
    refused = train_dflash(dataset, tiny_model, tmp_path / "refused", "--draft-vocab-size", "256", "--mask-token-id", "0")
    assert refused.returncode == 2 and "train the verifier's full vocabulary (1024)" in refused.stderr, refused.stderr[-2000:]

    # The mask token: SGLang could not add a <|MASK|> to the tiny tokenizer (its vocabulary is full), so the tokenizer's
    # pad token is chosen, which no training row contains, and written into the export.
    run = train_dflash(dataset, tiny_model, tmp_path / "train", "--epochs", "10")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (f"dflash drafter: 2 layer(s), block {BLOCK}, mask token id 0 (the pad token: mask token id 1024 is not below "
            "the target's vocab size 1024), the full vocabulary of 1024") in run.stdout, run.stdout[-3000:]
    val = [r for r in read_records(tmp_path / "train" / "metrics.jsonl") if r["kind"] == "val"]
    assert len(val) == 10 and val[-1]["eal"] > 1.5, val[-1]  # speculators' expected accept length, the bonus included
    best = Path(json.loads((tmp_path / "train" / "result.json").read_text())["best_checkpoint"])
    manifest = export(ExportConfig(checkpoint=best, verifier=tiny_model, out=tmp_path / "exported"))
    assert (manifest["sglang"]["algorithm"], manifest["sglang"]["block_size"]) == ("DFLASH", BLOCK)
    shutil.move(tmp_path / "exported", tmp_path / "drafter")  # a moved drafter folder serves its own files
    served = ServedDrafter.from_export(tmp_path / "drafter")
    assert (served.path, served.algorithm, served.num_steps) == (tmp_path / "drafter" / "sglang", "DFLASH", BLOCK - 1)
    config = json.loads((served.path / "config.json").read_text())
    assert config["dflash_config"] == {"block_size": BLOCK, "target_layer_ids": [1, 3, 5], "mask_token_id": 0, "num_target_layers": 8}
    model = target[0]
    # The served blocks are the trained ones (speculators' own forward over the verifier's aux states).
    from speculators.models.dflash import DFlashDraftModel

    from eagleflow.engine.capture import AuxStateCapture

    config = DFlashDraftModel.config_class.from_pretrained(str(best))
    config.transformer_layer_config._attn_implementation = "sdpa"
    trained = DFlashDraftModel.from_pretrained(str(best), config=config).float().eval()
    ids = torch.tensor(prompts[3] + greedy(model, prompts[3], 16))
    with torch.no_grad(), AuxStateCapture(model, AUX) as hooks:
        model(input_ids=ids[None])
    anchors, length = len(ids) - BLOCK, len(ids)
    with torch.no_grad():
        _, expected, *_ = trained._backbone_forward(
            hooks.aux()[None], ids[None], torch.ones(1, length), torch.zeros(1, length, 64),
            torch.zeros(1, length, dtype=torch.long), max_anchors=anchors,
        )
    decoder = load_dflash_decoder(model, served.path, None)
    cache = decoder.drafter.new_cache()
    decoder.drafter.add_context(hooks.aux(), torch.arange(length), cache)
    got = torch.stack([decoder.drafter.block_logits(int(ids[a]), a, BLOCK, cache) for a in range(anchors)])
    torch.testing.assert_close(got[:, 1:], expected[0].view(anchors, BLOCK, -1)[:, 1:], rtol=1e-4, atol=1e-4)
    # Decoding the verifier's own answers to held-out conversations: exactly greedy decoding, drafts accepted.
    completion = verify = 0
    for prompt in [p.input_ids for p in held_out_prompts(dataset, 0.9, 6)] + prompts:
        output, _, stats = decoder.generate(prompt, MAX_NEW_TOKENS, stop_ids(model), False)
        assert output == greedy(model, prompt, MAX_NEW_TOKENS, stop_ids(model))
        assert_counts(output, stats, BLOCK)
        completion, verify = completion + len(output), verify + stats.verify_ct
    # Below training's eal (about 2.1 here, which the reference drafter reproduces on the dataset's own text): the
    # verifier's free answers drift from the dataset's, which the drafter was trained on (regeneration closes that gap).
    assert completion / verify > 1.25, f"accept length {completion / verify:.2f}: the trained drafter's drafts are accepted"
