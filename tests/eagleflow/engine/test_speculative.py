"""EAGLE-3 speculative decoding in the reference engine: lossless, measured, and worth training.

The engine runs in this process on the trained tiny verifier in float32 (so greedy decoding has
one answer whichever way the forward passes are grouped); the drafters are the session's trained
one (two epochs of ``eagleflow train``, served with SGLang) and speculators' untrained
initialisation of the same shape and vocabulary, both through ``eagleflow export``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagleflow.engine.reference.config import ReferenceEngineConfig
from eagleflow.engine.reference.protocol import RequestError
from eagleflow.engine.reference.runner import ReferenceEngine
from eagleflow.evaluate.prompts import Prompt, held_out_prompts
from eagleflow.export.step import ServedDrafter
from training_data import TrainedRun

MAX_NEW_TOKENS = 48
STEPS = 3


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def prompts(trained_run: TrainedRun) -> list[Prompt]:
    return held_out_prompts(trained_run.dataset, 0.9, 12)


def served(drafter_dir: Path) -> ServedDrafter:
    return ServedDrafter.from_export(drafter_dir, STEPS)


def engine(target: tuple[Any, Any], drafter: ServedDrafter | None, tmp: Path) -> ReferenceEngine:
    model, tokenizer = target
    config = ReferenceEngineConfig(model=tmp, dtype="float32")
    if drafter is not None:
        config = config.model_copy(update={
            "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": drafter.path,
            "speculative_num_steps": drafter.num_steps, "speculative_draft_window_size": drafter.window,
        })
    return ReferenceEngine(model, tokenizer, config)


def ask(engine: ReferenceEngine, prompt: Prompt, temperature: float = 0.0) -> dict[str, Any]:
    body = {"rid": f"prompt-{prompt.row}", "input_ids": prompt.input_ids,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": temperature}}
    return engine.generate(body)


def test_greedy_speculative_decoding_returns_exactly_greedy_decodings_tokens(target, exported_drafters, prompts, tmp_path: Path) -> None:
    plain, speculative = engine(target, None, tmp_path), engine(target, served(exported_drafters["trained"]), tmp_path)
    accepted = 0
    for prompt in prompts:
        expected, got = ask(plain, prompt), ask(speculative, prompt)
        assert got["output_ids"] == expected["output_ids"], prompt.row
        assert got["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        meta = got["meta_info"]
        # SGLang's fields, with SGLang's definitions.
        assert meta["completion_tokens"] == len(got["output_ids"])
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        assert meta["spec_num_proposed_drafts"] == STEPS * meta["spec_verify_ct"]
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
        assert 1.0 <= meta["spec_accept_length"] <= STEPS + 1
        assert "spec_verify_ct" not in expected["meta_info"]
        accepted += meta["spec_num_correct_drafts"]
    assert accepted > 0  # the drafts were really used, not only verified away


def mean_accept_length(engine: ReferenceEngine, prompts: list[Prompt]) -> float:
    return float(np.mean([ask(engine, p)["meta_info"]["spec_accept_length"] for p in prompts]))


def test_a_trained_drafter_is_accepted_clearly_more_than_an_untrained_one(target, exported_drafters, prompts, tmp_path: Path) -> None:
    trained = mean_accept_length(engine(target, served(exported_drafters["trained"]), tmp_path), prompts)
    untrained = mean_accept_length(engine(target, served(exported_drafters["untrained"]), tmp_path), prompts)
    assert untrained < 1.3, untrained
    assert trained > untrained + 0.3, (trained, untrained)


def test_sampling_requests_are_refused_on_a_speculative_engine(target, exported_drafters, prompts, tmp_path: Path) -> None:
    speculative = engine(target, served(exported_drafters["trained"]), tmp_path)
    with pytest.raises(RequestError, match="greedy only") as refused:
        ask(speculative, prompts[0], temperature=0.7)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"speculative_algorithm": "EAGLE3"}, "needs --speculative-draft-model-path"),
     ({"speculative_eagle_topk": 2}, "less than or equal to 1"),
     ({"speculative_num_steps": 3, "speculative_num_draft_tokens": 5}, "--speculative-num-steps \\+ 1 = 4"),
     ({"dump_dir": "/tmp/d"}, "--dump-dir and --aux-layers go together")],
)
def test_inconsistent_speculative_flags_are_refused(fields: dict[str, Any], message: str, tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        ReferenceEngineConfig(model=tmp_path, **fields)
