"""Conversations as a thinking, tool-calling verifier serves them: every input format, the template's
switches, and a loss mask on exactly what the assistant generates, each turn in the context it was
generated in. The verifier's template is the tiny tokenizer's second one, which behaves as Qwen3's and
Kimi-K2.5's do (thinking kept only after the last user message, tool calls and results rendered).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from training_data import THINKING_CONVERSATION, WEATHER_TOOLS

from eagleflow.data import dataset_table
from eagleflow.data.chat_tokens import ChatTokenizer, render_ids
from eagleflow.data.conversation import Chat, chat_of
from eagleflow.data.prepare import BadRows, PrepareConfig, prepare_dataset
from eagleflow.demo.tiny_tokenizer import THINKING_CHAT_TEMPLATE, with_chat_template

TOOLS, THINKING = WEATHER_TOOLS, THINKING_CONVERSATION
# The same conversation without thinking, in ShareGPT's format and as messages.
SHAREGPT = [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "weather in Paris?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"from": "observation", "value": "sunny, 21 C"},
    {"from": "gpt", "value": "Sunny, 21 C."},
    {"from": "human", "value": "thanks"},
    {"from": "gpt", "value": "You are welcome."},
]
PLAIN = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in THINKING]


@pytest.fixture(scope="module")
def thinking_model(random_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(random_tiny_model, tmp_path_factory.mktemp("thinking") / "model", THINKING_CHAT_TEMPLATE)


def prepared_rows(source: Path, model: Path, out: Path, **settings: Any) -> list[tuple[list[int], list[int]]]:
    prepare_dataset(PrepareConfig(input=source, verifier=model, out=out, **{"max_len": 4096, **settings}))
    table = dataset_table(out)
    return [(list(map(int, ids)), list(map(int, mask))) for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist())]


def generated_text(tokenizer: Any, rows: list[tuple[list[int], list[int]]]) -> list[str]:
    """Each row's masked spans, decoded, in order."""
    spans = []
    for ids, mask in rows:
        run: list[int] = []
        for token, masked in zip([*ids, -1], [*mask, 0]):
            if masked:
                run.append(token)
            elif run:
                spans.append(tokenizer.decode(run))
                run = []
    return spans


