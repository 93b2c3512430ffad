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

from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.reference.protocol import RequestError
from eagleflow.engine.reference.runner import ReferenceEngine
from eagleflow.evaluate.prompts import Prompt, held_out_prompts
from eagleflow.export.manifest import ServedDrafter
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


def engine(
    target: tuple[Any, Any], drafter: ServedDrafter | None, tmp: Path, topk: int = 1, draft_tokens: int | None = None
) -> ReferenceEngine:
    model, tokenizer = target
    config = ReferenceEngineConfig(model=tmp, dtype="float32")
    if drafter is not None:
        config = ReferenceEngineConfig(**{**config.model_dump(), **{
            "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": drafter.path,
            "speculative_num_steps": drafter.num_steps, "speculative_draft_window_size": drafter.window,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft_tokens,
        }})
    return ReferenceEngine(model, tokenizer, config)


def ask(engine: ReferenceEngine, prompt: Prompt, temperature: float = 0.0) -> dict[str, Any]:
    body = {"rid": f"prompt-{prompt.row}", "input_ids": prompt.input_ids,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": temperature}}
    return engine.generate(body)


@pytest.fixture(scope="module")
def greedy(target: tuple[Any, Any], prompts: list[Prompt], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The plain engine's answer to each prompt (greedy decoding): what every speculative engine here must give."""
    plain = engine(target, None, tmp_path_factory.mktemp("plain"))
    return [ask(plain, prompt) for prompt in prompts]


def lossless_answers(greedy: list[dict[str, Any]], speculative: ReferenceEngine, prompts: list[Prompt]) -> list[dict[str, Any]]:
    """The speculative engine's answers, each checked to be the plain engine's tokens and finish reason."""
    answers = []
    for prompt, expected in zip(prompts, greedy, strict=True):
        got = ask(speculative, prompt)
        assert got["output_ids"] == expected["output_ids"], prompt.row
        assert got["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        assert "spec_verify_ct" not in expected["meta_info"], "the plain engine does not speculate"
        answers.append(got)
    return answers


def test_greedy_speculative_decoding_returns_exactly_greedy_decodings_tokens(target, exported_drafters, prompts, greedy, tmp_path: Path) -> None:
    speculative = engine(target, served(exported_drafters["trained"]), tmp_path)
    assert speculative.model_info()["speculative_num_draft_tokens"] == STEPS + 1  # what a round verifies, as SGLang says
    accepted = 0
    for got in lossless_answers(greedy, speculative, prompts):
        meta = got["meta_info"]
        # SGLang's fields, with SGLang's definitions.
        assert meta["completion_tokens"] == len(got["output_ids"])
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        assert meta["spec_num_proposed_drafts"] == STEPS * meta["spec_verify_ct"]
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
        assert 1.0 <= meta["spec_accept_length"] <= STEPS + 1
        accepted += meta["spec_num_correct_drafts"]
    assert accepted > 0  # the drafts were really used, not only verified away


@pytest.mark.parametrize(("topk", "draft_tokens"), [(4, 8), (2, 6)])
def test_tree_drafts_return_exactly_greedy_decodings_tokens(target, exported_drafters, prompts, greedy, tmp_path: Path, topk, draft_tokens) -> None:
    tree = engine(target, served(exported_drafters["trained"]), tmp_path, topk=topk, draft_tokens=draft_tokens)
    assert tree.model_info()["speculative_num_draft_tokens"] == draft_tokens
    accepted = 0
    for got in lossless_answers(greedy, tree, prompts):
        meta = got["meta_info"]
        # SGLang's accept rate: correct drafts / (verify rounds x (draft tokens - 1)).
        assert meta["spec_num_proposed_drafts"] == (draft_tokens - 1) * meta["spec_verify_ct"]
        assert 1.0 <= meta["spec_accept_length"] <= STEPS + 1
        accepted += meta["spec_num_correct_drafts"]
    assert accepted > 0


def test_a_tree_of_8_is_accepted_at_least_as_long_as_a_chain_of_4(target, exported_drafters, prompts, tmp_path: Path) -> None:
    drafter = served(exported_drafters["trained"])
    chain = mean_accept_length(engine(target, drafter, tmp_path), prompts)
    tree = mean_accept_length(engine(target, drafter, tmp_path, topk=4, draft_tokens=8), prompts)
    print(f"accept length: chain (3, 1, 4) {chain:.3f}, tree (3, 4, 8) {tree:.3f}")
    assert tree >= chain, (tree, chain)


def test_the_tree_keeps_sglangs_best_candidates_and_accepts_the_targets_path() -> None:
    from eagleflow.drafters.eagle3.tree import select_tree

    # topk 2, steps 2: two first-level candidates (0, 1), then the 2x2 children of the frontier rows
    # (frontier = candidates 0 and 1: children 2, 3 of 0 and 4, 5 of 1), scored cumulatively.
    scores = torch.tensor([0.6, 0.3, 0.6 * 0.9, 0.6 * 0.05, 0.3 * 0.5, 0.3 * 0.4])
    tokens = [10, 11, 20, 21, 30, 31]
    parents = [-1, -1, 0, 0, 1, 1]
    tree = select_tree(scores, tokens, parents, 5)  # the best 4: candidates 0, 1, 2, 4 in candidate order
    assert tree.tokens[1:] == [10, 11, 20, 30] and tree.parents == [-1, 0, 0, 1, 2]
    assert tree.depths() == [0, 1, 1, 2, 2]
    assert tree.ancestors_mask().tolist()[4] == [True, False, True, False, True]  # node 4 (30) sees root, 11, itself
    # The target's greedy choice at each node: root -> 11 (accepted), then 30 (accepted), then 99 (bonus).
    assert tree.accept([11, 0, 30, 0, 99]) == [0, 2, 4]
    assert tree.accept([12, 0, 0, 0, 0]) == [0]
    # A child whose parent was not kept is never reachable (SGLang's kernel leaves it unlinked).
    orphan = select_tree(torch.tensor([0.5, 0.1, 0.45, 0.2]), [1, 2, 3, 4], [-1, -1, 0, 1], 3)
    assert orphan.parents == [-1, 0, 1]
    orphan = select_tree(torch.tensor([0.1, 0.5, 0.05, 0.45]), [1, 2, 3, 4], [-1, -1, 0, 0], 3)
    assert orphan.parents == [-1, 0, None] and orphan.accept([2, 4, 0]) == [0, 1]


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
     ({"speculative_eagle_topk": 2}, "needs --speculative-num-draft-tokens"),
     ({"speculative_eagle_topk": 2, "speculative_num_steps": 2, "speculative_num_draft_tokens": 8}, "more than 1 \\+ the 6 candidates"),
     ({"speculative_num_steps": 3, "speculative_num_draft_tokens": 5}, "--speculative-num-steps \\+ 1 = 4"),
     ({"dump_dir": "/tmp/d"}, "--dump-dir and --aux-layers go together")],
)
def test_inconsistent_speculative_flags_are_refused(fields: dict[str, Any], message: str, tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        ReferenceEngineConfig(model=tmp_path, **fields)
