"""The tiny verifier's tokenizer: byte-level BPE trained on the synthetic corpus, ChatML template.

The chat template's ``{% generation %}`` block gives ``return_assistant_tokens_mask`` the
assistant tokens: the tokens the verifier produces, which the drafter learns to predict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML. The assistant's content and its closing <|im_end|> are the generation: the tokens
# the verifier produces, which the drafter is trained to predict (the loss mask).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A thinking, tool-calling template that behaves as Qwen3's and Kimi-K2.5's do, for the same tokenizer:
# the tools listed in a system turn; an assistant turn after the last user message renders its thinking
# in <think></think> (empty when it has none), earlier ones drop it; tool calls as <tool_call> JSON; tool
# results in a tool turn; enable_thinking false prefills an empty <think></think> in the generation
# prompt (the engine then answers without thinking). {% generation %} marks what the assistant writes.
THINKING_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation %}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration %}"
    "{{- '\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def with_chat_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    """A copy of the model folder ``model_dir`` at ``out_dir`` (its weights linked, not copied) whose tokenizer
    renders chats with ``template``: the same verifier, another chat format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        target = out_dir / item.name
        if item.name in ("chat_template.jinja", "tokenizer_config.json") or target.exists():
            continue
        target.symlink_to(item.absolute())
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)  # the .jinja file is the template
    atomic_write_json(out_dir / "tokenizer_config.json", config)
    return out_dir


def train_tokenizer(text: str, vocab: int, out_dir: Path) -> Any:
    """Train a byte-level BPE tokenizer of exactly ``vocab`` tokens on ``text`` (conversations
    separated by blank lines), save it to ``out_dir`` and load it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # One conversation per item, in order: the trainer's input is the same every run.
    backend.train_from_iterator(text.split("\n\n"), trainer=trainer)
    # A small corpus can run out of merges before the vocabulary is full; reserved tokens fill
    # the rest (as large models do), so it has exactly ``vocab`` tokens, as the embedding table.
    missing = vocab - backend.get_vocab_size()
    if missing > 0:
        backend.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    tokenizer.save_pretrained(str(out_dir))
    # Name the class every transformers version knows (4.x has no "TokenizersBackend"), so the
    # same folder also loads in an SGLang image with an older transformers.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config.pop("backend", None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["additional_special_tokens"] = tokenizer_config.pop("extra_special_tokens", [IM_START, IM_END])
    atomic_write_json(config_path, tokenizer_config)
    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    if len(loaded) != vocab or [loaded.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] != list(range(5)):
        raise RuntimeError(f"tokenizer came out with {len(loaded)} tokens, expected {vocab} with specials at 0-4")
    return loaded


def encode_conversations(tokenizer: Any, conversations: list[dict]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, assistant_mask)`` of each conversation under the chat template."""
    encoded = []
    for conversation in conversations:
        out = tokenizer.apply_chat_template(
            conversation["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        encoded.append((list(out["input_ids"]), list(out["assistant_masks"])))
    return encoded