def test_every_input_format_prepares_into_the_ids_and_mask_of_its_messages_row(thinking_model: Path, tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    alias = [{("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()} for m in THINKING]
    rows = [{"messages": THINKING, "tools": TOOLS}, {"messages": alias, "tools": json.dumps(TOOLS)},
            {"messages": PLAIN, "tools": TOOLS}, {"conversations": SHAREGPT, "tools": TOOLS}]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A Parquet file and a datasets folder hold every column in every row, null where a row does not use it.
    columnar = [{"messages": None, "conversations": None, **r, "tools": json.dumps(TOOLS)} for r in rows]
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(columnar), parquet)
    folder = tmp_path / "rows-folder"
    datasets.Dataset.from_list(columnar).save_to_disk(str(folder))

    by_jsonl = prepared_rows(jsonl, thinking_model, tmp_path / "from-jsonl")
    expected_thinking = ChatTokenizer(thinking_model).rows(Chat(THINKING, TOOLS))
    expected_plain = ChatTokenizer(thinking_model).rows(Chat(PLAIN, TOOLS))
    assert len(expected_thinking) == 2 and len(expected_plain) == 2  # the turns before "thanks" are rendered otherwise later
    assert by_jsonl == expected_thinking * 2 + expected_plain * 2  # reasoning is reasoning_content; ShareGPT is its messages row
    assert prepared_rows(parquet, thinking_model, tmp_path / "from-parquet") == by_jsonl
    assert prepared_rows(folder, thinking_model, tmp_path / "from-folder") == by_jsonl


def test_each_assistant_turn_is_trained_once_on_exactly_what_it_generated_where_it_was_generated(thinking_model: Path) -> None:
    chat = ChatTokenizer(thinking_model)
    rows = chat.rows(Chat(THINKING, TOOLS))
    assistant = [i for i, m in enumerate(THINKING) if m["role"] == "assistant"]
    for i in assistant:
        prompt, _ = render_ids(chat.tokenizer, Chat(THINKING, TOOLS), i, add_generation_prompt=True)
        turn, _ = render_ids(chat.tokenizer, Chat(THINKING, TOOLS), i + 1, add_generation_prompt=False)
        holders = [(ids, mask) for ids, mask in rows if ids[: len(turn)] == turn and any(mask[len(prompt): len(turn)])]
        assert len(holders) == 1, f"turn {i} is trained {len(holders)} times"  # once, after the very prompt it was sent
        ids, mask = holders[0]
        own = chat.tokenizer.decode([t for t, m in zip(ids[len(prompt): len(turn)], mask[len(prompt): len(turn)]) if m])
        thinking = f"<think>\n{THINKING[i]['reasoning_content']}\n</think>\n\n"
        assert own.startswith(thinking) and own.endswith("<|im_end|>"), own  # its thinking and its end of turn
    spans = generated_text(chat.tokenizer, rows)
    assert len(spans) == len(assistant)  # nothing else: no role header, tool result or system text is trained on
    assert all("<|im_start|>" not in s and "sunny, 21 C\n</tool_response>" not in s for s in spans), spans
    assert any(s.endswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>') for s in spans)


def test_the_template_switches_reach_every_rendering_and_the_prefilled_thinking_is_not_trained(
    thinking_model: Path, tmp_path: Path
) -> None:
    from eagleflow.data.regenerate import RegenerateConfig, Regenerator
    from eagleflow.evaluate.prompts import ChatPrompts

    off = {"enable_thinking": False}
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"messages": conversation}) + "\n")
    [(ids, mask)] = prepared_rows(source, thinking_model, tmp_path / "off", chat_template_kwargs=off)
    first = mask.index(1)
    tokenizer = ChatTokenizer(thinking_model).tokenizer
    assert tokenizer.decode(ids[:first]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # prefilled, in the prompt
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "hello<|im_end|>"
    # The same prompt ids from regeneration's and evaluation's renderings (the capture check sends the dataset's ids).
    regenerator = Regenerator.__new__(Regenerator)  # its prompt() needs no engine
    regenerator.cfg = RegenerateConfig(input=source, verifier=thinking_model, out=tmp_path / "r", server="http://127.0.0.1:9",
                                       chat_template_kwargs=off)
    regenerator.tokenizer = tokenizer
    assert regenerator.prompt(chat_of({"messages": conversation}), 1) == ids[:first]
    assert ChatPrompts(thinking_model, off).encode(conversation[:1]) == ids[:first]
    # Thinking on (the template's default): the prompt ends at the assistant's header and the (empty) thinking is
    # the assistant's own; the changed switch prepares the same folder again.
    [(on_ids, on_mask)] = prepared_rows(source, thinking_model, tmp_path / "off")
    prompt = ChatPrompts(thinking_model).encode(conversation[:1])
    assert on_ids == ids and on_mask.index(1) == len(prompt) < first
    assert tokenizer.decode([t for t, m in zip(on_ids, on_mask) if m]) == "<think>\n\n</think>\n\nhello<|im_end|>"


# ---- what the template cannot do (issue 55) -------------------------------------------------------


def run_prepare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``python -m eagleflow prepare-dataset ARGS``, in process: its exit code and stderr."""
    from eagleflow.__main__ import main as cli

    code = cli(["prepare-dataset", *args])
    return code, capsys.readouterr().err


def test_a_switch_the_template_never_reads_or_one_apply_chat_template_owns_is_refused_by_name(
    thinking_model: Path, random_tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagleflow.data import check_chat_template_kwargs
    from eagleflow.data.regenerate import RegenerateConfig, regenerate
    from eagleflow.errors import UserError

    check_chat_template_kwargs(thinking_model, {"enable_thinking": False})  # a switch it has
    check_chat_template_kwargs(random_tiny_model, {})
    with pytest.raises(UserError) as typo:  # the typo that prepared everything in thinking mode
        check_chat_template_kwargs(thinking_model, {"enable_thinkng": False})
    assert str(typo.value).startswith("Param chat_template_kwargs: the verifier's chat template never reads 'enable_thinkng'")
    assert "(did you mean 'enable_thinking'?); the switches it reads: enable_thinking" in str(typo.value)
    with pytest.raises(UserError, match="never reads 'enable_thinking'.*the switches it reads: none"):
        check_chat_template_kwargs(random_tiny_model, {"enable_thinking": True})  # a template without the switch
    for owned in ("add_generation_prompt", "tools", "tokenize", "return_dict", "continue_final_message", "documents", "messages"):
        with pytest.raises(UserError) as caught:
            check_chat_template_kwargs(thinking_model, {owned: True}, name='Param chat_template_kwargs ("Chat template switches")')
        assert str(caught.value).startswith(f"Param chat_template_kwargs (\"Chat template switches\"): '{owned}' is an argument of "
                                            "apply_chat_template itself"), str(caught.value)
    # Named templates (a dict: the default and tool_use, as save_pretrained writes them): a switch of either is read.
    named = with_chat_template(random_tiny_model, tmp_path / "named", (random_tiny_model / "chat_template.jinja").read_text())
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text(THINKING_CHAT_TEMPLATE)
    check_chat_template_kwargs(named, {"enable_thinking": True})
    with pytest.raises(UserError, match="never reads 'thinking'"):
        check_chat_template_kwargs(named, {"thinking": True})

    # Preparation and regeneration refuse it themselves, before reading a row, and nothing is written.
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"messages": PLAIN}) + "\n")
    for kwargs, said in [('{"enable_thinkng": false}', "the verifier's chat template never reads 'enable_thinkng'"),
                         ('{"add_generation_prompt": true}', "'add_generation_prompt' is an argument of apply_chat_template")]:
        code, err = run_prepare(capsys, "--input", str(source), "--verifier", str(thinking_model), "--out", str(tmp_path / "ds"),
                                "--chat-template-kwargs", kwargs)
        assert code == 2 and err.startswith(f"error: --chat-template-kwargs: {said}"), err
        assert "Traceback" not in err and not (tmp_path / "ds").exists()
    with pytest.raises(UserError, match="--chat-template-kwargs: the verifier's chat template never reads 'enable_thinkng'"):
        regenerate(RegenerateConfig(input=source, verifier=thinking_model, out=tmp_path / "regen", server="http://127.0.0.1:9",
                                    chat_template_kwargs={"enable_thinkng": False}))
    assert not (tmp_path / "regen").exists()


def test_a_tool_calling_row_the_template_cannot_render_is_named_and_skip_bad_rows_leaves_it_out(
    random_tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plain ChatML template reads every message's content: a tool call's null content fails inside it."""
    good = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"hello {i}"}]} for i in range(2)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [good[0], {"messages": THINKING, "tools": TOOLS}, good[1]]))
    args = ["--input", str(source), "--verifier", str(random_tiny_model), "--out", str(tmp_path / "ds")]
    code, err = run_prepare(capsys, *args)
    assert code == 2 and "Traceback" not in err and not (tmp_path / "ds").exists()
    assert ("row 1: the verifier's chat template cannot render it (TypeError: unsupported operand type(s) for +: 'NoneType' "
            "and 'str'); the row calls tools") in err, err
    code, err = run_prepare(capsys, *args, "--skip-bad-rows")
    assert code == 0, err
    alone = tmp_path / "good.jsonl"
    alone.write_text("".join(json.dumps(r) + "\n" for r in good))
    kept = prepared_rows(alone, random_tiny_model, tmp_path / "good", max_len=2048)
    table = dataset_table(tmp_path / "ds")
    assert list(zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist())) == kept  # the others, as alone
    [report] = [json.loads(line) for line in (tmp_path / "ds" / "bad_rows.jsonl").read_text().splitlines()]
    assert report["row"] == 1 and "cannot render it" in report["reason"]


