"""The sweep's configs, verdicts and prompt files: parsed as SpecForge's --config-list, judged against the accept length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.errors import UserError
from eagleflow.evaluate.config import EvaluateConfig
from eagleflow.evaluate.prompt_file import conversation_turns
from eagleflow.evaluate.prompts import ChatPrompts, file_prompts
from eagleflow.evaluate.sweep import ServeConfig, fastest_per_batch_size, interleaved_turns, parse_configs, verdict
from eagleflow.run.pipeline import PipelineConfig


def test_configs_parse_as_specforges_list_with_every_batch_sizes_baseline() -> None:
    configs = parse_configs("1,3,1,4 4,3,1,4 1,5,4,8 1,0,0,0", default_steps=3, default_concurrency=2)
    assert [c.label for c in configs] == ["1,0,0,0", "1,3,1,4", "1,5,4,8", "4,0,0,0", "4,3,1,4"]
    assert {c.shape for c in configs} == {(0, 0, 0), (3, 1, 4), (5, 4, 8)}  # one engine per shape
    # Empty: the drafter's own chain, one at a time and eval_concurrency in flight.
    assert [c.label for c in parse_configs("", 3, 2)] == ["1,0,0,0", "1,3,1,4", "2,0,0,0", "2,3,1,4"]
    assert ServeConfig(1, 5, 4, 8).sglang_flags("/d", 2048) == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d", "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", "--speculative-draft-window-size", "2048"]
    assert ServeConfig(1, 0, 0, 0).sglang_flags("/d") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [("1,3,1", "is not 'batch size,steps,topk,draft tokens'"), ("0,3,1,4", "batch size >= 1"),
     ("1,3,1,5", "steps \\+ 1 = 4 for a chain \\(topk 1\\): SGLang would serve 4 instead of 5"),
     ("1,3,1,0", "steps \\+ 1 = 4 for a chain"), ("1,2,2,8", "more than 1 \\+ the 6 candidates"), ("1,x,1,4", "is not"),
     # issue 48: topk 4 with 0 draft tokens ran as 3,4,4 and the report credited 1,3,4,0
     ("1,3,4,0", "topk 4 needs --speculative-num-draft-tokens, the tree's size \\(2..37\\): SGLang has no default for a tree"),
     ("1,3,4,1", "a tree verifies the bonus token and at least one draft \\(>= 2\\)")],
)
def test_a_bad_config_is_refused_naming_the_param(text: str, message: str, tmp_path: Path) -> None:
    params = {"model_path": str(tmp_path), "dataset_input": str(tmp_path / "d.jsonl"), "output_root": str(tmp_path),
              "eval_configs": f"1,3,1,4 {text}"}
    with pytest.raises(UserError, match=f'^Param eval_configs \\("Serving configs to sweep"\\): {text!r}.*{message}.*draft_algorithm eagle3'):
        PipelineConfig.from_params(params)


def test_a_speedup_above_the_accept_length_is_disturbed_never_a_result() -> None:
    fine = verdict([1.3, 1.5, 1.4], accept_length=1.8)
    assert fine["median"] == 1.4 and (fine["min"], fine["max"]) == (1.3, 1.5) and not fine["disturbed"]
    bad = verdict([9.03, 7.39, 1.2], accept_length=1.6)  # the figures beside an accept length of 1.60
    assert bad["median"] is None and bad["measured"] == 7.39 and bad["disturbed"] and bad["disturbed_rounds"] == [0, 1]
    rows = [
        {"config": "1,0,0,0", "batch_size": 1, "sglang_flags": [], "sets": {"a": {"speedup": verdict([1.0], None)}}},
        {"config": "1,3,1,4", "batch_size": 1, "sglang_flags": ["x"], "sets": {"a": {"speedup": fine}}},
        {"config": "1,5,4,8", "batch_size": 1, "sglang_flags": ["y"], "sets": {"a": {"speedup": bad}}},
    ]
    assert fastest_per_batch_size(rows) == {"1": {"config": "1,3,1,4", "mean_speedup": 1.4, "sglang_flags": ["x"]}}


def test_configs_of_one_batch_size_take_turns_slice_by_slice_in_alternating_order() -> None:
    base, chain, tree = ServeConfig(1, 0, 0, 0), ServeConfig(1, 3, 1, 4), ServeConfig(1, 3, 4, 8)
    turns = interleaved_turns([base, chain, tree], 4, round_=0)
    # Every config answers a slice before any goes on; the order reverses each slice.
    assert [(c.label, (s.start, s.stop)) for c, s in turns[:6]] == [
        ("1,0,0,0", (0, 1)), ("1,3,1,4", (0, 1)), ("1,3,4,8", (0, 1)), ("1,3,4,8", (1, 2)), ("1,3,1,4", (1, 2)), ("1,0,0,0", (1, 2))]
    for config in (base, chain, tree):  # each answers every prompt once
        assert [p for c, s in turns if c == config for p in range(s.start, s.stop)] == [0, 1, 2, 3]
    assert interleaved_turns([base, chain], 4, round_=1)[0][0] == chain  # rotated each round
    batched = interleaved_turns([ServeConfig(2, 0, 0, 0), ServeConfig(2, 3, 1, 4)], 5, round_=0)
    assert [(s.start, s.stop) for _, s in batched] == [(0, 2), (0, 2), (2, 4), (2, 4), (4, 5), (4, 5)]
    with pytest.raises(ValueError, match=r"batch sizes \[1, 2\]"):
        interleaved_turns([base, ServeConfig(2, 3, 1, 4)], 4, 0)


def test_prompt_files_take_conversations_and_mt_bench_turns_and_name_a_bad_line(tiny_model: Path, tmp_path: Path) -> None:
    assert conversation_turns({"turns": ["a", "b", "c"]}) == ([{"role": "user", "content": "a"}], ["b", "c"])
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"}]
    assert conversation_turns({"messages": messages}) == (messages[:2], ["q2"])
    chat = ChatPrompts(tiny_model)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"turns": ["Count to three."]}) + "\n\n" + json.dumps({"messages": [{"role": "assistant"}]}) + "\n")
    with pytest.raises(UserError, match=r"prompts.jsonl line 3: messages\[0\] has no 'content'$"):
        file_prompts(chat, path, 1)  # every line is checked, also those past eval_rows
    path.write_text(json.dumps({"turns": ["Count to three."]}) + "\n\n")
    (first,) = file_prompts(chat, path, 1)
    assert first.row == 1 and first.input_ids == chat.encode([{"role": "user", "content": "Count to three."}])
    with pytest.raises(ValueError, match="'file' prompt set .* and eval_prompts go together"):
        EvaluateConfig(dataset=tmp_path, verifier=tmp_path, drafter=tmp_path, out=tmp_path, eval_sets=["file"])
