"""DSpark decoding in the reference engine: lossless, counted as SGLang counts it, its flags SGLang's.

The target is the trained tiny verifier in float32 (greedy decoding has one answer whichever way the forward
passes are grouped). The drafter is speculators' ``DSparkDraftModel`` of it with random weights, through
``eagleflow export``, for the decoding loop's own rules (DFlash's loop, whose acceptance paths DFlash's tests
drive with an oracle; DSpark drafts γ tokens a round and verifies γ + 1); the e2e test trains one with
``eagleflow train --draft-algorithm dspark`` and checks it is served as trained and accepted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dspark_checkpoints import random_dspark_checkpoint, speculators_forward
from eagleflow.drafters.dspark import serving_flags, train_flags
from eagleflow.drafters.dspark.reference import dspark_decoder, load_dspark_decoder
from eagleflow.errors import UserError
from eagleflow.export import ServedDrafter
from eagleflow.export.step import ExportConfig, export
from eagleflow.train import TrainConfig
from greedy_decoding import greedy, stop_ids
from training_data import copy_dataset

AUX = [2, 4, 6]
GAMMA = 4
MAX_NEW_TOKENS = 40
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def drafter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dspark")
    checkpoint = random_dspark_checkpoint(tiny_model, folder / "checkpoint", AUX, "rnn", block_size=GAMMA, full_attention_indices=[1])
    export(ExportConfig(checkpoint=checkpoint, verifier=tiny_model, out=folder / "drafter"))
    return folder / "drafter" / "sglang"


def assert_counts(output: list[int], stats: Any) -> None:
    """SGLang's counts: each verify commits its accepted drafts (at most γ) and one target token."""
    assert stats.draft_tokens_per_round == GAMMA
    assert 0 <= stats.correct_drafts <= GAMMA * stats.verify_ct
    produced = 1 + stats.verify_ct + stats.correct_drafts  # the prefill's token, then each round's
    assert 0 <= produced - len(output) <= GAMMA  # only the last round is cut (a stop token, max_new_tokens)