def test_a_row_the_template_refuses_is_named_by_preparation_and_by_regeneration(random_tiny_model: Path, tmp_path: Path) -> None:
    """Gemma's template refuses a system turn with raise_exception (a Jinja TemplateError), as this one does."""
    from eagleflow.data.regenerate import RegenerateConfig, Regenerator

    no_system = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                 "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    model = with_chat_template(random_tiny_model, tmp_path / "no-system", no_system)
    answer = {"role": "assistant", "content": "ok"}
    rows = [{"messages": [*PLAIN[1:2], answer]}, {"messages": [*PLAIN[:2], answer]}]  # the second opens with a system turn
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reason = "the verifier's chat template cannot render it (TemplateError: System role not supported)"
    with pytest.raises(BadRows) as caught:
        prepare_dataset(PrepareConfig(input=source, verifier=model, out=tmp_path / "ds"))
    assert caught.value.errors == [(1, reason)]
    regenerator = Regenerator.__new__(Regenerator)  # first_prompt_problem() needs no engine, only its context length
    regenerator.cfg = RegenerateConfig(input=source, verifier=model, out=tmp_path / "r", server="http://127.0.0.1:9")
    regenerator.tokenizer, regenerator.context_length = ChatTokenizer(model).tokenizer, 4096
    assert [regenerator.first_prompt_problem(chat_of(r)) for r in rows] == [None, reason]
