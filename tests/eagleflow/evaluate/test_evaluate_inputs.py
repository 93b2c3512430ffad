"""Issue 48: the evaluation's inputs are checked before any engine starts, each fault named by its Param.

A prompt file's bad line (an int or a list for a content, a missing field, bad JSON) by its number
and field, never a ``TypeError`` under a traceback; ``eval_rows`` above what a prompt set holds by
the set and its size, never a silently smaller set; a prompt that cannot fit the engines' context
by its line and length; a serving config SGLang would refuse or serve as another (``1,3,4,0``) at
trigger time, by the rule it breaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.errors import UserError
from eagleflow.evaluate.prompt_file import MAX_NAMED, check_prompt_file, read_prompt_file
from eagleflow.evaluate.prompts import ChatPrompts, Room, file_prompts, humaneval_prompts
from eagleflow.export.step import ExportConfig, export
from eagleflow.run.pipeline import PipelineConfig

from training_data import random_speculators_checkpoint

FILE_LABEL = 'Param eval_prompts \\("Prompt file"\\)'
GOOD = json.dumps({"messages": [{"role": "user", "content": "Say hello."}]})
# The lines: a content that is an int, a list (multimodal parts); a message without content; a torn line.
BAD_LINES = {
    "int content": (json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": 7}]}),
                    "messages[1].content is an int, not a string"),
    "list content": (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
                     "messages[0].content is a list, not a string"),
    "missing field": (json.dumps({"messages": [{"role": "user"}]}), "messages[0] has no 'content'"),
    "bad JSON": ('{"messages": [{"role": "user", "content": "hi"}', "not JSON (Expecting ',' delimiter at column 48)"),
    "no conversation": (json.dumps({"prompt": "hi"}),
                        "no 'messages' (a conversation: a list of {'role', 'content'} objects) nor MT-bench's 'turns'"),
    "MT-bench turn": (json.dumps({"turns": ["a", None]}), "turns[1] is null, not a string"),
    "not an object": ("[1, 2]", "the line is a list, not an object with 'messages' or 'turns'"),
}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_of_the_prompt_file_is_named_by_its_number_and_field(case: str, tmp_path: Path) -> None:
    line, field = BAD_LINES[case]
    path = write_lines(tmp_path / "prompts.jsonl", [GOOD, "", line, GOOD])  # line 3: blank lines count in the numbering
    with pytest.raises(UserError) as info:
        read_prompt_file(path)
    assert str(info.value) == f'Param eval_prompts ("Prompt file") {path} line 3: {field}'


def test_every_bad_line_is_named_in_one_message_and_past_the_first_few_counted(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes("".join(line + "\n" for line in [GOOD, *(line for line, _ in BAD_LINES.values())]).encode() + b"\xff\xfe\n")
    with pytest.raises(UserError) as info:
        read_prompt_file(path)
    named = [f"line {i}: {field}" for i, (_, field) in enumerate(BAD_LINES.values(), start=2)][:MAX_NAMED]
    assert str(info.value) == f'Param eval_prompts ("Prompt file") {path} ' + "; ".join(named) + "; and 3 more bad lines"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match=r"line 2: not UTF-8 \(byte 0xff at byte 0\)$"):
        read_prompt_file(path)
    with pytest.raises(UserError, match=f"^{FILE_LABEL} {tmp_path}/none.jsonl: cannot read it \\(No such file or directory\\)$"):
        read_prompt_file(tmp_path / "none.jsonl")
    with pytest.raises(UserError, match="no prompt in it"):
        read_prompt_file(write_lines(tmp_path / "blank.jsonl", ["", "  "]))


def test_eval_rows_above_a_prompt_set_is_refused_naming_the_set_and_what_it_holds(random_tiny_model: Path, tmp_path: Path) -> None:
    chat = ChatPrompts(random_tiny_model)
    path = write_lines(tmp_path / "mt_bench.jsonl", [json.dumps({"turns": ["One?", "Two?"]}), GOOD])
    with pytest.raises(UserError) as info:
        file_prompts(chat, path, 3, "mt_bench")
    assert str(info.value) == (
        f'Param eval_rows ("Held-out prompts") 3: the prompt set mt_bench (Param eval_prompts ("Prompt file") {path}) holds '
        "only 2 prompts; lower eval_rows to at most 2 (it is the number of prompts of every prompt set)"
    )
    assert [p.row for p in file_prompts(chat, path, 2, "mt_bench")] == [1, 2]
    # The same checks without a tokenizer, cheap enough for a run's first task.
    with pytest.raises(UserError, match=r'^Param eval_rows \("Held-out prompts"\) 3: the prompt set mt_bench .* holds only 2'):
        check_prompt_file(path, 3)
    check_prompt_file(path, 2)
    check_prompt_file(None, 99)
    with pytest.raises(UserError, match=r'^Param eval_rows \("Held-out prompts"\) 165: the prompt set humaneval .* holds only 164'):
        humaneval_prompts(chat, 165)


def test_a_prompt_that_cannot_fit_the_engines_context_is_refused_with_its_line_and_length(
    random_tiny_model: Path, tmp_path: Path
) -> None:
    chat = ChatPrompts(random_tiny_model)
    # The engines' context: SGLang's derivation from the verifier's config, unless eval_server_extra_args sets one.
    derived = Room.of_engines(random_tiny_model, [], 16)
    assert (derived.context_length, derived.source) == (4096, f"derived from {random_tiny_model / 'config.json'} as SGLang derives it")
    room = Room.of_engines(random_tiny_model, ["--threads", "1", "--context-length", "64"], 16)
    assert room.context_length == 64 and "--context-length of Param eval_server_extra_args" in room.source
    long = "Tell me everything about " + "the weather in many towns " * 12
    path = write_lines(tmp_path / "p.jsonl", [GOOD, json.dumps({"messages": [{"role": "user", "content": long}]}),
                                              json.dumps({"turns": ["Hi.", "And?", "More?"]})])
    prompts = file_prompts(chat, path, 3)
    short, too_long, turns = prompts
    assert len(short.input_ids) + 16 < 64 <= len(too_long.input_ids) + 16
    room.check([short], chat, "the set", "line")  # fits: nothing said
    with pytest.raises(UserError) as info:
        room.check(prompts, chat, f'Param eval_prompts ("Prompt file") {path}', "line")
    needs = len(too_long.input_ids) + 16
    message = str(info.value)
    assert message.startswith(
        f'Param eval_prompts ("Prompt file") {path}: 2 of its 3 prompts do not fit the engines\' context length of 64 tokens '
        f'(--context-length of Param eval_server_extra_args ("Extra evaluation engine arguments")) with Param eval_max_new_tokens '
        f'("New tokens per prompt") 16: line 2 needs {needs} tokens, line 3 needs '
    ), message
    # A multi-turn prompt's last request holds the whole conversation and the earlier answers: 3 turns of 16 new tokens.
    assert room.tokens_needed(turns, chat) > len(turns.input_ids) + 3 * 16
    # An exact edge: a prompt and its answer must stay below the context (SGLang 0.5.10 refuses prompt + new = context).
    edge = Room(len(short.input_ids) + 16 + 1, "test", 16)
    edge.check([short], chat, "x", "line")
    with pytest.raises(UserError, match="line 1 needs"):
        Room(len(short.input_ids) + 16, "test", 16).check([short], chat, "x", "line")


def test_a_tree_config_without_its_size_is_refused_at_trigger_time_by_label_name_and_rule(tmp_path: Path) -> None:
    params = {"model_path": str(tmp_path), "dataset_input": str(tmp_path / "d.jsonl"), "output_root": str(tmp_path),
              "eval_configs": "1,3,1,4 1,3,4,0"}
    with pytest.raises(UserError) as info:
        PipelineConfig.from_params(params)
    assert str(info.value) == (
        "Param eval_configs (\"Serving configs to sweep\"): '1,3,4,0': --speculative-eagle-topk 4 needs "
        "--speculative-num-draft-tokens, the tree's size (2..37): SGLang has no default for a tree (0 is its 'not set'), "
        "and the tree's top-k draft selection cannot run without it (draft_algorithm eagle3)"
    )
    PipelineConfig.from_params({**params, "eval_configs": "1,3,1,4 1,3,4,8 1,3,4,37"})  # a tree of its size is fine


# ---- the evaluate step as the operator runs it: refused before any engine starts ------------------------------


@pytest.fixture(scope="module")
def drafter(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random drafter for the untrained tiny verifier, exported (no training needed: no engine runs)."""
    folder = tmp_path_factory.mktemp("evaluate-inputs")
    checkpoint = random_speculators_checkpoint(random_tiny_model, folder / "checkpoint", False, [2, 4, 5], 256, num_layers=1)
    export(ExportConfig(checkpoint=checkpoint, verifier=random_tiny_model, out=folder / "drafter"))
    return folder / "drafter"