def test_dspark_decoding_is_greedy_decoding_and_hands_each_verify_to_the_recorder(
    target: tuple[Any, Any], drafter: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """Lossless, with SGLang's counts; each verify's raw confidence and accepted drafts go to the calibration's recorder."""
    from eagleflow.drafters.dspark.calibration import StsRecorder, read_records

    model = target[0]
    decoder = load_dspark_decoder(model, drafter, None)
    assert (decoder.gamma, decoder.block_size, decoder.draft_tokens_per_round) == (GAMMA, GAMMA + 1, GAMMA)
    stops = stop_ids(model)
    for ids in prompts[1:3]:  # the loop is DFlash's, tested there with every prompt: here what DSpark changes
        for ignore_eos in (True, False):
            recording = tmp_path / f"sts-{len(ids)}-{ignore_eos}.jsonl"
            with StsRecorder(recording, GAMMA) as decoder.sts_recorder:
                output, finish, stats = decoder.generate(ids, MAX_NEW_TOKENS, stops, ignore_eos)
            assert output == greedy(model, ids, MAX_NEW_TOKENS, set() if ignore_eos else stops), (ids, ignore_eos)
            assert finish["type"] == ("stop" if output[-1] in stops and not ignore_eos else "length")
            assert_counts(output, stats)
            records = read_records(recording, GAMMA)
            assert len(records) == stats.verify_ct
            assert sum(r.num_correct_drafts for r in records) == stats.correct_drafts


def test_the_reference_engine_serves_dspark_as_sglang_answers(
    target: tuple[Any, Any], drafter: Path, prompts: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--speculative-algorithm DSPARK``: greedy decoding's tokens, with SGLang's spec fields (γ drafts per verify);
    with SGLang's collector variable set, every verify's confidence recorded for the calibration."""
    from eagleflow.drafters.dspark.calibration import COLLECT_ENV, read_records
    from eagleflow.engine.reference.runner import ReferenceEngine
    from eagleflow.engine.reference_config import ReferenceEngineConfig

    model, tokenizer = target
    plain = ReferenceEngine(model, tokenizer, ReferenceEngineConfig(model=tmp_path, dtype="float32"))
    config = ReferenceEngineConfig(
        model=tmp_path, dtype="float32", speculative_algorithm="DSPARK", speculative_draft_model_path=drafter,
        speculative_num_draft_tokens=GAMMA + 1,
    )
    monkeypatch.setenv(COLLECT_ENV, str(tmp_path / "sts.jsonl"))
    speculative = ReferenceEngine(model, tokenizer, config)
    verifies = 0
    for i, ids in enumerate(prompts[:2]):
        body = {"rid": f"p{i}", "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}}
        expected, got = plain.generate(dict(body)), speculative.generate(dict(body))
        assert got["output_ids"] == expected["output_ids"]
        meta = got["meta_info"]
        assert meta["spec_num_proposed_drafts"] == GAMMA * meta["spec_verify_ct"]
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        verifies += meta["spec_verify_ct"]
    assert len(read_records(tmp_path / "sts.jsonl", GAMMA)) == verifies


def test_gamma_is_sglangs_and_the_verify_window_one_more(target: tuple[Any, Any], drafter: Path, tmp_path: Path) -> None:
    from eagleflow.engine.reference_config import ReferenceEngineConfig

    model = target[0]
    flags = {"model": tmp_path, "speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafter}
    assert dspark_decoder(model, ReferenceEngineConfig(**flags)).gamma == GAMMA  # the export's block_size
    assert dspark_decoder(model, ReferenceEngineConfig(**flags, speculative_num_draft_tokens=3)).gamma == 2
    assert dspark_decoder(model, ReferenceEngineConfig(**flags, speculative_dspark_block_size=6)).gamma == 6
    with pytest.raises(ValidationError, match=r"--speculative-num-draft-tokens 4 must equal --speculative-dspark-block-size \+ 1 = 7"):
        ReferenceEngineConfig(**flags, speculative_dspark_block_size=6, speculative_num_draft_tokens=4)
    with pytest.raises(ValidationError, match="--speculative-eagle-topk 2: SGLang runs a block drafter with one step of topk 1"):
        ReferenceEngineConfig(**flags, speculative_num_draft_tokens=GAMMA + 1, speculative_eagle_topk=2)
    with pytest.raises(UserError, match="has no config.json"):
        load_dspark_decoder(model, tmp_path, None)


def test_training_and_serving_flags(tmp_path: Path) -> None:
    cfg = TrainConfig(dataset=tmp_path, verifier=tmp_path, out=tmp_path, aux_layer_ids=AUX, draft_algorithm="dspark")
    # speculators 0.9.0's DSpark recipe where the run leaves it empty, concrete (a resume compares them).
    assert (cfg.num_layers, cfg.block_size, cfg.markov_rank, cfg.markov_head_type) == (5, 8, 256, "vanilla")
    flags = train_flags(cfg.model_copy(update={"markov_head_type": "gated", "markov_rank": 64}), 7)
    assert flags == [
        "--speculator-type", "dspark", "--block-size", "8", "--mask-token-id", "7", "--max-anchors", "512", "--sample-from-anchor",
        "--markov-rank", "64", "--markov-head-type", "gated", "--enable-confidence-head", "--confidence-head-with-markov",
        "--confidence-head-alpha", "1.0",
    ]
    for family in ("dflash", "eagle3"):
        with pytest.raises(ValidationError, match=f"markov_rank 64 applies to dspark drafters; leave it empty for {family}"):
            TrainConfig(dataset=tmp_path, verifier=tmp_path, out=tmp_path, aux_layer_ids=AUX, draft_algorithm=family, markov_rank=64)
    # SGLang's rule: gamma drafts, gamma + 1 verified (the manifest's block_size); the calibration only when given.
    assert serving_flags("/d", 1, 1, GAMMA + 1) == [
        "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "/d", "--speculative-dspark-block-size", str(GAMMA),
        "--speculative-num-draft-tokens", str(GAMMA + 1),
    ]
    assert serving_flags("/d", 1, 1, GAMMA + 1, calibration="/d/sts.json")[-2:] == ["--speculative-dspark-confidence-sts-path", "/d/sts.json"]
    with pytest.raises(ValueError, match="--speculative-num-steps 3"):
        serving_flags("/d", 3, 1, GAMMA + 1)


@pytest.mark.sglang_source
def test_every_serving_flag_is_one_the_pinned_sglang_takes() -> None:
    from sglang_wheels import cli_flags, get_wheel, pinned_version

    flags = [f for f in serving_flags("/d", 1, 1, GAMMA + 1, calibration="/c.json") if f.startswith("--")]
    assert set(flags) - cli_flags(get_wheel(pinned_version())) == set()


@pytest.mark.e2e
def test_a_trained_dspark_drafter_is_served_as_trained_and_accepted(
    trained_data: Path, tiny_model: Path, target: tuple[Any, Any], prompts: list[list[int]], tmp_path: Path
) -> None:
    """``eagleflow train --draft-algorithm dspark`` (real speculators training, a few epochs), exported: its metrics are
    speculators' DSpark metrics, its blocks and confidence are speculators', and decoding with it is greedy decoding
    with drafts accepted."""
    from eagleflow.evaluate.prompts import held_out_prompts
    from eagleflow.metrics.records import read_records

    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    argv = [sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(tiny_model),
            "--out", str(tmp_path / "train"), "--aux-layer-ids", ",".join(map(str, AUX)), "--draft-algorithm", "dspark",
            "--num-layers", "2", "--block-size", str(GAMMA), "--markov-rank", "32", "--max-anchors", "64", "--total-seq-len", "256",
            "--num-workers", "0", "--lr", "3e-3", "--device", "cpu", "--mask-token-id", "0", "--epochs", "3"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(rf"dspark drafter: 2 layer\(s\), block {GAMMA}, mask token id 0 \(.*\), the full vocabulary of 1024", run.stdout)
    stored = json.loads((tmp_path / "train" / "train-config.json").read_text())  # what a resume compares
    assert (stored["markov_rank"], stored["markov_head_type"]) == (32, "vanilla")
    val = [r for r in read_records(tmp_path / "train" / "metrics.jsonl") if r["kind"] == "val"]
    assert len(val) == 3 and val[-1]["eal"] > 1.4, val[-1]  # speculators' expected accept length, the bonus included
    best = Path(json.loads((tmp_path / "train" / "result.json").read_text())["best_checkpoint"])
    manifest = export(ExportConfig(checkpoint=best, verifier=tiny_model, out=tmp_path / "exported"))["sglang"]
    assert (manifest["algorithm"], manifest["block_size"], manifest["markov_rank"]) == ("DSPARK", GAMMA + 1, 32)
    shutil.move(tmp_path / "exported", tmp_path / "drafter")  # a moved drafter folder serves its own files
    served = ServedDrafter.from_export(tmp_path / "drafter")
    model = target[0]
    # The served rows are the trained ones: speculators' own forward over the verifier's aux states, teacher-forced.
    ids = torch.tensor(prompts[3] + greedy(model, prompts[3], 16))
    trained = speculators_forward(best, model, ids)
    decoder = load_dspark_decoder(model, served.path, served.block_size - 1)
    with torch.no_grad(), decoder.capture() as hooks:
        model(input_ids=ids[None])
    cache = decoder.drafter.new_cache()
    decoder.drafter.add_context(hooks.aux(), torch.arange(len(ids)), cache)
    for anchor in range(len(ids) - GAMMA):
        hidden = decoder.drafter.block_hidden(int(ids[anchor]), anchor, GAMMA, cache)
        previous = ids[anchor : anchor + GAMMA].tolist()
        torch.testing.assert_close(decoder.drafter.markov_logits(hidden, previous), trained.logits[anchor], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decoder.drafter.confidence_logits(hidden, previous), trained.confidence[anchor], rtol=1e-4, atol=1e-4)
    # Decoding the verifier's own answers to held-out conversations: exactly greedy decoding, drafts accepted.
    completion = verify = 0
    for prompt in [p.input_ids for p in held_out_prompts(dataset, 0.9, 6)]:
        output, _, stats = decoder.generate(prompt, MAX_NEW_TOKENS, stop_ids(model), False)
        assert output == greedy(model, prompt, MAX_NEW_TOKENS, stop_ids(model))
        assert_counts(output, stats)
        completion, verify = completion + len(output), verify + stats.verify_ct
    print(f"trained DSpark: val eal {val[-1]['eal']:.3f}, served accept length {completion / verify:.3f} over {verify} verifies")
    assert completion / verify > 1.25, f"accept length {completion / verify:.2f}: the trained drafter's drafts are accepted"
    # The evaluation measures it and fits, on the held-out prompts, the confidence temperatures SGLang reads: the file
    # beside its report, the flag in the fastest config's SGLang flags, the calibration error before and after.
    from eagleflow.drafters.dspark.calibration import STS_FLAG, read_calibration
    from reference_engines import ENGINE_COMPUTE_FLAGS

    evaluate = [sys.executable, "-m", "eagleflow", "evaluate", "--dataset", str(dataset), "--verifier", str(tiny_model),
                "--drafter", str(tmp_path / "drafter"), "--train-dir", str(tmp_path / "train"), "--out", str(tmp_path / "eval"),
                "--eval-rows", "3", "--eval-max-new-tokens", "16", "--eval-sets", "heldout", "--eval-rounds", "1",
                "--eval-configs", f"1,1,1,{GAMMA + 1}", "--eval-server-extra-args=" + ",".join(ENGINE_COMPUTE_FLAGS)]
    measured = subprocess.run(evaluate, capture_output=True, text=True, timeout=900)
    assert measured.returncode == 0, measured.stdout[-3000:] + measured.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    calibration = report["calibration"]
    fitted = read_calibration(calibration["path"], GAMMA)
    assert calibration["records"] > 0 and len(fitted.ece_before) == len(fitted.ece_after) == GAMMA
    assert list(fitted.temperatures) == calibration["temperatures"] and "ECE per position" in measured.stdout
    # The drafter's config names the file in its SGLang flags (the fastest config is whichever the timing picks).
    flags = next(row["sglang_flags"] for row in report["sweep"] if row["config"] == f"1,1,1,{GAMMA + 1}")
    assert flags[flags.index(STS_FLAG) + 1] == calibration["path"], flags
