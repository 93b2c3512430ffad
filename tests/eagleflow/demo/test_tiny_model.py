"""The tiny verifier: loads offline, is byte-reproducible, caches, masks assistant tokens, has learnt."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagleflow.__main__ import main as cli
from eagleflow.errors import UserError
from eagleflow.demo.synthetic_data import generate_conversations
from eagleflow.demo.tiny_model import RECORD_NAME, TinyModelConfig, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Small and quick: a handful of real training steps on a small corpus.
SMALL = dict(train_steps=3, batch_size=4, seq_len=64, corpus_rows=300, eval_rows=8)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    first = make_tiny_model(TinyModelConfig(out=root / "a", **SMALL))
    # The build fixes its own thread count: the caller's setting must not change a bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)
    try:
        again = make_tiny_model(TinyModelConfig(out=root / "b", **SMALL))
    finally:
        torch.set_num_threads(threads)
    other_seed = make_tiny_model(TinyModelConfig(out=root / "c", seed=1, **SMALL))
    return {"a": first, "b": again, "c": other_seed}


def test_loads_offline_with_the_auto_classes_and_runs(built: dict[str, Path]) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = built["a"]
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    config = model.config
    assert config.vocab_size == len(tokenizer) == 1024
    assert config.num_hidden_layers == 8 and config.hidden_size == 64
    assert (config.q_lora_rank, config.kv_lora_rank, config.first_k_dense_replace) == (32, 32, 1)
    assert (config.n_routed_experts, config.num_experts_per_tok) == (4, 2)
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert all(type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in layers[1:])
    assert model.dtype == torch.bfloat16

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        # What speculators reads from the verifier, as separate tensors.
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= keys
        assert handle.get_tensor("lm_head.weight").dtype == torch.bfloat16

    ids = tokenizer.apply_chat_template(generate_conversations(1, seed=5)[0]["messages"], return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model(**ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids["input_ids"].shape[1], 1024)
    assert len(out.hidden_states) == 9 and torch.isfinite(out.logits).all()

    record = json.loads((folder / RECORD_NAME).read_text())
    assert record["parameters"]["train_steps"] == 3 and "out" not in record["parameters"]
    assert record["final_train_loss"] > 0 and 0 <= record["eval_accuracy"] <= 1
    assert all(oct(p.stat().st_mode & 0o444) == "0o444" for p in folder.iterdir())  # readable by all


def test_same_seed_same_bytes_other_seed_other_bytes(built: dict[str, Path], tmp_path: Path) -> None:
    first, again, other = (files_of(built[k]) for k in "abc")
    # And from a fresh process through the CLI, as the pipeline runs it.
    flags = [item for key, value in SMALL.items() for item in ("--" + key.replace("_", "-"), str(value))]
    result = subprocess.run(
        [sys.executable, "-m", "eagleflow", "make-tiny-model", "--out", str(tmp_path / "cli"), *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"steps: 3/3 \(100%\) .* ETA 0s loss [\d.]+ \d+ tokens/s", result.stdout), result.stdout
    assert files_of(tmp_path / "cli") == first
    assert set(first) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                          "chat_template.jinja", "generation_config.json", RECORD_NAME}
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] != first["tokenizer.json"]


def test_chat_template_marks_exactly_the_assistant_tokens(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built["a"]))
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Count from 3 to 9."},
        {"role": "assistant", "content": "3 4 5 6 7 8 9"},
        {"role": "user", "content": "Say apple 3 times."},
        {"role": "assistant", "content": "apple apple apple"},
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask) and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "3 4 5 6 7 8 9<|im_end|>apple apple apple<|im_end|>"
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "Count from 3 to 9." in unmasked and "assistant" in unmasked and "3 4 5" not in unmasked
    assert tokenizer.decode(ids) == (
        "<|bos|><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nCount from 3 to 9.<|im_end|>\n"
        "<|im_start|>assistant\n3 4 5 6 7 8 9<|im_end|>\n<|im_start|>user\nSay apple 3 times.<|im_end|>\n"
        "<|im_start|>assistant\napple apple apple<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nCount from 3 to 9.<|im_end|>\n<|im_start|>assistant\n")
    special = [tokenizer.convert_tokens_to_ids(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")]
    assert special == [0, 1, 2, 3, 4] and tokenizer.pad_token_id == 0

    # Every synthetic conversation: the mask covers each assistant answer, and only those.
    for conversation in generate_conversations(40, seed=9):
        out = tokenizer.apply_chat_template(conversation["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        answers = "".join(m["content"] + "<|im_end|>" for m in conversation["messages"] if m["role"] == "assistant")
        assert tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]) == answers


def test_cached_build_is_reused_and_changed_parameters_rebuild(tmp_path: Path, capsys) -> None:
    config = TinyModelConfig(out=tmp_path / "m", train_steps=0, corpus_rows=200, eval_rows=4, layers=7)
    folder = make_tiny_model(config)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert make_tiny_model(config) == folder
    assert "nothing to do" in capsys.readouterr().out
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    (tmp_path / ".m.tmp-12345").mkdir()  # left by a build that was killed with SIGKILL
    make_tiny_model(config.model_copy(update={"vocab": 512}))  # replaces the earlier model in place
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(folder)).vocab_size == 512
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".m.lock") == ["m"]


def test_a_failed_build_leaves_no_model_and_a_foreign_folder_is_never_replaced(tmp_path: Path, monkeypatch) -> None:
    import eagleflow.demo.tiny_model as tiny_model

    def crash(config, folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny_model, "build", crash)
    with pytest.raises(RuntimeError, match="killed"):
        make_tiny_model(TinyModelConfig(out=tmp_path / "m", train_steps=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock"]  # no model, no half-built folder

    foreign = tmp_path / "real-model"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not a tiny model"):
        make_tiny_model(TinyModelConfig(out=foreign, train_steps=0))
    assert (foreign / "config.json").read_text() == "{}"


def test_a_terminated_cli_build_cleans_up_and_publishes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "m"
    flags = ["--train-steps", "100000", "--batch-size", "2", "--seq-len", "32", "--corpus-rows", "100", "--eval-rows", "2"]
    process = subprocess.Popen(
        [sys.executable, "-m", "eagleflow", "make-tiny-model", "--out", str(out), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        for line in process.stdout:  # training starts: the half-built folder exists
            if line.startswith("model:"):
                break
        assert list(tmp_path.glob(".m.tmp-*"))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--layers", "3"], "--layers must be at least 7"),
        (["--hidden", "60"], "--hidden 60 must be at least 8 and divisible by --heads 4"),
        (["--experts", "2", "--experts-per-token", "3"], "--experts-per-token 3 must be between 1 and --experts 2"),
        (["--vocab", "100"], "--vocab must be at least 300"),
        (["--train-steps", "-1"], "--train-steps must be at least 0"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    assert cli(["make-tiny-model", "--out", str(tmp_path / "m"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_trained_verifier_predicts_held_out_conversations(tiny_model: Path) -> None:
    """The default build (trained, cached under .cache/): confident where the drafter will learn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((tiny_model / RECORD_NAME).read_text())
    assert record["parameters"]["train_steps"] >= 100
    assert record["final_train_loss"] < 1.5 and record["eval_assistant_accuracy"] > 0.6

    # Measure it again independently, on conversations from a stream neither training nor the
    # build's own evaluation used, one at a time without padding.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()  # the bf16 weights
    hits = total = 0
    for conversation in generate_conversations(30, seed=12345):
        out = tokenizer.apply_chat_template(conversation["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, return_tensors="pt")
        with torch.no_grad():
            predicted = model(input_ids=out["input_ids"]).logits[0, :-1].argmax(-1)
        target = out["input_ids"][0, 1:]
        is_answer = out["assistant_masks"][0, 1:].bool()
        hits += int((predicted == target)[is_answer].sum())
        total += int(is_answer.sum())
    assert hits / total > 0.6, f"assistant-token greedy accuracy {hits / total:.2f}"

    # Stock phrases are learnt: greedy generation reproduces the answer template and stops.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi, my name is Alice."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    # The template is 17 tokens and <|im_end|> one more; the name the model says (it may not copy
    # "Alice") gets up to 6.
    generated = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:])
    assert re.fullmatch(r"Hello, \w+! Nice to meet you\. How can I help you today\?<\|im_end\|>.*", text, re.S), text
