"""Chat messages -> token ids and assistant loss mask, with the tokenizer's own chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagleflow.data.verifier import load_tokenizer
from eagleflow.errors import UserError

# Where a huge message is first cut before tokenizing (characters per wanted token): a token spans
# a few characters, so one cut usually holds every token kept; the cut doubles until it does.
CUT_CHARS_PER_TOKEN = 16


class ChatTokenizer:
    """Chat messages -> (token ids, assistant mask) with the tokenizer's own chat template.

    Templates that mark assistant text with ``{% generation %}`` give the mask directly. For
    others (most released models) the mask is derived by rendering growing prefixes of the
    conversation: the tokens an assistant turn adds after the generation prompt are its own.
    """

    def __init__(self, tokenizer_dir: Path, max_len: int | None = None) -> None:
        self.max_len = max_len
        try:
            self.tokenizer = load_tokenizer(tokenizer_dir)
        except Exception as exc:
            raise UserError(f"--verifier {tokenizer_dir}: cannot load a tokenizer: {exc}") from exc
        template = self.tokenizer.chat_template or ""
        if not template:
            raise UserError(f"--verifier {tokenizer_dir} has no chat template; give pre-tokenized input_ids instead")
        self.has_generation_markers = "{% generation %}" in template or "{%- generation %}" in template

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Token ids and assistant mask of ``messages``; with ``max_len``, at least their first ``max_len + 1``
        (more than that only when the row is that long), computed without tokenizing a huge message whole."""
        if self.max_len is None:
            return self._encode(messages)
        return self._first_tokens(messages, self.max_len + 1)

    def _first_tokens(self, messages: list[dict[str, Any]], limit: int) -> tuple[list[int], list[int]]:
        """The first ``limit`` ids and mask entries of ``messages``, tokenizing at most about twice what they span.

        A message of megabytes would take hundreds of times its size to tokenize (one token object
        per few characters), only to be cut at ``max_len``. So its content is cut at ``cut`` and at
        ``2 * cut`` characters: when both renderings agree on the first ``limit`` tokens, those are
        the full row's (the tokens after the cut, and what follows the cut message, are past them);
        otherwise the cut doubles, up to the whole row.
        """
        cut = CUT_CHARS_PER_TOKEN * limit
        while True:
            if all(len(m["content"]) <= 2 * cut for m in messages):
                return self._encode(messages)
            short = self._encode([{**m, "content": m["content"][:cut]} for m in messages])
            longer = self._encode([{**m, "content": m["content"][: 2 * cut]} for m in messages])
            if len(short[0]) >= limit and short[0][:limit] == longer[0][:limit] and short[1][:limit] == longer[1][:limit]:
                return short[0][:limit], short[1][:limit]
            cut *= 2

    def _encode(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        if self.has_generation_markers:
            encoded = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return list(encoded["input_ids"]), [int(m) for m in encoded["assistant_masks"]]
        return self._mask_by_prefixes(messages)

    def _ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
        )
        return list(encoded["input_ids"])

    def _mask_by_prefixes(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        ids = self._ids(messages, add_generation_prompt=False)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self._ids(messages[:i], add_generation_prompt=True))
            end = len(self._ids(messages[: i + 1], add_generation_prompt=False))
            for pos in range(start, min(end, len(ids))):
                mask[pos] = 1
        return ids, mask


class LazyChatTokenizer:
    """Loads the chat tokenizer on the first chat row, so token-id input needs no tokenizer."""

    def __init__(self, tokenizer_dir: Path, max_len: int | None = None) -> None:
        self.tokenizer_dir, self.max_len = tokenizer_dir, max_len
        self._chat: ChatTokenizer | None = None

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        if self._chat is None:
            self._chat = ChatTokenizer(self.tokenizer_dir, self.max_len)
        return self._chat(messages)
