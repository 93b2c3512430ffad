"""A conversation -> training rows (token ids, assistant loss mask), with the tokenizer's own chat template."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagleflow.data.conversation import Chat
from eagleflow.errors import UserError, excerpt
from eagleflow.verifier import load_tokenizer

# Where a huge message is first cut before tokenizing (characters per wanted token): a token spans
# a few characters, so one cut usually holds every token kept; the cut doubles until it does.
CUT_CHARS_PER_TOKEN = 16


Row = tuple[list[int], list[int]]  # token ids and the loss mask over them

# What transformers' render_jinja_template passes the template beside apply_chat_template's own arguments:
# a switch of this name collides with it (a TypeError) instead of reaching the template.
RENDER_ARGUMENTS = ("messages",)


class TemplateCannotRender(ValueError):
    """The chat template fails on a conversation (a Jinja error, or Python's raised inside it); ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The names the tokenizer's chat template reads from outside it (its switches among them), found in its source as
    transformers compiles it (jinja2's ``meta.find_undeclared_variables``); every named template's when it has several.

    :raises TemplateCannotRender: a template that does not parse.
    """
    import jinja2
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    templates = tokenizer.chat_template
    names: set[str] = set()
    for source in (templates.values() if isinstance(templates, dict) else [templates] if templates else []):
        try:  # the environment transformers renders with: its {% generation %} tag parses there
            names |= jinja2.meta.find_undeclared_variables(_compile_jinja_template(source).environment.parse(source))
        except jinja2.TemplateError as exc:
            raise TemplateCannotRender(f"the verifier's chat template does not parse ({type(exc).__name__}: {excerpt(exc)})") from exc
    return frozenset(names)


def template_switch_problem(tokenizer: Any, kwargs: Mapping[str, Any]) -> str | None:
    """Why ``kwargs`` are not switches of the tokenizer's chat template, naming the first key that is not, or None.

    A key ``apply_chat_template`` takes for itself is refused (eagleflow sets those for each rendering; as a switch
    it is a TypeError, or silently the row's tools); so is a key the template never reads, which would leave every
    row rendered in the template's default mode (``enable_thinkng`` for ``enable_thinking``).
    """
    owned = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} | set(RENDER_ARGUMENTS)
    for key in kwargs:
        if key in owned:
            return (f"{key!r} is an argument of apply_chat_template itself, which eagleflow sets for each rendering, not a "
                    "switch of the chat template; remove it")
    try:
        read = template_variables(tokenizer)
    except TemplateCannotRender as exc:
        return exc.reason
    switches = sorted(read - owned - set(tokenizer.special_tokens_map))
    for key in kwargs:
        if key not in read:
            close = difflib.get_close_matches(key, switches, n=1)
            return (f"the verifier's chat template never reads {key!r}: the switch would change nothing, every row would be "
                    "rendered as without it" + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; the switches it reads: {', '.join(switches) if switches else 'none'}")
    return None


def check_chat_template_kwargs(model_path: Path, kwargs: Mapping[str, Any], name: str = "Param chat_template_kwargs") -> None:
    """Refuse switches the verifier's chat template does not have (:func:`template_switch_problem`), before any row is
    rendered: a typo would otherwise prepare, regenerate and evaluate everything in the template's default mode.

    Loads the verifier's tokenizer (its local files; importing transformers is most of the cost), only when
    ``kwargs`` has a key. ``name`` is how the caller's user spelled the setting: a Param or a flag.

    :raises UserError: starting with ``name``, naming the key and why.
    """
    if not kwargs:
        return
    try:
        tokenizer = load_tokenizer(model_path)
    except Exception as exc:
        raise UserError(f"{name}: cannot load the tokenizer of {model_path} to check the switches: {excerpt(exc)}") from exc
    if not tokenizer.chat_template:
        raise UserError(f"{name}: {model_path} has no chat template, so the switches {sorted(kwargs)} would change nothing")
    if problem := template_switch_problem(tokenizer, kwargs):
        raise UserError(f"{name}: {problem} (verifier {model_path})")


class ChatTokenizer:
    """A conversation -> training rows (token ids, loss mask on the tokens the assistant generates), with the
    tokenizer's own chat template and the run's switches for it (``chat_template_kwargs``).

    Each assistant turn's own tokens are those its rendering adds after the prompt it was generated from
    (the messages before it and the generation prompt: what the engine was sent), through its end of turn;
    a template that marks them with ``{% generation %}`` narrows that to the marked tokens (role headers
    and a prompt's prefilled ``<think></think>`` are never trained on). Where the whole conversation renders
    a turn as it was generated, the turn is masked in the conversation's row. A template that renders an
    earlier turn differently once the conversation goes on (Qwen3's and Kimi-K2.5's drop the thinking of
    turns before the last user message) would train that turn out of the context it was generated in: it
    is trained in a row of the conversation up to it instead, which also holds, masked, the turns before
    it that it renders as generated (one extra row per user message after which thinking is dropped, not
    one per turn).
    """

    def __init__(self, tokenizer_dir: Path, max_len: int | None = None, template_kwargs: dict[str, Any] | None = None) -> None:
        self.max_len = max_len
        self.template_kwargs = dict(template_kwargs or {})
        try:
            self.tokenizer = load_tokenizer(tokenizer_dir)
        except Exception as exc:
            raise UserError(f"--verifier {tokenizer_dir}: cannot load a tokenizer: {exc}") from exc
        template = self.tokenizer.chat_template or ""
        if not template:
            raise UserError(f"--verifier {tokenizer_dir} has no chat template; give pre-tokenized input_ids instead")
        self.has_generation_markers = "{% generation %}" in template or "{%- generation %}" in template

    def first_assistant_token(self, chat: Chat) -> int | None:
        """Where the conversation's first trained token lies in the row that holds it (None: the template marks no token
        of it), tokenizing about twice that far, not the whole row: why a row has no trained token within ``max_len``."""
        chat = Chat(chat.messages, chat.tools, {**self.template_kwargs, **chat.kwargs})
        limit = 2 * (self.max_len or 1024)
        while True:
            rows = self._first_tokens(chat, limit)
            first = [mask.index(1) for _, mask in rows if 1 in mask]
            if first or all(len(ids) < limit for ids, _ in rows):  # found, or every row whole
                return min(first, default=None)
            limit *= 2

    def __call__(self, messages: list[dict[str, Any]]) -> Row:
        """The one row of ``messages`` under a template that renders every turn as it was generated."""
        rows = self.rows(Chat(messages))
        if len(rows) != 1:
            raise ValueError(f"the chat template renders earlier turns differently later: {len(rows)} rows, use rows()")
        return rows[0]

    def rows(self, chat: Chat) -> list[Row]:
        """The conversation's training rows: its whole rendering, then one per turn it renders otherwise later.
        With ``max_len``, each row's first ``max_len + 1`` tokens (more only when the row is that long),
        computed without tokenizing a huge message whole."""
        chat = Chat(chat.messages, chat.tools, {**self.template_kwargs, **chat.kwargs})
        if self.max_len is None:
            return self._rows(chat)
        return self._first_tokens(chat, self.max_len + 1)

    def _first_tokens(self, chat: Chat, limit: int) -> list[Row]:
        """The first ``limit`` ids and mask entries of each row, tokenizing at most about twice what they span.

        A message of megabytes would take hundreds of times its size to tokenize (one token object
        per few characters), only to be cut at ``max_len``. So its text is cut at ``cut`` and at
        ``2 * cut`` characters: when both renderings agree on each row's first ``limit`` tokens (or
        on the whole of a shorter row), those are the full rows' (the tokens after the cut, and what
        follows the cut message, are past them); otherwise the cut doubles, up to the whole row.
        """
        cut = CUT_CHARS_PER_TOKEN * limit
        while True:
            if all(len(text) <= 2 * cut for m in chat.messages for text in _texts(m)):
                return [(ids[:limit], mask[:limit]) for ids, mask in self._rows(chat)]
            short, longer = self._rows(_cut(chat, cut)), self._rows(_cut(chat, 2 * cut))
            if len(short) == len(longer) and all(
                a[0][:limit] == b[0][:limit] and a[1][:limit] == b[1][:limit] and (len(a[0]) >= limit or a == b)
                for a, b in zip(short, longer)
            ):
                return [(ids[:limit], mask[:limit]) for ids, mask in short]
            cut *= 2

    def _render(self, chat: Chat, upto: int, add_generation_prompt: bool) -> tuple[list[int], list[int] | None]:
        return render_ids(self.tokenizer, chat, upto, add_generation_prompt, self.has_generation_markers)

    def _rows(self, chat: Chat) -> list[Row]:
        """The whole conversation's row, masked on each turn it renders as generated; then, latest first, the
        rendering up to a turn it does not (masked on every turn left that it renders as generated), until
        every assistant turn is trained once, in the context it was generated in."""
        whole, _ = self._render(chat, len(chat.messages), add_generation_prompt=False)
        turns: list[Row] = []  # each assistant turn: the conversation up to it as generated, masked on it
        for i, message in enumerate(chat.messages):
            if message["role"] != "assistant":
                continue
            prompt, _ = self._render(chat, i, add_generation_prompt=True)
            turn, marks = self._render(chat, i + 1, add_generation_prompt=False)
            start = _common_prefix(prompt, turn)  # the prompt as sent; a template may render it a little otherwise
            turns.append((turn, [int(start <= pos and (marks is None or bool(marks[pos]))) for pos in range(len(turn))]))
        return rows_of_turns(turns, whole)


def rows_of_turns(turns: list[Row], whole: list[int] | None = None) -> list[Row]:
    """Training rows holding every assistant turn once, in the context it was generated in.

    ``turns``: each turn's ids up to its end (as it was generated: the prompt it was sent, then its own
    tokens) and the mask of its own tokens. A row is ``whole`` (the conversation as rendered), then,
    latest first, a turn's ids; each row is masked on every turn not yet trained whose ids it starts with.
    A template that renders each turn as generated gives one row; one that drops earlier turns' thinking,
    one more per turn it drops it from that no later row holds as generated.
    """
    rows: list[Row] = []
    for candidate in ([whole] if whole is not None else []) + [ids for ids, _ in reversed(turns)]:
        inside = [t for t in turns if candidate[: len(t[0])] == t[0]]
        if not inside:
            continue
        mask = [0] * len(candidate)
        for ids, own in inside:
            mask[: len(ids)] = [a | b for a, b in zip(mask, own)]
        rows.append((candidate, mask))
        turns = [t for t in turns if not any(t is i for i in inside)]
    return [row for row in rows if any(row[1])]


def render_ids(
    tokenizer: Any, chat: Chat, upto: int, add_generation_prompt: bool, marks: bool = False
) -> tuple[list[int], list[int] | None]:
    """Ids of ``chat``'s first ``upto`` messages under the tokenizer's chat template, with the chat's tools and
    switches, and (``marks``, without the generation prompt) the template's ``{% generation %}`` marks over them.

    The one rendering of a conversation: preparation, regeneration and evaluation's prompts all call it, so
    the same conversation and switches give the same ids wherever they are rendered.
    """
    import jinja2

    marks = marks and not add_generation_prompt
    try:
        encoded = tokenizer.apply_chat_template(
            chat.messages[:upto], tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt,
            **({"return_assistant_tokens_mask": True} if marks else {}), **chat.template_kwargs(),
        )
    # What a template's own failure raises: its raise_exception (TemplateError), Python's inside it ('None + str' of a
    # template without tool support reading a tool call's null content: TypeError), transformers' checks (ValueError).
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise TemplateCannotRender(render_failure(chat, exc)) from exc
    return list(encoded["input_ids"]), ([int(m) for m in encoded["assistant_masks"]] if marks else None)


def render_failure(chat: Chat, exc: BaseException) -> str:
    """Why the chat template cannot render ``chat``, in a row's words: the template's error, and the likely cause
    when the conversation calls tools."""
    tools = chat.tools or any(m.get("tool_calls") or m["role"] == "tool" for m in chat.messages)
    return (f"the verifier's chat template cannot render it ({type(exc).__name__}: {excerpt(exc)})"
            + ("; the row calls tools (tools, tool_calls with null content, tool turns), which a template without tool "
               "support cannot render" if tools else ""))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _texts(message: dict[str, Any]) -> list[str]:
    return [message[key] for key in ("content", "reasoning_content") if isinstance(message.get(key), str)]


def _cut(chat: Chat, chars: int) -> Chat:
    """``chat`` with each message's content and thinking cut to ``chars`` characters."""
    cut = [{**m, **{k: m[k][:chars] for k in ("content", "reasoning_content") if isinstance(m.get(k), str)}} for m in chat.messages]
    return Chat(cut, chat.tools, chat.kwargs)


class LazyChatTokenizer:
    """Loads the chat tokenizer on the first chat row, so token-id input needs no tokenizer."""

    def __init__(self, tokenizer_dir: Path, max_len: int | None = None, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer_dir, self.max_len, self.template_kwargs = tokenizer_dir, max_len, template_kwargs
        self._chat: ChatTokenizer | None = None

    def rows(self, chat: Chat) -> list[Row]:
        return self._tokenizer().rows(chat)

    def first_assistant_token(self, chat: Chat) -> int | None:
        return self._tokenizer().first_assistant_token(chat)

    def _tokenizer(self) -> ChatTokenizer:
        if self._chat is None:
            self._chat = ChatTokenizer(self.tokenizer_dir, self.max_len, self.template_kwargs)
        return self._chat
