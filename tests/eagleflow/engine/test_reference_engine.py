"""The reference engine: SGLang's API subset over real HTTP, and dumps equal to independently computed states.

One engine subprocess (short warmup, row 7 failing once: ``fail_row`` in ``EAGLEFLOW_TEST_FAULTS``) serves the whole module; the tests run
in file order, so the first one sees the warmup's 503s. The independent states come from plain
``transformers``: ``output_hidden_states`` for the state entering layer k (recorded from layer
*outputs*, not the engine's pre-hooks) and, for the final pre-norm slot, the same model with its
final norm replaced by the identity.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from eagleflow.engine.capture import HiddenStateCapture, capture_hidden_states
from eagleflow.config import model_from_args
from eagleflow.errors import UserError
from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.reference.faults import fault_marker, faults_env
from eagleflow.engine.reference.protocol import READY_LINE
from eagleflow.engine.reference.server import serve
from eagleflow.extract.sample_store import load_sample, validate
from eagleflow.extract.dump_wait import wait_for_dump
from eagleflow.extract.handoff_reader import FolderHandOff
from sglang_patch.handoff import dump_path, error_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = [2, 4, 6]
N_LAYERS, HIDDEN, VOCAB = 8, 64, 1024
WARMUP_S = 4.0
FAIL_ROW = 7
REPO = Path(__file__).resolve().parents[3]


def random_ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (length,), generator=generator).tolist()


# ---- fixtures ---------------------------------------------------------------------------------


def _build_tiny_model(out: Path) -> Path:
    """The project's tiny verifier, untrained (fast); a bare random DeepSeek-V3 if that module is absent."""
    try:
        from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model
    except ImportError:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        torch.manual_seed(0)
        config = DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
            max_position_embeddings=512, dtype="bfloat16",
        )
        DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
        return out
    return make_tiny_model(
        TinyModelConfig(out=out, layers=N_LAYERS, hidden=HIDDEN, vocab=VOCAB, train_steps=0, corpus_rows=200, eval_rows=10)
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


class Engine:
    """A ``serve-reference`` subprocess whose output is collected line by line."""

    def __init__(self, model_dir: Path, dump_dir: Path, *extra: str, faults: dict[str, Any] | None = None) -> None:
        self.model_dir, self.dump_dir = model_dir, dump_dir
        argv = [sys.executable, "-m", "eagleflow", "serve-reference", "--model", str(model_dir),
                "--dump-dir", str(dump_dir), "--aux-layers", ",".join(map(str, AUX)), "--port", "0", "--threads", "1", *extra]
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **faults_env(**faults or {})}, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        match = self.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", timeout=90)
        self.url = match.group(1)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} (exit code {self.proc.poll()}); output:\n{self.log}")

    def get(self, path: str) -> requests.Response:
        """GET that retries while uvicorn is not yet accepting (the URL is printed just before)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                return requests.get(self.url + path, timeout=30)
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def post(self, body: object) -> requests.Response:
        # Python's own JSON (NaN and Infinity included, as a careless client sends them); requests' json= refuses those.
        data = json.dumps(body).encode()
        return requests.post(self.url + "/generate", data=data, headers={"content-type": "application/json"}, timeout=60)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/health_generate").status_code != 200:
            assert time.monotonic() < deadline, f"engine not ready after {timeout}s:\n{self.log}"
            time.sleep(0.2)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._reader.join(5)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    server = Engine(model_dir, tmp_path_factory.mktemp("dumps"), "--warmup-seconds", str(WARMUP_S), faults={"fail_row": [FAIL_ROW]})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def ready(engine: Engine) -> Engine:
    engine.wait_ready()
    return engine


def independent_states(model, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([seq, len(AUX)+1, hidden], post_norm_last)`` computed without the engine's hooks."""
    ids = torch.tensor([input_ids])
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
        # hidden_states[k] (k < n) is the output of layer k-1 = the state entering layer k.
        layer_inputs = [out.hidden_states[k][0] for k in AUX]
        post_norm_last = out.hidden_states[-1][0]  # transformers: the final norm's OUTPUT
        final_norm = model.model.norm
        model.model.norm = torch.nn.Identity()
        try:
            pre_norm_last = model.model(ids).last_hidden_state[0]  # now the last layer's output itself
        finally:
            model.model.norm = final_norm
    return torch.stack([*layer_inputs, pre_norm_last], dim=1).to(torch.bfloat16), post_norm_last


