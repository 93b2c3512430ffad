"""``prepare-dataset``: conversations or token ids -> the training dataset (docs/design.md §3.3).

Input is JSONL or Parquet, each row either pre-tokenized (``input_ids``, optional
``loss_mask``) or a chat (``messages``, tokenized with the tokenizer's chat template, loss
mask on assistant tokens). Output is a HuggingFace ``datasets`` folder with int64 columns
``input_ids``, ``loss_mask`` and ``seq_len``; row i of it is row i of the hidden states,
always. A bad row (a byte that is not UTF-8, JSON nested deeper than 100 levels, a tool call's
arguments that are not JSON, a conversation the chat template cannot render, an assistant turn
that starts past ``--max-len``) fails the step with its row number and reason, quoting at most an
excerpt of it, unless ``--skip-bad-rows`` leaves it out and lists it in ``bad_rows.jsonl`` beside
the dataset. Switches the chat template does not have (``--chat-template-kwargs``) are refused
before any row is read. Rows are read one at a time, and a huge message is not tokenized whole
(:mod:`eagleflow.data.chat_tokens`), so memory stays within a small multiple of the largest row
beside the token ids kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field

from eagleflow.config import ChatTemplateKwargs, add_model_arguments, model_from_args
from eagleflow.errors import UserError, excerpt_repr
from eagleflow.files import atomic_write_json, atomic_write_text
from eagleflow.progress import Progress
from eagleflow.results import emit_result
from eagleflow.data.chat_tokens import LazyChatTokenizer, Row, TemplateCannotRender, check_chat_template_kwargs
from eagleflow.data.conversation import chat_of, count_input_rows, is_chat_row, read_input_rows
from eagleflow.verifier import config_int, load_tokenizer

MARKER_FILE = "prepare.json"
BAD_ROWS_FILE = "bad_rows.jsonl"
MAX_LISTED_ERRORS = 20


# Whether unusable input rows are left out, as preparation and regeneration (which reads the same
# rows first) declare it: one Param sets both.
SkipBadRows = Annotated[
    bool,
    Field(
        False,
        title="Skip bad rows",
        description="leave unusable input rows out instead of failing: preparation lists them in the dataset's "
        "bad_rows.jsonl; regeneration, which also leaves out rows whose first prompt does not fit the engine's "
        "context, in its skipped_rows.jsonl",
    ),
]


class PrepareConfig(BaseModel):
    """Flags of ``python -m eagleflow prepare-dataset``."""

    input: Path = Field(description="conversations (messages or ShareGPT conversations) or token ids: .jsonl, .parquet or a datasets folder")
    verifier: Path = Field(description="the verifier model folder: its tokenizer and chat template tokenize the rows")
    out: Path = Field(description="dataset folder to write (datasets save_to_disk layout)")
    max_len: int = Field(
        2048, ge=2, title="Max sequence length", description="rows longer than this many tokens are truncated"
    )
    vocab_size: int | None = Field(
        None, ge=1, description="verifier vocabulary size; default: the verifier's config.json, else its tokenizer's"
    )
    skip_bad_rows: SkipBadRows
    chat_template_kwargs: ChatTemplateKwargs


class BadRows(UserError):
    """Rows that cannot be used; ``errors`` holds ``(row, reason)`` pairs."""

    def __init__(self, source: Path, errors: Sequence[tuple[int, str]]) -> None:
        self.errors = list(errors)
        listed = "\n".join(f"  row {row}: {reason}" for row, reason in self.errors[:MAX_LISTED_ERRORS])
        more = len(self.errors) - MAX_LISTED_ERRORS
        super().__init__(
            f"{len(self.errors)} bad row(s) in {source} (rows count from 0; use --skip-bad-rows to leave them out):\n"
            + listed
            + (f"\n  … and {more} more" if more > 0 else "")
        )


@dataclass
class PreparedRows:
    """Token ids and loss masks ready to be written, and what happened on the way."""

    input_ids: list[list[int]] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)
    source_rows: list[int] = field(default_factory=list)
    truncated: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)


def _int_list(value: Any, name: str) -> list[int] | str:
    if not isinstance(value, list) or not value:
        return f"{name} must be a non-empty list of integers"
    for pos, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            return f"{name}[{pos}] = {excerpt_repr(item)} is not an integer"
    return value


def tokenize_rows(cfg: PrepareConfig, vocab_size: int) -> PreparedRows:
    """Turn every input row into training rows (input_ids, loss_mask), truncating and collecting bad rows.

    A conversation whose template renders an earlier turn otherwise later gives that turn a row of its own
    (:class:`~eagleflow.data.chat_tokens.ChatTokenizer`); each row records the input row it came from.
    """
    out = PreparedRows()
    chat = LazyChatTokenizer(cfg.verifier, cfg.max_len, cfg.chat_template_kwargs)
    progress = Progress(count_input_rows(cfg.input), label="rows", every=1000)
    for row, record in read_input_rows(cfg.input):  # one row in memory at a time, beside the token ids
        progress.advance()
        result = _tokenize_one(record, vocab_size, chat)
        if isinstance(result, str):
            out.bad.append((row, result))
            continue
        kept = []
        for ids, mask in result:
            if len(ids) > cfg.max_len:
                ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
                out.truncated += 1
            if any(mask):
                kept.append((ids, mask))
        if not kept:
            out.bad.append((row, beyond_max_len(min(mask.index(1) for _, mask in result if 1 in mask), cfg.max_len)))
            continue
        for ids, mask in kept:
            out.input_ids.append(ids)
            out.loss_mask.append(mask)
            out.source_rows.append(row)
    return out


def beyond_max_len(first: int, max_len: int) -> str:
    """Why a row whose first trained token is at ``first`` (counting from 0) has none within ``max_len`` tokens."""
    over = first - max_len + 1
    return (f"its first assistant token is at position {first:,}, beyond --max-len {max_len:,} by {over:,} "
            f"token{'s' if over != 1 else ''}: nothing of it is trained on (--max-len {first + 1:,} keeps it)")


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """The verifier's vocabulary: its config when the tokenizer folder is the model folder, else the tokenizer's."""
    if (tokenizer_dir / "config.json").exists():
        return config_int(tokenizer_dir, "vocab_size")
    try:
        return len(load_tokenizer(tokenizer_dir))
    except Exception as exc:
        raise UserError(f"cannot tell the vocabulary size of {tokenizer_dir} ({exc}); pass --vocab-size") from exc


def _token_row(record: dict[str, Any], where: str) -> Row | str:
    """A pre-tokenized row (``input_ids``, optional ``loss_mask``: all ones without it), or why it is not one."""
    ids = _int_list(record.get("input_ids"), f"{where}input_ids")
    if isinstance(ids, str):
        return ids
    if record.get("loss_mask") is None:
        return ids, [1] * len(ids)
    mask = _int_list(record["loss_mask"], f"{where}loss_mask")
    if isinstance(mask, str):
        return mask
    if len(mask) != len(ids):
        return f"{where}loss_mask has {len(mask)} entries but {where}input_ids has {len(ids)}"
    if any(m not in (0, 1) for m in mask):
        return f"{where}loss_mask entries must be 0 or 1"
    return ids, mask


def _tokenize_one(record: dict[str, Any] | str, vocab_size: int, chat: LazyChatTokenizer) -> list[Row] | str:
    if isinstance(record, str):
        return record
    if record.get("input_ids") is not None:
        row = _token_row(record, "")
        if isinstance(row, str):
            return row
        rows = [row]
    elif isinstance(record.get("token_rows"), list) and record["token_rows"]:
        # Regenerated conversations carry the engine's own ids (prompt as sent, answer as produced): used as they are.
        rows = []
        for i, item in enumerate(record["token_rows"]):
            row = _token_row(item, f"token_rows[{i}].") if isinstance(item, dict) else f"token_rows[{i}] must be an object"
            if isinstance(row, str):
                return row
            rows.append(row)
    elif is_chat_row(record):
        conversation = chat_of(record)
        if isinstance(conversation, str):
            return conversation
        try:
            rows = chat.rows(conversation)
            # The rows hold their first max_len + 1 tokens only: with none trained there, the turn may lie further on.
            first = None if any(any(mask) for _, mask in rows) else chat.first_assistant_token(conversation)
        except TemplateCannotRender as exc:
            return exc.reason
        if first is not None and chat.max_len is not None:
            return beyond_max_len(first, chat.max_len)
    else:
        return chat_of(record)  # says which keys a row needs
    for ids, _ in rows:
        bad = next(((pos, t) for pos, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"input_ids[{bad[0]}] = {bad[1]} is outside the verifier's vocabulary (0..{vocab_size - 1})"
    if not any(any(mask) for _, mask in rows):
        return "no assistant tokens (loss mask is all zero)"
    return rows


def write_training_dataset(input_ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]], out: Path) -> Path:
    """Write the §3.3 dataset (int64 ``input_ids``, ``loss_mask``, ``seq_len``) to ``out``.

    The arrow files are written into a temporary sibling folder and moved in last, so a
    reader never sees a half-written dataset; an existing ``hidden_states/`` folder and
    vocabulary files in ``out`` are kept (they are checked against the rows later).
    """
    import datasets

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    table = datasets.Dataset.from_dict(
        {"input_ids": list(input_ids), "loss_mask": list(loss_mask), "seq_len": [len(ids) for ids in input_ids]},
        features=features,
    )
    # speculators indexes rows as tensors (torch.equal on input_ids); its own preprocessing
    # saves with the torch format set, and save_to_disk keeps that format in state.json.
    table.set_format(type="torch")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    table.save_to_disk(str(staging))
    out.mkdir(exist_ok=True)
    for old in out.glob("data-*.arrow"):
        old.unlink()
    # state.json names the arrow files: move it last so a reader never sees it point at missing data.
    staged = sorted(staging.iterdir(), key=lambda p: p.name == "state.json")
    for item in staged:
        os.replace(item, out / item.name)
    staging.rmdir()
    return out


def fingerprint(cfg: PrepareConfig, vocab_size: int) -> str:
    """What the dataset depends on: input bytes, tokenizer files, max_len, vocab, skip rule."""
    digest = hashlib.sha256()
    for path in sorted(p for p in cfg.input.rglob("*") if p.is_file()) if cfg.input.is_dir() else [cfg.input]:
        digest.update(str(path.relative_to(cfg.input) if cfg.input.is_dir() else "").encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    for name in sorted(p.name for p in cfg.verifier.glob("tokenizer*")) + ["chat_template.jinja"]:
        path = cfg.verifier / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    digest.update(json.dumps([cfg.max_len, vocab_size, cfg.skip_bad_rows, cfg.chat_template_kwargs], sort_keys=True).encode())
    return digest.hexdigest()


def prepare_dataset(cfg: PrepareConfig) -> dict[str, Any]:
    """Run the step and return its summary (also written to ``<out>/prepare.json``).

    Unchanged inputs are not re-tokenized: the summary records a fingerprint of the input,
    tokenizer and settings, and a rerun with the same fingerprint returns at once.
    """
    vocab_size = cfg.vocab_size or tokenizer_vocab_size(cfg.verifier)
    check_chat_template_kwargs(cfg.verifier, cfg.chat_template_kwargs, "--chat-template-kwargs")
    print_fp = fingerprint(cfg, vocab_size)
    marker = cfg.out / MARKER_FILE
    if marker.exists():
        summary = json.loads(marker.read_text())
        if summary.get("fingerprint") == print_fp:
            from eagleflow.data.dataset_files import check_dataset_files

            try:  # a torn folder under a current marker is prepared again
                check_dataset_files(cfg.out)
            except UserError as exc:
                print(f"dataset {cfg.out}: {exc}; preparing it again", flush=True)
            else:
                print(f"dataset {cfg.out} is up to date ({summary['rows']} rows); nothing to do", flush=True)
                return summary
    prepared = tokenize_rows(cfg, vocab_size)
    if prepared.bad and not cfg.skip_bad_rows:
        raise BadRows(cfg.input, prepared.bad)
    if not prepared.input_ids:
        raise UserError(f"--input {cfg.input} has no usable rows"
                        + (f" (all {len(prepared.bad)} are bad, left out)" if prepared.bad else " (it holds no rows: an empty file?)"))
    marker.unlink(missing_ok=True)
    write_training_dataset(prepared.input_ids, prepared.loss_mask, cfg.out)
    bad_rows_path = cfg.out / BAD_ROWS_FILE
    if prepared.bad:
        atomic_write_text(
            bad_rows_path, "".join(json.dumps({"row": row, "reason": reason}) + "\n" for row, reason in prepared.bad)
        )
    else:
        bad_rows_path.unlink(missing_ok=True)
    tokens = sum(len(ids) for ids in prepared.input_ids)
    summary = {
        "fingerprint": print_fp,
        "input": str(cfg.input),
        "rows": len(prepared.input_ids),
        "tokens": tokens,
        "truncated": prepared.truncated,
        "max_len": cfg.max_len,
        "skipped_bad_rows": len(prepared.bad),
        "vocab_size": vocab_size,
        # Rows beside their conversation's own: turns the chat template renders otherwise later (ChatTokenizer).
        "conversations": len(set(prepared.source_rows)),
        "chat_template_kwargs": cfg.chat_template_kwargs,
    }
    atomic_write_json(marker, summary)
    print(
        f"prepared {summary['rows']} rows from {summary['conversations']} input rows, {tokens} tokens into {cfg.out}; "
        f"{prepared.truncated} truncated to {cfg.max_len}; {len(prepared.bad)} bad rows left out",
        flush=True,
    )
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, PrepareConfig)


def main(args: argparse.Namespace) -> int:
    summary = prepare_dataset(model_from_args(PrepareConfig, args))
    emit_result({k: v for k, v in summary.items() if k != "fingerprint"})
    return 0
