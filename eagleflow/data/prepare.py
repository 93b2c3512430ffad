"""``prepare-dataset``: conversations or token ids -> the training dataset (docs/design.md §3.3).

Input is JSONL or Parquet, each row either pre-tokenized (``input_ids``, optional
``loss_mask``) or a chat (``messages``, tokenized with the tokenizer's chat template, loss
mask on assistant tokens). Output is a HuggingFace ``datasets`` folder with int64 columns
``input_ids``, ``loss_mask`` and ``seq_len``; row i of it is row i of the hidden states,
always. A bad row (a byte that is not UTF-8 included) fails the step with its row number and
reason, quoting at most an excerpt of it, unless ``--skip-bad-rows`` leaves it out and lists it in
``bad_rows.jsonl`` beside the dataset. Rows are read one at a time, and a huge message is not
tokenized whole (:mod:`eagleflow.data.chat_tokens`), so memory stays within a small multiple of
the largest row beside the token ids kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.errors import UserError, excerpt_repr
from eagleflow.files import atomic_write_json, atomic_write_text
from eagleflow.progress import Progress
from eagleflow.results import emit_result
from eagleflow.data.chat_tokens import LazyChatTokenizer
from eagleflow.data.verifier import config_int, load_tokenizer

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

    input: Path = Field(description="conversations or token ids: .jsonl or .parquet")
    verifier: Path = Field(description="the verifier model folder: its tokenizer and chat template tokenize the rows")
    out: Path = Field(description="dataset folder to write (datasets save_to_disk layout)")
    max_len: int = Field(
        2048, ge=2, title="Max sequence length", description="rows longer than this many tokens are truncated"
    )
    vocab_size: int | None = Field(
        None, ge=1, description="verifier vocabulary size; default: the verifier's config.json, else its tokenizer's"
    )
    skip_bad_rows: SkipBadRows


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


def read_input_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Yield ``(row, record)`` one row at a time; a row that is not usable JSON yields ``(row, why)``.

    A JSONL line is decoded on its own, so a byte that is not UTF-8 names its row (and
    ``--skip-bad-rows`` can leave it out) instead of ending the file; no reason quotes more than a
    bounded excerpt of the row.
    """
    if not path.exists():
        raise UserError(f"--input {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):  # never the whole file at once
            for record in batch.to_pylist():
                yield row, record
                row += 1
        return
    if path.suffix not in (".jsonl", ".json"):
        raise UserError(f"--input {path}: expected a .jsonl or .parquet file")
    with open(path, "rb") as handle:
        for row, raw in enumerate(handle):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield row, f"not UTF-8: byte 0x{raw[exc.start]:02x} at byte {exc.start} of the line"
                continue
            if not line.strip():
                yield row, "empty line"
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield row, f"unparsable JSON: {exc.msg} at column {exc.colno}"
                continue
            except RecursionError:
                yield row, "unparsable JSON: nested deeper than the parser goes"
                continue
            yield row, record if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"


def count_input_rows(path: Path) -> int:
    """How many rows :func:`read_input_rows` will yield (for progress), without parsing them."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def check_messages(messages: Any) -> str | None:
    """Why ``messages`` is not a usable chat (None when it is): the rule prepare and regenerate share."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return f"messages[{i}] must be an object with string 'role' and 'content'"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message (nothing to train on)"
    return None


def _int_list(value: Any, name: str) -> list[int] | str:
    if not isinstance(value, list) or not value:
        return f"{name} must be a non-empty list of integers"
    for pos, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            return f"{name}[{pos}] = {excerpt_repr(item)} is not an integer"
    return value


def tokenize_rows(cfg: PrepareConfig, vocab_size: int) -> PreparedRows:
    """Turn every input row into (input_ids, loss_mask), truncating and collecting bad rows."""
    out = PreparedRows()
    chat = LazyChatTokenizer(cfg.verifier, cfg.max_len)
    progress = Progress(count_input_rows(cfg.input), label="rows", every=1000)
    for row, record in read_input_rows(cfg.input):  # one row in memory at a time, beside the token ids
        progress.advance()
        result = _tokenize_one(record, vocab_size, chat)
        if isinstance(result, str):
            out.bad.append((row, result))
            continue
        ids, mask = result
        if len(ids) > cfg.max_len:
            ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
            out.truncated += 1
            if not any(mask):
                out.bad.append((row, f"no assistant tokens within the first {cfg.max_len} tokens (--max-len)"))
                continue
        out.input_ids.append(ids)
        out.loss_mask.append(mask)
        out.source_rows.append(row)
    return out


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """The verifier's vocabulary: its config when the tokenizer folder is the model folder, else the tokenizer's."""
    if (tokenizer_dir / "config.json").exists():
        return config_int(tokenizer_dir, "vocab_size")
    try:
        return len(load_tokenizer(tokenizer_dir))
    except Exception as exc:
        raise UserError(f"cannot tell the vocabulary size of {tokenizer_dir} ({exc}); pass --vocab-size") from exc


def _tokenize_one(record: dict[str, Any] | str, vocab_size: int, chat: LazyChatTokenizer) -> tuple[list[int], list[int]] | str:
    if isinstance(record, str):
        return record
    if "input_ids" in record:
        ids = _int_list(record["input_ids"], "input_ids")
        if isinstance(ids, str):
            return ids
        if "loss_mask" in record and record["loss_mask"] is not None:
            mask = _int_list(record["loss_mask"], "loss_mask")
            if isinstance(mask, str):
                return mask
            if len(mask) != len(ids):
                return f"loss_mask has {len(mask)} entries but input_ids has {len(ids)}"
            if any(m not in (0, 1) for m in mask):
                return "loss_mask entries must be 0 or 1"
        else:
            mask = [1] * len(ids)
    elif "messages" in record:
        problem = check_messages(record["messages"])
        if problem:
            return problem
        ids, mask = chat(record["messages"])
    else:
        return f"row has neither 'input_ids' nor 'messages' (keys: {excerpt_repr(sorted(record)[:10], 120)})"
    bad = next(((pos, t) for pos, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"input_ids[{bad[0]}] = {bad[1]} is outside the verifier's vocabulary (0..{vocab_size - 1})"
    if not any(mask):
        return "no assistant tokens (loss mask is all zero)"
    return ids, mask


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
    with open(cfg.input, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    for name in sorted(p.name for p in cfg.verifier.glob("tokenizer*")) + ["chat_template.jinja"]:
        path = cfg.verifier / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    digest.update(json.dumps([cfg.max_len, vocab_size, cfg.skip_bad_rows]).encode())
    return digest.hexdigest()


def prepare_dataset(cfg: PrepareConfig) -> dict[str, Any]:
    """Run the step and return its summary (also written to ``<out>/prepare.json``).

    Unchanged inputs are not re-tokenized: the summary records a fingerprint of the input,
    tokenizer and settings, and a rerun with the same fingerprint returns at once.
    """
    vocab_size = cfg.vocab_size or tokenizer_vocab_size(cfg.verifier)
    print_fp = fingerprint(cfg, vocab_size)
    marker = cfg.out / MARKER_FILE
    if marker.exists():
        summary = json.loads(marker.read_text())
        if summary.get("fingerprint") == print_fp:
            from eagleflow.data.dataset_files import check_dataset_files
            from eagleflow.errors import UserError

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
        raise UserError(f"--input {cfg.input} has no usable rows")
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
    }
    atomic_write_json(marker, summary)
    print(
        f"prepared {summary['rows']} rows, {tokens} tokens into {cfg.out}; "
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
