"""The reference engine's log-probability fields and ``/server_info``, as SGLang 0.5.20 answers them.

One engine subprocess serves the module over real HTTP; the expected values come from plain
``transformers`` (the same model, one forward, ``log_softmax`` of its logits), the expected shapes
from SGLang's ``logprob_result_processor.py`` and ``tokenizer_manager.add_logprob_to_meta_info``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from eagleflow.config import model_to_argv
from eagleflow.engine.process import Readiness, ServerInfo, check_ready, free_port, pid_alive, start_server, stop_server
from eagleflow.engine.reference_config import ReferenceEngineConfig

PROMPT = [1, 17, 230, 45, 99, 512, 7, 300, 301, 302]
TOP = 4


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    folder = tmp_path_factory.mktemp("logprob-engine")
    port = free_port()
    config = ReferenceEngineConfig(model=tiny_model, port=port, threads=1)
    argv = [sys.executable, "-m", "eagleflow", "serve-reference", *model_to_argv(config)]
    info = start_server(argv, {}, folder / "server.log", folder / "server.json", f"http://127.0.0.1:{port}", folder / "dumps")
    deadline = time.monotonic() + 120
    while check_ready(info).state is not Readiness.READY:
        assert time.monotonic() < deadline and pid_alive(info.pid), (folder / "server.log").read_text()[-3000:]
        time.sleep(0.3)
    yield info
    stop_server(info.pid, grace=10)


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> torch.Tensor:
    """``[T, V]`` log-softmax at every position of PROMPT, computed without the engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def generate(engine: ServerInfo, **fields: object) -> requests.Response:
    body = {"rid": "logprobs", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **fields}
    return requests.post(f"{engine.url}/generate", json=body, timeout=120)


def test_prompt_logprobs_have_sglangs_shape_and_the_models_values(engine: ServerInfo, expected: torch.Tensor) -> None:
    answer = generate(engine, return_logprob=True, logprob_start_len=0, top_logprobs_num=TOP)
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    # One [logprob, token_id, text] per prompt token; the first has no logprob (nothing predicts it).
    assert len(tokens) == len(tops) == len(PROMPT)
    assert tokens[0] == [None, PROMPT[0], None] and tops[0] is None
    for j in range(1, len(PROMPT)):
        logprob, token, text = tokens[j]
        assert token == PROMPT[j] and text is None
        assert logprob == pytest.approx(float(expected[j - 1, PROMPT[j]]), abs=2e-3)
        # The position before's best TOP tokens, best first.
        values, ids = torch.topk(expected[j - 1], TOP)
        assert [e[1] for e in tops[j]] == ids.tolist()
        assert [e[0] for e in tops[j]] == pytest.approx(values.tolist(), abs=2e-3)
        assert all(e[2] is None for e in tops[j])
    # The generated tokens: greedy picks, scored by the last prompt position, then by the decode step.
    output = answer.json()["output_ids"]
    assert output[0] == int(expected[-1].argmax())
    assert [e[1] for e in meta["output_token_logprobs"]] == output and meta["output_token_logprobs_length"] == 2
    assert meta["output_token_logprobs"][0][0] == pytest.approx(float(expected[-1].max()), abs=2e-3)
    assert len(meta["output_top_logprobs"]) == 2 and meta["output_top_logprobs"][0][0][1] == output[0]


def test_logprob_start_len_and_the_default(engine: ServerInfo, expected: torch.Tensor) -> None:
    meta = generate(engine, return_logprob=True, logprob_start_len=6).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[6:]
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_token_logprobs"][1][0] == pytest.approx(float(expected[6, PROMPT[7]]), abs=2e-3)
    assert "input_top_logprobs" not in meta  # top_logprobs_num 0
    # Without logprob_start_len SGLang scores the output tokens only.
    meta = generate(engine, return_logprob=True).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2
    # Without return_logprob there is no logprob field at all.
    assert not any("logprob" in key for key in generate(engine).json()["meta_info"])


def test_text_in_logprobs_is_each_token_decoded(engine: ServerInfo, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    meta = generate(engine, return_logprob=True, logprob_start_len=0, top_logprobs_num=1, return_text_in_logprobs=True).json()["meta_info"]
    assert [e[2] for e in meta["input_token_logprobs"]] == [tokenizer.decode([t]) for t in PROMPT]


def test_the_last_vocabulary_id_reads_0_as_sglang_clips_it(engine: ServerInfo, tiny_model: Path) -> None:
    from eagleflow.verifier.config import config_int

    last = config_int(tiny_model, "vocab_size") - 1
    body = {"input_ids": [1, last, 5], "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
    meta = requests.post(f"{engine.url}/generate", json=body, timeout=60).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [1, 0, 5]


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"return_logprob": True, "logprob_start_len": len(PROMPT) + 1},
         f"req.logprob_start_len={len(PROMPT) + 1} is higher than the number of input tokens"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num must be an integer >= 0"),
        ({"return_logprob": "yes"}, "return_logprob must be true or false"),
        ({"return_logprob": True, "token_ids_logprob": [5]}, "token_ids_logprob is not supported"),
    ],
)
def test_bad_logprob_fields_get_400(engine: ServerInfo, fields: dict[str, object], fragment: str) -> None:
    answer = generate(engine, **fields)
    assert answer.status_code == 400 and fragment in answer.json()["error"]["message"], answer.text


def test_server_info_names_sglangs_settings(engine: ServerInfo) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(f"{engine.url}{path}", timeout=30).json()
        assert info["tp_size"] == 1 and info["disable_radix_cache"] is True and info["chunked_prefill_size"] == -1
