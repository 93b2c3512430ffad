"""Regeneration through a real reference engine: the verifier's greedy answers, resumable, no dumps.

One reference engine (float32, so its greedy tokens are the ones ``transformers`` computes in this
process) serves the module, with a dump folder and aux layers like a run's engine: regeneration
requests must leave nothing in it while an extraction request still does. Each regeneration runs
``python -m eagleflow regenerate`` as its own process, the way the DAG's task runs it, so it can be
killed for real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import reference_engines
from training_data import AUX, THINKING_CONVERSATION, WEATHER_TOOLS

from eagleflow.data.regenerate import (
    CONVERSATIONS_FILE,
    SKIPPED_FILE,
    SUMMARY_FILE,
    RegenerateConfig,
    regenerate,
    row_file,
)
from eagleflow.demo.synthetic_data import generate_conversations
from eagleflow.engine.process import ServerInfo, stop_server
from eagleflow.errors import UserError
from eagleflow.engine.client import EngineClient
from eagleflow.extract.dump_wait import wait_for_dump
from eagleflow.extract.handoff_reader import FolderHandOff
from sglang_patch.handoff import STATUS_PREFIX, read_writer_statuses

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[3]
MAX_NEW_TOKENS = 24
# Small enough that multi-turn conversations outgrow it after a few answers, large enough for every first prompt.
SMALL_CONTEXT = 96


def launch_engine(model: Path, folder: Path, port: int | None = None, *extra: str) -> ServerInfo:
    """The reference engine as the launch step starts it (own session, log file), ready."""
    return reference_engines.launch_engine(model, folder / "dumps", folder / "server.log", *extra, aux=AUX, port=port)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    info = launch_engine(tiny_model, tmp_path_factory.mktemp("engine"))
    yield info
    stop_server(info.pid)


@pytest.fixture(scope="module")
def small_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """An engine whose context is :data:`SMALL_CONTEXT` tokens (SGLang's ``--context-length``)."""
    info = launch_engine(tiny_model, tmp_path_factory.mktemp("small-engine"), None, "--context-length", str(SMALL_CONTEXT))
    yield info
    stop_server(info.pid)


@pytest.fixture(scope="module")
def verifier(tiny_model: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model))


def write_conversations(path: Path, rows: int, seed: int) -> list[dict]:
    conversations = generate_conversations(rows, seed)
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return conversations


def regenerate_argv(data: Path, model: Path, out: Path, server: ServerInfo, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eagleflow", "regenerate", "--input", str(data), "--verifier", str(model), "--out", str(out),
            "--server", server.url, "--server-pid", str(server.pid), "--regen-max-new-tokens", str(MAX_NEW_TOKENS), *extra]