def step_cases(folder: Path) -> dict[str, tuple[list[str], str]]:
    """Per fault: the flags that inject it and the one error line the step must print."""
    faults = ("int content", "list content", "missing field", "bad JSON")
    bad = write_lines(folder / "bad.jsonl", [GOOD] + [BAD_LINES[c][0] for c in faults])
    two = write_lines(folder / "two.jsonl", [GOOD, GOOD])
    long = write_lines(folder / "long.jsonl", [GOOD, json.dumps({"messages": [{"role": "user", "content": "word " * 80}]})])
    fields = "; ".join(f"line {n}: {BAD_LINES[c][1]}" for n, c in enumerate(faults, start=2))
    return {
        "bad lines": ([f"--eval-prompts={bad}"], f'error: Param eval_prompts ("Prompt file") {bad} {fields}'),
        "eval_rows above the file": (
            [f"--eval-prompts={two}", "--eval-rows", "3"],
            f'error: Param eval_rows ("Held-out prompts") 3: the prompt set two (Param eval_prompts ("Prompt file") {two}) '
            "holds only 2 prompts",
        ),
        "prompt too long": (
            [f"--eval-prompts={long}", "--eval-server-extra-args=--threads,1,--context-length,64"],
            f'error: Param eval_prompts ("Prompt file") {long}: 1 of its 2 prompts do not fit the engines\' context length '
            "of 64 tokens (--context-length of Param eval_server_extra_args",
        ),
        "tree without its size": (
            [f"--eval-prompts={two}", "--eval-configs", "1,3,4,0"],
            "error: --eval-configs: '1,3,4,0': draft tokens must be >= 2 with a drafter",
        ),
    }


@pytest.mark.parametrize("case", ["bad lines", "eval_rows above the file", "prompt too long", "tree without its size"])
def test_the_step_refuses_bad_inputs_with_one_line_before_any_engine_starts(
    drafter: Path, random_tiny_model: Path, tmp_path: Path, case: str
) -> None:
    flags, error = step_cases(tmp_path)[case]
    out = tmp_path / "eval"
    argv = [sys.executable, "-m", "eagleflow", "evaluate", "--dataset", str(tmp_path / "no-dataset"),
            "--verifier", str(random_tiny_model), "--drafter", str(drafter), "--out", str(out), "--train-data-ratio", "0.5",
            "--eval-sets=file", "--eval-rows", "2", "--eval-max-new-tokens", "16", *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), proc.stderr
    # No engine was started: none has a folder (running_engine makes it first), the sweep never announced itself.
    assert not list(out.glob("engine-*")) and "evaluate: prompt sets" not in proc.stdout