def landed(dump_dir: Path, rid: str) -> Path:
    """The dump of ``rid`` once the engine's writer published it (the answer does not wait for the disk)."""
    return wait_for_dump(FolderHandOff(dump_dir), rid, time.time(), 30.0, threading.Event(), print)


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


# ---- over HTTP ----------------------------------------------------------------------------------


def test_health_is_503_during_warmup_then_200(engine: Engine) -> None:
    # Runs first: the module's engine has just printed its URL and is inside its warmup.
    assert engine.get("/health").status_code == 503
    assert engine.get("/health_generate").status_code == 503
    info = engine.get("/model_info")  # SGLang answers this before warmup too
    assert info.status_code == 200
    assert info.json()["is_generation"] is True and info.json()["model_path"] == str(engine.model_dir)
    assert READY_LINE not in engine.log
    started = time.monotonic()
    engine.wait_ready()
    assert time.monotonic() - started < WARMUP_S + 5
    assert engine.get("/health").status_code == 200
    engine.wait_for(re.escape(READY_LINE), timeout=5)
    startup = engine.wait_for(r"aux layer ids \[2, 4, 6\] \+ final pre-norm state = 4 slots", timeout=1)
    assert "DeepseekV3ForCausalLM" in startup.string and "8 layers" in startup.string


def test_model_info_fields(ready: Engine) -> None:
    info = ready.get("/model_info").json()
    assert info["num_hidden_layers"] == N_LAYERS and info["hidden_size"] == HIDDEN and info["vocab_size"] == VOCAB
    assert info["aux_layer_ids"] == AUX and info["num_hidden_state_slots"] == 4
    assert info["architectures"] == ["DeepseekV3ForCausalLM"]
    assert ready.get("/get_model_info").json() == info  # SGLang's older name