def run_regenerate(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def greedy_answer(verifier, messages: list[dict], max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The verifier's greedy continuation of ``messages``, by ``transformers.generate`` in this process."""
    model, tokenizer = verifier
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def prompt_tokens(verifier, messages: list[dict]) -> int:
    """Tokens of the prompt for the answer after ``messages`` (the chat template with the generation prompt)."""
    return len(verifier[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def dumps_in(server: ServerInfo) -> list[str]:
    """Dump and error files of requests; not the writer's own status and reserve files."""
    return sorted(p.name for p in Path(server.dump_dir).iterdir() if not p.name.startswith(STATUS_PREFIX))


def test_answers_are_the_verifiers_greedy_continuations_and_leave_no_dump(engine: ServerInfo, tiny_model: Path, verifier, tmp_path: Path) -> None:
    source = write_conversations(tmp_path / "chat.jsonl", rows=8, seed=5)
    assert any(sum(m["role"] == "assistant" for m in c["messages"]) > 1 for c in source), "no multi-turn conversation to test"
    out = tmp_path / "regenerated"

    done = run_regenerate(regenerate_argv(tmp_path / "chat.jsonl", tiny_model, out, engine, "--regen-concurrency", "3"))

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"conversations: 8/8 .*/s.* ETA", done.stdout), done.stdout  # the last progress line
    regenerated = [json.loads(line) for line in (out / CONVERSATIONS_FILE).read_text().splitlines()]
    assert [r["source_row"] for r in regenerated] == list(range(len(source)))
    changed = 0
    for original, new in zip(source, regenerated):
        assert [m["role"] for m in new["messages"]] == [m["role"] for m in original["messages"]]
        for turn, message in enumerate(new["messages"]):
            if message["role"] != "assistant":
                assert message == original["messages"][turn]
                continue
            # Each answer continues the conversation as regenerated so far, not the original.
            expected = greedy_answer(verifier, new["messages"][:turn])
            assert message["content"] == expected, f"row {new['source_row']} turn {turn}"
            changed += message["content"] != original["messages"][turn]["content"]
    assert changed, "every answer equals the dataset's: the test would pass without regeneration"
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["source"] == str(tmp_path / "chat.jsonl") and summary["rows"] == len(source)
    assert summary["regenerated"] == str(out / CONVERSATIONS_FILE)

    # Regeneration's prefills are extend passes like extraction's: only the rid keeps them out.
    # The writer publishes after the answer, so wait for a captured request's dump and for the
    # writer to hold nothing more: a regeneration dump, had one been queued, is on disk by then.
    rid, _ = EngineClient(engine.url, 60).generate(0, [5, 6, 7, 8])
    control = wait_for_dump(FolderHandOff(Path(engine.dump_dir)), rid, time.time(), 30.0, threading.Event(), print)
    deadline = time.monotonic() + 30
    while any(status.pending for status in read_writer_statuses(engine.dump_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dumps_in(engine) == [control.name], "a regeneration request left a dump (or the control request did not)"
    for name in dumps_in(engine):
        (Path(engine.dump_dir) / name).unlink()


@pytest.mark.e2e
def test_killed_run_resumes_without_redoing_finished_rows(engine: ServerInfo, tiny_model: Path, tmp_path: Path) -> None:
    source = write_conversations(tmp_path / "chat.jsonl", rows=24, seed=9)
    out = tmp_path / "regenerated"
    argv = regenerate_argv(tmp_path / "chat.jsonl", tiny_model, out, engine, "--regen-concurrency", "1")
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(list((out / "rows").glob("*.json"))) < 3:
        assert process.poll() is None, "regeneration ended before it could be killed"
        assert time.monotonic() < deadline, "no rows regenerated in 300 s"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "rows").glob("*.json")}
    assert 3 <= len(finished) < len(source), f"killed too late to test resuming: {len(finished)} rows done"
    assert not (out / CONVERSATIONS_FILE).exists()

    rerun = run_regenerate(argv)

    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"{len(finished)} already regenerated, {len(source) - len(finished)} to do" in rerun.stdout
    for name, identity in finished.items():
        path = out / "rows" / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity, f"{name} was redone"
    lines = (out / CONVERSATIONS_FILE).read_text().splitlines()
    assert [json.loads(line)["source_row"] for line in lines] == list(range(len(source)))
    assert not list(out.rglob("*.tmp*")), "a half-written file was left behind"


@pytest.mark.e2e
def test_engine_lost_mid_run_names_the_rows_and_a_rerun_after_restart_finishes(tiny_model: Path, tmp_path: Path) -> None:
    write_conversations(tmp_path / "chat.jsonl", rows=16, seed=3)
    out = tmp_path / "regenerated"
    server = launch_engine(tiny_model, tmp_path / "engine")
    port = int(server.url.rsplit(":", 1)[1])
    try:
        process = subprocess.Popen(
            regenerate_argv(tmp_path / "chat.jsonl", tiny_model, out, server, "--regen-concurrency", "1"),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 300
        while not list((out / "rows").glob("*.json")):
            assert process.poll() is None and time.monotonic() < deadline, "no row regenerated"
            time.sleep(0.05)
        os.killpg(server.pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        stop_server(server.pid)

    assert process.returncode == 2, stdout[-3000:] + stderr[-3000:]
    assert "could not be regenerated (row " in stderr and "refuses connections" in stderr, stderr
    assert f"kept in {out / 'rows'}" in stderr
    kept = len(list((out / "rows").glob("*.json")))
    assert 1 <= kept < 16

    restarted = launch_engine(tiny_model, tmp_path / "engine", port)
    try:
        rerun = run_regenerate(regenerate_argv(tmp_path / "chat.jsonl", tiny_model, out, restarted))
    finally:
        stop_server(restarted.pid)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"{kept} already regenerated" in rerun.stdout
    assert len((out / CONVERSATIONS_FILE).read_text().splitlines()) == 16


def test_rows_that_are_not_chat_rows_are_named_or_listed_when_skipped(tiny_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "mixed.jsonl"
    good = generate_conversations(1, seed=1)[0]
    data.write_text("\n".join([json.dumps(good), json.dumps({"input_ids": [1, 2, 3]}), "{not json", json.dumps(good)]) + "\n")
    cfg = RegenerateConfig(input=data, verifier=tiny_model, out=tmp_path / "out", server="http://127.0.0.1:9")

    with pytest.raises(UserError, match=r"2 row\(s\) of .*mixed\.jsonl cannot be regenerated \(row 1: no 'messages'.*row 2: "):
        regenerate(cfg)
    assert not (tmp_path / "out").exists(), "nothing is written before the input is known good"

    # With --skip-bad-rows and the good rows already done, nothing needs the (absent) engine.
    for row in (0, 3):
        row_file(cfg.out, row).parent.mkdir(parents=True, exist_ok=True)
        row_file(cfg.out, row).write_text(json.dumps({"source_row": row, "messages": good["messages"]}))
    summary = regenerate(cfg.model_copy(update={"skip_bad_rows": True}))

    assert summary["rows"] == 2 and summary["skipped_rows"] == 2
    skipped = [json.loads(line) for line in (cfg.out / SKIPPED_FILE).read_text().splitlines()]
    assert [s["row"] for s in skipped] == [1, 2] and "no 'messages'" in skipped[0]["reason"]
    assert [json.loads(line)["source_row"] for line in (cfg.out / CONVERSATIONS_FILE).read_text().splitlines()] == [0, 3]


def test_a_run_with_regeneration_prepares_the_regenerated_file_and_keeps_the_source(tiny_model: Path, tmp_path: Path) -> None:
    from eagleflow.run.pipeline import PipelineConfig

    params = {"model_path": str(tiny_model), "dataset_input": str(tmp_path / "chat.jsonl"), "output_root": str(tmp_path / "runs"),
              "run_name": "r", "regen_temperature": 0.7, "regen_max_new_tokens": 64, "regen_concurrency": 2}
    off = PipelineConfig.from_params(params)
    on = PipelineConfig.from_params({**params, "regenerate_responses": True})

    assert off.prepare_input == str(tmp_path / "chat.jsonl")
    assert on.prepare_input == str(on.layout.regenerated / CONVERSATIONS_FILE)
    cfg = on.regenerate_config("http://127.0.0.1:30000", 1234)
    assert cfg.input == tmp_path / "chat.jsonl" and cfg.out == on.layout.regenerated and cfg.verifier == tiny_model
    assert (cfg.regen_temperature, cfg.regen_max_new_tokens, cfg.regen_concurrency, cfg.server_pid) == (0.7, 64, 2, 1234)
    with pytest.raises(UserError, match="regen_concurrency"):
        PipelineConfig.from_params({**params, "regenerate_responses": True, "regen_concurrency": 0}).regenerate_config("u", None)


def test_a_conversation_that_outgrows_the_context_ends_at_its_last_turn_that_fit(
    small_engine: ServerInfo, tiny_model: Path, verifier, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_conversations(tmp_path / "chat.jsonl", rows=8, seed=9)
    cfg = RegenerateConfig(input=tmp_path / "chat.jsonl", verifier=tiny_model, out=tmp_path / "out", server=small_engine.url,
                           server_pid=small_engine.pid, regen_max_new_tokens=MAX_NEW_TOKENS, regen_concurrency=2)

    summary = regenerate(cfg)  # the engine refuses any request that does not fit: one would fail the step

    log = capsys.readouterr().out
    shortened = dropped = capped = 0
    for row, original in enumerate(source):
        record = json.loads(row_file(cfg.out, row).read_text())
        kept = record["messages"]
        assert [m["role"] for m in kept] == [m["role"] for m in original["messages"][: len(kept)]]
        answered = [turn for turn, m in enumerate(kept) if m["role"] == "assistant"]
        assert answered and record["max_new_tokens"] and len(record["max_new_tokens"]) == len(answered)
        for turn, asked in zip(answered, record["max_new_tokens"]):
            room = SMALL_CONTEXT - prompt_tokens(verifier, kept[:turn]) - 1
            # Each answer asked for what its prompt left, at most regen_max_new_tokens, and is the
            # verifier's greedy continuation with that budget.
            assert asked == min(MAX_NEW_TOKENS, room) >= 1, f"row {row} turn {turn}"
            assert kept[turn]["content"] == greedy_answer(verifier, kept[:turn], asked), f"row {row} turn {turn}"
            capped += asked < MAX_NEW_TOKENS
        cut = record.get("shortened")
        if cut is None:
            assert len(kept) == len(original["messages"])
            continue
        # Shortened: it ends at its last answer, and the next assistant turn's prompt really left no room.
        shortened += 1
        at = cut["at_message"]
        assert kept[-1]["role"] == "assistant" and original["messages"][at]["role"] == "assistant"
        assert all(m["role"] != "assistant" for m in original["messages"][len(kept):at])
        following = kept + original["messages"][len(kept):at]
        assert cut["prompt_tokens"] == prompt_tokens(verifier, following) >= SMALL_CONTEXT - 1
        assert cut["dropped_turns"] == sum(m["role"] == "assistant" for m in original["messages"][at:]) >= 1
        assert cut["dropped_messages"] == len(original["messages"]) - len(kept)
        dropped += cut["dropped_turns"]
    assert shortened >= 1 and capped >= 1, "no conversation outgrew the context: the test would pass without the cap"
    assert (summary["shortened_conversations"], summary["dropped_turns"], summary["capped_answers"]) == (shortened, dropped, capped)
    assert summary["rows"] == len(source) and summary["context_length"] == SMALL_CONTEXT
    assert json.loads((cfg.out / SUMMARY_FILE).read_text()) == summary
    lines = [json.loads(line) for line in (cfg.out / CONVERSATIONS_FILE).read_text().splitlines()]
    assert [line["messages"] for line in lines] == [json.loads(row_file(cfg.out, r).read_text())["messages"] for r in range(len(source))]
    assert f"context length {SMALL_CONTEXT} tokens (from {small_engine.url}/v1/models)" in log
    assert f"{shortened} shortened to fit the context ({dropped} turns dropped, {capped} answers capped)" in log


def test_a_conversation_whose_first_prompt_does_not_fit_is_a_bad_row(
    small_engine: ServerInfo, tiny_model: Path, verifier, tmp_path: Path
) -> None:
    good = generate_conversations(2, seed=5)
    too_long = {"messages": [{"role": "user", "content": "count from one to ninety: " + " ".join(map(str, range(1, 91)))},
                             {"role": "assistant", "content": "1 2 3"}]}
    first_prompt = prompt_tokens(verifier, too_long["messages"][:1])
    assert first_prompt >= SMALL_CONTEXT - 1, "the long row fits: the test would pass without the check"
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in (good[0], too_long, good[1])))
    cfg = RegenerateConfig(input=data, verifier=tiny_model, out=tmp_path / "out", server=small_engine.url,
                           server_pid=small_engine.pid, regen_max_new_tokens=MAX_NEW_TOKENS)

    reason = (f"its first prompt is {first_prompt} tokens, which leaves no room for an answer in the engine's context length "
              f"of {SMALL_CONTEXT} tokens")
    with pytest.raises(UserError, match=re.escape(f"1 row(s) of {data} cannot be regenerated (row 1: {reason}); --skip-bad-rows")):
        regenerate(cfg)
    assert not list(cfg.out.rglob("*.json")), "rows were regenerated before the bad row was found"

    summary = regenerate(cfg.model_copy(update={"skip_bad_rows": True}))

    assert summary["rows"] == 2 and summary["skipped_rows"] == 1
    assert [json.loads(line) for line in (cfg.out / SKIPPED_FILE).read_text().splitlines()] == [{"row": 1, "reason": reason}]
    assert [json.loads(line)["source_row"] for line in (cfg.out / CONVERSATIONS_FILE).read_text().splitlines()] == [0, 2]
    assert not row_file(cfg.out, 1).exists()


def test_a_thinking_tool_calling_conversation_trains_on_the_engines_own_ids(
    engine: ServerInfo, tiny_model: Path, verifier, tmp_path: Path
) -> None:
    """Regenerated through a thinking, tool-calling template: every assistant turn's training ids are the prompt ids
    the engine was sent and the ids it produced (end of turn included), masked on exactly those it produced,
    through regenerate -> prepare; the next prompts render the answers from their text, as a client would."""
    from eagleflow.data import dataset_table
    from eagleflow.data.prepare import PrepareConfig, prepare_dataset
    from eagleflow.demo.tiny_tokenizer import THINKING_CHAT_TEMPLATE, with_chat_template

    thinking = with_chat_template(tiny_model, tmp_path / "thinking-verifier", THINKING_CHAT_TEMPLATE)
    conversation = {"messages": THINKING_CONVERSATION, "tools": WEATHER_TOOLS}
    source = tmp_path / "thinking.jsonl"
    source.write_text(json.dumps(conversation) + "\n")
    out = tmp_path / "regenerated"
    regenerate(RegenerateConfig(input=source, verifier=thinking, out=out, server=engine.url, server_pid=engine.pid,
                                regen_max_new_tokens=MAX_NEW_TOKENS))
    turns = json.loads(row_file(out, 0).read_text())["turns"]
    assert len(turns) == 3
    model, tokenizer = verifier
    for turn in turns:  # what the engine produced: the verifier's greedy continuation of the ids it was sent
        with torch.inference_mode():
            greedy = model.generate(torch.tensor([turn["prompt_ids"]]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert turn["output_ids"] == greedy[0, len(turn["prompt_ids"]):].tolist()
    first_prompt = tokenizer.decode(turns[0]["prompt_ids"])
    assert '"name": "get_weather"' in first_prompt and first_prompt.endswith("<|im_start|>assistant\n")  # tools rendered, thinking on

    prepare_dataset(PrepareConfig(input=out / CONVERSATIONS_FILE, verifier=thinking, out=tmp_path / "dataset", max_len=4096))
    table = dataset_table(tmp_path / "dataset")
    rows = list(zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()))
    for turn in turns:
        sent, made = turn["prompt_ids"], turn["output_ids"]
        held = [(ids, mask) for ids, mask in rows if ids[: len(sent) + len(made)] == sent + made and all(mask[len(sent): len(sent) + len(made)])]
        assert held, "a turn's prompt and answer ids are not a training row's"
    assert sum(sum(mask) for _, mask in rows) == sum(len(t["output_ids"]) for t in turns)  # the mask: exactly what it produced
