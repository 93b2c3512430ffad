"""Synthetic chat conversations with structure a tiny language model can learn in a minute.

A drafter can only learn what its verifier is confident about (docs/design.md §8): random text
gives it nothing. So every answer here follows from its question by a simple rule: counting
("count from 3 to 9" -> ``3 4 5 6 7 8 9``), arithmetic, fixed lists, echo and repeat tasks,
spelling, templated facts, and stock phrases that recur across conversations. Lengths vary:
most conversations are one to four turns, and about one in eight is a long multi-turn one,
well over 256 tokens, so a small ``max_len`` truncates it.

Row ``i`` depends only on ``(seed, i)``, so ``generate_conversations(100, s)[:50]`` equals
``generate_conversations(50, s)`` and a dataset can grow without changing its first rows.

``python -m eagleflow make-dataset --verifier DIR --out FILE.jsonl --rows N`` writes them as
JSONL, one ``{"messages": [...]}`` per line, and prints their token lengths under the
tokenizer's chat template.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError
from eagleflow.files import atomic_path
from eagleflow.progress import Progress

# Share of conversations generated in "long" mode (many turns, long answers).
LONG_FRACTION = 0.12

Message = dict[str, str]
Turn = tuple[str, str]  # (user content, assistant content)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a careful assistant who answers exactly what is asked.",
    "You are a friendly assistant. Keep your answers short and correct.",
]
NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar",
         "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter"]
LISTS: dict[str, list[str]] = {
    "colors of the rainbow": ["red", "orange", "yellow", "green", "blue", "indigo", "violet"],
    "days of the week": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "months of the year": ["January", "February", "March", "April", "May", "June", "July", "August", "September",
                           "October", "November", "December"],
    "planets of the solar system": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
    "seasons": ["spring", "summer", "autumn", "winter"],
    "primary colors": ["red", "yellow", "blue"],
    "vowels": ["a", "e", "i", "o", "u"],
}
# animal -> (home, food, what it does); fixed facts the model can memorise.
ANIMALS: dict[str, tuple[str, str, str]] = {
    "cat": ("house", "fish", "meows"),
    "dog": ("house", "meat", "barks"),
    "cow": ("field", "grass", "moos"),
    "duck": ("pond", "bread", "quacks"),
    "horse": ("stable", "hay", "neighs"),
    "owl": ("tree", "mice", "hoots"),
    "frog": ("pond", "flies", "croaks"),
    "sheep": ("field", "grass", "bleats"),
    "lion": ("savanna", "meat", "roars"),
    "bee": ("hive", "nectar", "buzzes"),
    "mouse": ("hole", "cheese", "squeaks"),
    "wolf": ("forest", "meat", "howls"),
}
ADJECTIVES = ["big", "small", "happy", "quiet", "quick", "lazy", "brave", "old", "young", "clever"]
NOUNS = ["ball", "box", "tree", "river", "house", "garden", "road", "book", "hill", "boat"]
VERBS = ["sees", "likes", "finds", "watches", "follows", "jumps over", "walks to", "sits by"]
WORDS = ["apple", "banana", "cherry", "river", "mountain", "garden", "window", "pencil", "rocket", "guitar", "planet",
         "yellow", "summer", "silver", "forest", "candle", "bridge", "dragon", "island", "orange"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
THANKS: list[Turn] = [
    ("Thank you!", "You are welcome! Is there anything else I can help you with?"),
    ("Thanks, that is right.", "Glad I could help. Is there anything else I can help you with?"),
    ("Great, thanks.", "You are welcome! Let me know if you need anything else."),
]


def _sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(ADJECTIVES)} {rng.choice(list(ANIMALS))} {rng.choice(VERBS)} "
            f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}.")


def _count_up(rng: random.Random, long: bool) -> Turn:
    start = rng.randint(0, 60)
    end = start + (rng.randint(20, 60) if long else rng.randint(3, 15))
    ask = rng.choice(["Count from {a} to {b}.", "Please count from {a} to {b}.", "Can you count from {a} up to {b}?"])
    return ask.format(a=start, b=end), " ".join(str(n) for n in range(start, end + 1))


def _count_down(rng: random.Random, long: bool) -> Turn:
    end = rng.randint(0, 40)
    start = end + (rng.randint(20, 50) if long else rng.randint(3, 12))
    ask = rng.choice(["Count down from {a} to {b}.", "Please count backwards from {a} to {b}."])
    return ask.format(a=start, b=end), " ".join(str(n) for n in range(start, end - 1, -1))


def _count_by(rng: random.Random, long: bool) -> Turn:
    step = rng.choice([2, 3, 5, 10])
    start = step * rng.randint(0, 5)
    end = start + step * (rng.randint(15, 40) if long else rng.randint(3, 10))
    return f"Count by {step}s from {start} to {end}.", " ".join(str(n) for n in range(start, end + 1, step))


def _arithmetic(rng: random.Random, long: bool) -> Turn:
    op = rng.choice(["plus", "minus", "times"])
    if op == "plus":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        result = a + b
    elif op == "minus":
        a = rng.randint(0, 99)
        b = rng.randint(0, a)
        result = a - b
    else:
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        result = a * b
    ask = rng.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?"])
    return ask.format(a=a, op=op, b=b), f"{a} {op} {b} is {result}."


def _list_items(rng: random.Random, long: bool) -> Turn:
    name = rng.choice(list(LISTS))
    items = LISTS[name]
    ask = rng.choice(["List the {n}.", "What are the {n}?", "Name the {n} in order."])
    return ask.format(n=name), f"The {name} are: {', '.join(items)}."


def _list_item_after(rng: random.Random, long: bool) -> Turn:
    name = rng.choice(["days of the week", "months of the year", "planets of the solar system"])
    items = LISTS[name]
    index = rng.randrange(len(items) - 1)
    return f"Which of the {name} comes after {items[index]}?", f"After {items[index]} comes {items[index + 1]}."


def _alphabet(rng: random.Random, long: bool) -> Turn:
    start = rng.randrange(0, 20)
    end = rng.randrange(start + 3, 26) if not long else 25
    return (f"Say the alphabet from {ALPHABET[start]} to {ALPHABET[end]}.",
            " ".join(ALPHABET[start:end + 1]))


def _echo(rng: random.Random, long: bool) -> Turn:
    text = " ".join(_sentence(rng) for _ in range(rng.randint(4, 8) if long else rng.randint(1, 2)))
    ask = rng.choice(["Repeat after me: {t}", "Please repeat this exactly: {t}", "Echo: {t}"])
    return ask.format(t=text), text


def _say_n_times(rng: random.Random, long: bool) -> Turn:
    word = rng.choice(WORDS)
    times = rng.randint(15, 40) if long else rng.randint(2, 8)
    return f"Say {word} {times} times.", " ".join([word] * times)


def _animal_facts(rng: random.Random, long: bool) -> Turn:
    animal = rng.choice(list(ANIMALS))
    home, food, sound = ANIMALS[animal]
    return (f"Tell me about the {animal}.",
            f"The {animal} lives in the {home}. The {animal} eats {food}. The {animal} {sound}.")


def _greeting(rng: random.Random, long: bool) -> Turn:
    name = rng.choice(NAMES)
    ask = rng.choice(["Hi, my name is {n}.", "Hello! I am {n}.", "Good morning, this is {n}."])
    return ask.format(n=name), f"Hello, {name}! Nice to meet you. How can I help you today?"


def _uppercase(rng: random.Random, long: bool) -> Turn:
    words = rng.sample(WORDS, rng.randint(6, 12) if long else rng.randint(1, 3))
    text = " ".join(words)
    return f"Write this in capital letters: {text}", text.upper()


def _spell(rng: random.Random, long: bool) -> Turn:
    word = rng.choice(WORDS)
    return f"Spell the word {word}.", "-".join(word.upper())


def _number_word(rng: random.Random, long: bool) -> Turn:
    n = rng.randrange(len(NUMBER_WORDS))
    return f"Write the number {n} in words.", f"{n} in words is {NUMBER_WORDS[n]}."


def _larger(rng: random.Random, long: bool) -> Turn:
    a, b = rng.sample(range(100), 2)
    return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."


def _reverse_words(rng: random.Random, long: bool) -> Turn:
    words = rng.sample(WORDS, rng.randint(8, 14) if long else rng.randint(3, 5))
    return f"Reverse the order of these words: {' '.join(words)}", " ".join(reversed(words))


TASKS: list[Callable[[random.Random, bool], Turn]] = [
    _count_up, _count_down, _count_by, _arithmetic, _list_items, _list_item_after, _alphabet, _echo,
    _say_n_times, _animal_facts, _greeting, _uppercase, _spell, _number_word, _larger, _reverse_words,
]


def _row_rng(seed: int, row: int) -> random.Random:
    # A string seed is hashed with SHA-512 by `random`, so it is stable across processes
    # (unlike hash()); one generator per row keeps row i independent of how many rows exist.
    return random.Random(f"eagleflow-synthetic:{seed}:{row}")


def generate_conversation(seed: int, row: int) -> dict[str, list[Message]]:
    """Conversation number ``row`` of the stream selected by ``seed``."""
    rng = _row_rng(seed, row)
    long = rng.random() < LONG_FRACTION
    messages: list[Message] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if long:
        num_turns = rng.randint(8, 14)
    else:
        num_turns = rng.choices([1, 2, 3, 4], weights=[50, 25, 15, 10])[0]
    for turn in range(num_turns):
        # A thank-you turn now and then: a stock phrase the verifier sees many times.
        if turn > 0 and rng.random() < 0.15:
            user, assistant = rng.choice(THANKS)
        else:
            user, assistant = rng.choice(TASKS)(rng, long)
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": assistant})
    return {"messages": messages}


def generate_conversations(rows: int, seed: int = 0) -> list[dict[str, list[Message]]]:
    """``rows`` synthetic conversations ``{"messages": [{"role", "content"}, …]}``, deterministic by ``seed``."""
    if rows < 0:
        raise UserError(f"--rows must be at least 0, got {rows}")
    return [generate_conversation(seed, row) for row in range(rows)]


def thinking_conversation(conversation: dict[str, list[Message]], row: int) -> dict[str, Any]:
    """``conversation`` as a thinking, tool-calling verifier serves it: each answer after a short thinking
    (``reasoning_content``); every fourth row's first answer found by a tool (a ``lookup`` call, its result,
    then the answer), with the row's ``tools``. Deterministic: the same conversation gives the same row."""
    messages: list[dict[str, Any]] = []
    looked_up = row % 4 != 0
    for message in conversation["messages"]:
        if message["role"] != "assistant":
            messages.append(dict(message))
            continue
        words = message["content"].split()
        if not looked_up:
            looked_up = True
            query = " ".join(messages[-1]["content"].split()[:3])
            messages.append({"role": "assistant", "content": None, "reasoning_content": "I look it up.",
                             "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"query": query}}}]})
            messages.append({"role": "tool", "content": message["content"]})
        thinking = f"The answer has {len(words)} words and starts with {' '.join(words[:2])}."
        messages.append({"role": "assistant", "content": message["content"], "reasoning_content": thinking})
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find the answer",
                                               "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
    return {"messages": messages, **({"tools": tools} if row % 4 == 0 else {})}


def corpus_text(rows: int, seed: int = 0) -> str:
    """Plain text of ``rows`` conversations (``role`` line, then content), for training a tokenizer.

    The chat markers are special tokens and never take part in BPE merges, so they are left out.
    """
    blocks = []
    for conversation in generate_conversations(rows, seed):
        blocks.append("\n".join(f"{m['role']}\n{m['content']}" for m in conversation["messages"]))
    return "\n\n".join(blocks) + "\n"


class DatasetConfig(BaseModel):
    """Flags of ``python -m eagleflow make-dataset``."""

    verifier: Path = Field(description="the verifier model folder (its tokenizer's chat template measures lengths)")
    out: Path = Field(description="JSONL file to write, one {\"messages\": [...]} per line")
    rows: int = Field(ge=1, description="number of conversations")
    seed: int = Field(0, description="selects the conversations; the same seed gives the same file")
    long_tokens: int = Field(256, ge=1, description="the summary counts conversations longer than this many tokens")


def token_lengths(tokenizer: Any, conversations: list[dict[str, list[Message]]]) -> list[int]:
    """Token count of each conversation under ``tokenizer``'s chat template, with progress lines."""
    progress = Progress(len(conversations), label="conversations", every=max(1000, len(conversations) // 10))
    lengths = []
    for conversation in conversations:
        ids = tokenizer.apply_chat_template(conversation["messages"], tokenize=True, return_dict=True)["input_ids"]
        lengths.append(len(ids))
        progress.advance()
    return lengths


def length_summary(lengths: list[int], long_tokens: int) -> dict[str, Any]:
    """min / mean / max of ``lengths`` and how many exceed ``long_tokens``."""
    return {
        "rows": len(lengths),
        "tokens": sum(lengths),
        "min": min(lengths),
        "mean": round(statistics.fmean(lengths), 1),
        "max": max(lengths),
        "long_tokens": long_tokens,
        "over_long_tokens": sum(1 for n in lengths if n > long_tokens),
    }


def make_dataset(config: DatasetConfig) -> dict[str, Any]:
    """Write ``config.rows`` conversations to ``config.out`` atomically; return the length summary."""
    from eagleflow.verifier import load_tokenizer

    if not (config.verifier / "tokenizer_config.json").is_file():
        raise UserError(f"--verifier {config.verifier}: no tokenizer_config.json there (run make-tiny-model first)")
    try:
        tokenizer = load_tokenizer(config.verifier)
    except (OSError, ValueError) as exc:
        raise UserError(f"--verifier {config.verifier}: cannot load a tokenizer: {exc}") from exc
    if not tokenizer.chat_template:
        raise UserError(f"--verifier {config.verifier}: the tokenizer has no chat template")
    conversations = generate_conversations(config.rows, config.seed)
    summary = length_summary(token_lengths(tokenizer, conversations), config.long_tokens)
    with atomic_path(config.out) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            for conversation in conversations:
                handle.write(json.dumps(conversation, ensure_ascii=False) + "\n")
    summary["path"] = str(config.out)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``make-dataset``, derived from :class:`DatasetConfig`."""
    add_model_arguments(parser, DatasetConfig)


def main(args: argparse.Namespace) -> int:
    """Write the dataset and print its token-length summary."""
    config = model_from_args(DatasetConfig, args)
    summary = make_dataset(config)
    print(
        f"wrote {summary['rows']} conversations to {summary['path']}: {summary['tokens']} tokens, "
        f"per conversation min {summary['min']} mean {summary['mean']} max {summary['max']}, "
        f"{summary['over_long_tokens']} longer than {summary['long_tokens']} tokens"
    )
    return 0