def test_dump_equals_independent_transformers_states(ready: Engine, model) -> None:
    input_ids = random_ids(1, 23)
    rid = "row1-abc"
    answer = ready.post({"rid": rid, "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    assert meta["id"] == rid and meta["prompt_tokens"] == 23 and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == 0 and answer.json()["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}

    # Published by the writer right after the answer, with the §3.2 format.
    dump = landed(ready.dump_dir, rid)
    assert validate(dump, input_ids, n_slots=len(AUX) + 1, hidden=HIDDEN).ok
    states = load_sample(dump)["hidden_states"]

    expected, post_norm_last = independent_states(model, input_ids)
    assert_bf16_close(states, expected)
    # The slots are really different states (a bug filling every slot alike would fail here) …
    for a in range(states.shape[1]):
        for b in range(a + 1, states.shape[1]):
            assert not torch.allclose(states[:, a].float(), states[:, b].float(), atol=1e-2)
    # … and the final slot is the PRE-norm state: transformers' last hidden state (post-norm) differs,
    # and is exactly the final norm applied to our slot.
    assert not torch.allclose(states[:, -1].float(), post_norm_last.float(), rtol=0.1, atol=0.1)
    with torch.inference_mode():
        assert_bf16_close(model.model.norm(states[:, -1]), post_norm_last)


def test_one_greedy_token_matches_the_model(ready: Engine, model) -> None:
    input_ids = random_ids(2, 11)
    answer = ready.post({"rid": "row2-x", "input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    with torch.inference_mode():
        expected = int(model(torch.tensor([input_ids])).logits[0, -1].argmax())
    assert body["output_ids"] == [expected] and body["meta_info"]["completion_tokens"] == 1
    assert body["meta_info"]["finish_reason"]["type"] in {"length", "stop"}
    assert validate(landed(ready.dump_dir, "row2-x"), input_ids, 4, HIDDEN).ok  # prompt states only


def test_text_is_tokenized_with_the_models_tokenizer(ready: Engine, model_dir: Path) -> None:
    if not (model_dir / "tokenizer.json").exists():
        pytest.skip("the fallback random model has no tokenizer")
    from transformers import AutoTokenizer

    expected_ids = AutoTokenizer.from_pretrained(str(model_dir)).encode("two plus two is four")
    answer = ready.post({"rid": "text-1", "text": "two plus two is four", "sampling_params": {"max_new_tokens": 0}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["prompt_tokens"] == len(expected_ids)
    assert validate(landed(ready.dump_dir, "text-1"), expected_ids, 4, HIDDEN).ok


def test_vllm_prompt_token_ids_gets_sglangs_400(ready: Engine) -> None:
    answer = ready.post({"rid": "row3-v", "prompt_token_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}})
    assert answer.status_code == 400
    assert answer.json() == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
    assert not dump_path(ready.dump_dir, "row3-v").exists()


@pytest.mark.parametrize(("bad", "position"), [(VOCAB, 2), (-1, 4)])
def test_out_of_vocab_id_gets_400_naming_field_and_position(ready: Engine, bad: int, position: int) -> None:
    input_ids = random_ids(4, 6)
    input_ids[position] = bad
    answer = ready.post({"rid": "row4-o", "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert f"input_ids[{position}] = {bad}" in message and f"[0, {VOCAB})" in message and "row4-o" in message
    assert not dump_path(ready.dump_dir, "row4-o").exists()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([{"input_ids": [1]}], "list of requests is not supported"),
        ({"rid": "../escape", "input_ids": [1]}, "plain file name"),
        ({"rid": "r", "input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
        ({"rid": "r", "input_ids": [1, "2"]}, "input_ids[1] = '2' is not an integer"),
        ({"rid": "r", "input_ids": []}, "input_ids is empty"),
        ({"rid": "r", "input_ids": [1], "stream": True}, "stream is not supported"),
        # Non-finite sampling values (Python's JSON writes NaN and Infinity; 1e400 reads as Infinity).
        ({"rid": "r", "input_ids": [1], "sampling_params": {"temperature": float("nan")}},
         "sampling_params.temperature must be a finite number, got nan"),
        ({"rid": "r", "input_ids": [1], "sampling_params": {"temperature": float("inf")}}, "temperature must be a finite number"),
        ({"rid": "r", "input_ids": [1], "sampling_params": {"top_p": float("nan")}}, "sampling_params.top_p must be a finite"),
        # Bounded by what the engine can do: the context, a file name.
        ({"rid": "r", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}},
         "exceeds the model's maximum context length of 4096 tokens. You requested a total of 1000000002 tokens"),
        ({"rid": "r" * 300, "input_ids": [1]}, "is 300 bytes long; a dump file name holds at most 229"),
        ({"rid": "a\x00b", "input_ids": [1]}, "contains a control character"),
        ({"rid": "a\nb", "input_ids": [1]}, "contains a control character"),
    ],
)
def test_other_bad_requests_get_400(ready: Engine, body: object, fragment: str) -> None:
    answer = ready.post(body)
    assert answer.status_code == 400
    assert fragment in answer.json()["error"]["message"]
    assert not list(ready.dump_dir.glob("*escape*")) and not (ready.dump_dir.parent / "escape.safetensors").exists()


def test_the_context_length_is_reported_and_a_request_must_fit_in_it(ready: Engine, model_dir: Path) -> None:
    from eagleflow.engine.client import EngineClient
    from sglang_patch.request_ids import regenerate_request_id

    # The tiny verifier's config names only max_position_embeddings: SGLang's context length is it.
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    models = ready.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(model_dir)
    assert models["data"][0]["max_model_len"] == context and ready.get("/model_info").json()["context_length"] == context
    assert EngineClient(ready.url, 30).context_length() == context

    # SGLang's strictest supported rule: prompt + max_new_tokens < context; regeneration rids dump nothing.
    prompt = random_ids(9, context - 2)
    fits = ready.post({"rid": regenerate_request_id(90, 1), "input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert fits.status_code == 200 and len(fits.json()["output_ids"]) == 1
    over = ready.post({"rid": regenerate_request_id(90, 3), "input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert over.status_code == 400
    assert (f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested a total of "
            f"{context} tokens: {context - 2} tokens from the input messages and 2 tokens for the completion") in over.json()["error"]["message"]
    too_long = ready.post({"rid": regenerate_request_id(90, 5), "input_ids": random_ids(9, context), "sampling_params": {"max_new_tokens": 0}})
    assert too_long.status_code == 400
    assert f"The input ({context} tokens) is longer than the model's context length ({context} tokens)." in too_long.json()["error"]["message"]
    # Without max_new_tokens only the prompt is checked, as in SGLang.
    assert ready.post({"rid": regenerate_request_id(90, 7), "input_ids": prompt[:8]}).status_code == 200


def test_pathological_bodies_get_a_4xx_and_no_field_is_echoed_whole(ready: Engine) -> None:
    def post_raw(data: bytes) -> requests.Response:
        return requests.post(ready.url + "/generate", data=data, headers={"content-type": "application/json"}, timeout=60)

    deep = post_raw(b"[" * 200_000 + b"]" * 200_000)  # Python's parser gives up (RecursionError)
    assert deep.status_code == 400 and "nests deeper" in deep.json()["message"]
    huge = post_raw(b'{"rid": "r", "input_ids": [' + b"1," * 2_000_000 + b"1]}")
    assert huge.status_code == 413 and "larger than the engine's limit" in huge.json()["message"]
    # A 900 kB string where a token id belongs: named, quoted as an excerpt, in the answer and the log.
    answer = ready.post({"rid": "row5-big", "input_ids": [1, "x" * 900_000]})
    assert answer.status_code == 400 and len(answer.text) < 1000
    assert "input_ids[1] = 'xxxx" in answer.json()["error"]["message"] and "more characters" in answer.text
    answer = ready.post({"rid": "y" * 900_000, "input_ids": [1]})
    assert answer.status_code == 400 and len(answer.text) < 1000 and "bytes long" in answer.text
    time.sleep(0.5)
    assert max(len(line) for line in ready.lines) < 2000  # the log quotes excerpts too
    abort = requests.post(ready.url + "/abort_request", data=b"[" * 200_000, timeout=30)
    assert abort.status_code == 400
    assert ready.get("/health_generate").status_code == 200


def test_the_longest_rid_still_gets_its_dump(ready: Engine) -> None:
    from sglang_patch.request_ids import MAX_RID_BYTES

    rid = "row6-" + "é" * ((MAX_RID_BYTES - 5) // 2) + "a" * ((MAX_RID_BYTES - 5) % 2)
    assert len(rid.encode()) == MAX_RID_BYTES
    input_ids = random_ids(6, 7)
    answer = ready.post({"rid": rid, "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}})
    assert answer.status_code == 200, answer.text
    assert validate(landed(ready.dump_dir, rid), input_ids, 4, HIDDEN).ok


def test_health_answers_between_the_decode_steps_of_a_long_request(ready: Engine) -> None:
    prompt = random_ids(9, 8)

    def generate(tokens: int) -> float:
        began = time.monotonic()
        answer = ready.post({"rid": "HEALTH_CHECK_long", "input_ids": prompt,
                             "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}})
        assert answer.status_code == 200, answer.text
        return time.monotonic() - began

    per_token = generate(40) / 40
    # About 8 s of decoding, within the context by SGLang's strictest rule (prompt + max_new_tokens < context).
    tokens = min(4096 - len(prompt) - 1, max(200, int(8.0 / per_token)))
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(generate, tokens)
        time.sleep(1.0)
        waits = []
        for _ in range(4):
            began = time.monotonic()
            assert ready.get("/health_generate").status_code == 200
            waits.append(time.monotonic() - began)
            time.sleep(0.3)
        still_running = not long.done()
        long.result(timeout=120)
    assert still_running, "the long request ended before the probes; nothing was shown"
    assert max(waits) < 2.0, f"/health waited {max(waits):.1f}s behind one request ({tokens} tokens)"


def test_health_check_and_regeneration_requests_write_no_dump(ready: Engine) -> None:
    from sglang_patch.request_ids import regenerate_request_id

    before = set(os.listdir(ready.dump_dir))
    assert ready.get("/health_generate").status_code == 200  # runs a real HEALTH_CHECK_… request
    assert ready.get("/health").status_code == 200
    answer = ready.post({"rid": "HEALTH_CHECK_by_hand", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 1
    regen = ready.post({"rid": regenerate_request_id(7, 1), "input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}})
    assert regen.status_code == 200 and len(regen.json()["output_ids"]) == 2
    assert set(os.listdir(ready.dump_dir)) == before


def test_eight_concurrent_requests_each_get_their_own_states(ready: Engine, model) -> None:
    rows = {row: random_ids(100 + row, 5 + 3 * row) for row in range(10, 18)}

    def send(row: int) -> requests.Response:
        return ready.post({"rid": f"row{row}-c", "input_ids": rows[row], "sampling_params": {"max_new_tokens": 0}})

    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(rows, pool.map(send, rows)))
    for row, answer in answers.items():
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta_info"]["id"] == f"row{row}-c"
        dump = landed(ready.dump_dir, f"row{row}-c")
        assert validate(dump, rows[row], 4, HIDDEN).ok
        assert_bf16_close(load_sample(dump)["hidden_states"], capture_hidden_states(model, rows[row], AUX))


def test_fail_row_fails_once_across_restarts_and_sigterm_exits_0(ready: Engine, model_dir: Path) -> None:
    body = {"input_ids": random_ids(7, 9), "sampling_params": {"max_new_tokens": 0}}
    marker = fault_marker(ready.dump_dir, "fail", FAIL_ROW)
    assert not marker.exists()
    for attempt in ("a", "b"):  # while this engine lives, every attempt for the row fails
        answer = ready.post({**body, "rid": f"row{FAIL_ROW}-{attempt}"})
        assert answer.status_code == 500
        assert answer.json()["message"] == f"injected failure for row {FAIL_ROW} (fail_row)"
        assert not dump_path(ready.dump_dir, f"row{FAIL_ROW}-{attempt}").exists()
    assert marker.exists()
    assert ready.post({**body, "rid": "row70-a"}).status_code == 200  # only row 7, not rows starting with 7

    # A restarted engine finds the marker and serves row 7; row 8 (no marker) still fails once.
    restarted = Engine(model_dir, ready.dump_dir, faults={"fail_row": [FAIL_ROW, 8]})
    try:
        restarted.wait_ready()
        answer = restarted.post({**body, "rid": f"row{FAIL_ROW}-c"})
        assert answer.status_code == 200, answer.text
        assert validate(landed(ready.dump_dir, f"row{FAIL_ROW}-c"), body["input_ids"], 4, HIDDEN).ok
        assert restarted.post({**body, "rid": "row8-a"}).status_code == 500
    finally:
        code = restarted.stop(timeout=30)
    assert code == 0, restarted.log
    assert "reference engine stopped (signal SIGTERM)" in restarted.log
    assert not error_path(ready.dump_dir, f"row{FAIL_ROW}-c").exists()


# ---- in process -----------------------------------------------------------------------------------


def test_capture_function_matches_independent_states(model) -> None:
    input_ids = random_ids(5, 17)
    expected, _ = independent_states(model, input_ids)
    states = capture_hidden_states(model, input_ids, AUX)
    assert states.shape == (17, 4, HIDDEN) and states.dtype == torch.bfloat16
    assert_bf16_close(states, expected)
    # Layer id n is allowed: the last layer's output before the norm, the same as the final slot.
    both = capture_hidden_states(model, input_ids, [N_LAYERS])
    assert torch.equal(both[:, 0], both[:, 1]) and torch.equal(both[:, 1], states[:, -1])
    # The hooks are removed afterwards.
    assert all(not layer._forward_pre_hooks for layer in model.model.layers) and not model.model.norm._forward_pre_hooks


def test_capture_rejects_bad_layer_ids(model) -> None:
    with pytest.raises(ValueError, match=r"aux layer ids \[9\] are outside 0\.\.8"):
        HiddenStateCapture(model, [2, 9])
    with pytest.raises(ValueError, match="no aux layer ids"):
        HiddenStateCapture(model, [])
    with pytest.raises(ValueError, match=r"repeat \[2\]"):
        HiddenStateCapture(model, [2, 2])


def test_bad_flags_are_user_errors(model_dir: Path, tmp_path: Path) -> None:
    base = {"model": model_dir, "dump_dir": tmp_path / "d", "aux_layers": [2]}
    with pytest.raises(UserError, match="--port"):
        model_from_args(ReferenceEngineConfig, {**base, "port": 70000})
    with pytest.raises(UserError, match="--aux-layers"):
        model_from_args(ReferenceEngineConfig, {**base, "aux_layers": []})
    with pytest.raises(UserError, match="--aux-layers: .*repeat"):
        model_from_args(ReferenceEngineConfig, {**base, "aux_layers": [2, 2]})
    with pytest.raises(UserError, match=r"--aux-layers: aux layer ids \[9\] are outside 0\.\.8"):
        serve(ReferenceEngineConfig(**{**base, "aux_layers": [2, 9]}))
    with pytest.raises(UserError, match="--model: .*no config.json"):
        serve(ReferenceEngineConfig(**{**base, "model": tmp_path}))
    with pytest.raises(UserError, match="--context-length 8192 is more than the 4096 tokens the model's config allows"):
        serve(ReferenceEngineConfig(**{**base, "context_length": 8192}))


def test_port_in_use_is_a_user_error() -> None:
    from eagleflow.engine.reference.server import bind_socket

    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    try:
        with pytest.raises(UserError, match=r"--host/--port: cannot bind 127\.0\.0\.1:\d+"):
            bind_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


def test_cli_help_lists_the_flags_and_no_test_fault() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "eagleflow", "serve-reference", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for flag in ("--model", "--dump-dir", "--aux-layers", "--host", "--port", "--warmup-seconds", "--device"):
        assert flag in result.stdout
    assert "127.0.0.1" in result.stdout
    # Test-only faults come from EAGLEFLOW_TEST_FAULTS, never from the product's flags.
    for flag in ("--fail-row", "--nan-row", "--test-write-delay", "--capture-fault", "--min-request-seconds", "TEST ONLY"):
        assert flag not in result.stdout


def test_a_failing_forward_is_a_500_and_the_engine_recovers(model, tmp_path: Path) -> None:
    from eagleflow.engine.reference.protocol import RequestError
    from eagleflow.engine.reference.runner import ReferenceEngine

    engine = ReferenceEngine(model, None, ReferenceEngineConfig(model=tmp_path, dump_dir=tmp_path / "d", aux_layers=AUX))

    def explode(module, args, output):
        raise RuntimeError("simulated out of memory")

    handle = model.model.layers[3].register_forward_hook(explode)
    try:
        with pytest.raises(RequestError) as failed:
            engine.generate({"rid": "row5-f", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}})
    finally:
        handle.remove()
    assert failed.value.status == 500 and "forward failed: RuntimeError: simulated out of memory" in failed.value.message
    assert failed.value.body["code"] == 500
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)  # capture hooks removed
    answer = engine.generate({"rid": "row5-g", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}})
    assert answer["meta_info"]["prompt_tokens"] == 3
    engine.close()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["row5-g.safetensors"]


def test_config_round_trips_through_argv(tmp_path: Path) -> None:
    # The pipeline launches the engine with model_to_argv(ReferenceEngineConfig(...)).
    import argparse

    from eagleflow.config import model_to_argv
    from eagleflow.engine.reference.server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for config in (
        ReferenceEngineConfig(model=tmp_path, dump_dir=tmp_path / "d", aux_layers=AUX),
        ReferenceEngineConfig(model=tmp_path, dump_dir=tmp_path / "d", aux_layers=[1], port=0, warmup_seconds=2.5,
                              threads=1, trust_remote_code=True, context_length=64),
    ):
        assert model_from_args(ReferenceEngineConfig, parser.parse_args(model_to_argv(config))) == config
