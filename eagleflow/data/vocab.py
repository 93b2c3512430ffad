"""``build-vocab``: the draft vocabulary (d2t/t2d) from token frequencies over loss-masked tokens.

The files land in the dataset folder under the names ``speculators train`` looks for there
(``token_freq.pt``, ``d2t-<N>.npy``, ``t2d-<N>.npy``), so training loads them instead of
rebuilding them. The mapping itself is speculators' own
``build_vocab_mappings_from_distribution``: the N most frequent target ids (ties broken by
the smaller id), sorted; ``d2t[i]`` is the offset ``target_id - i`` and ``t2d`` marks the chosen
target ids.

When fewer than N distinct ids occur under the loss mask, speculators fills the vocabulary with
ids that never occur, lowest ids first (0, 1, 2, …). eagleflow does the same by default and
says how many it added; ``--no-pad-unseen`` turns that into an error instead. A draft
vocabulary larger than the verifier's is always an error: no padding rule can fill it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from eagleflow.config import DraftVocabSize, RedoFinished, add_model_arguments, model_from_args
from eagleflow.data.dataset_files import dataset_table
from eagleflow.data.prepare import MARKER_FILE
from eagleflow.errors import UserError
from eagleflow.files import atomic_path
from eagleflow.progress import Progress
from eagleflow.results import emit_result
from eagleflow.startup import collector_paused

TOKEN_FREQ_FILE = "token_freq.pt"


def d2t_file(draft_vocab_size: int) -> str:
    """speculators' name for the draft-to-target offsets: ``d2t-<N>.npy``."""
    return f"d2t-{draft_vocab_size}.npy"


def t2d_file(draft_vocab_size: int) -> str:
    """speculators' name for the target-to-draft mask: ``t2d-<N>.npy``."""
    return f"t2d-{draft_vocab_size}.npy"


class VocabConfig(BaseModel):
    """Flags of ``python -m eagleflow build-vocab``."""

    dataset: Path = Field(description="training dataset folder (prepare-dataset output); the files are written here")
    draft_vocab_size: DraftVocabSize
    verifier: Path | None = Field(
        None, description="verifier model folder; its config.json gives the target vocabulary size"
    )
    target_vocab_size: int | None = Field(
        None,
        ge=1,
        description="verifier vocabulary size; default: from --verifier, else from the dataset's prepare.json",
    )
    pad_unseen: bool = Field(
        True,
        description="when fewer distinct ids than --draft-vocab-size occur, fill up with unseen ids, lowest first "
        "(speculators' rule); --no-pad-unseen makes that an error",
    )
    redo_finished: RedoFinished


@dataclass(frozen=True)
class VocabFiles:
    """Where the vocabulary of one dataset and size lives."""

    dataset: Path
    draft_vocab_size: int

    @property
    def token_freq(self) -> Path:
        return self.dataset / TOKEN_FREQ_FILE

    @property
    def d2t(self) -> Path:
        return self.dataset / d2t_file(self.draft_vocab_size)

    @property
    def t2d(self) -> Path:
        return self.dataset / t2d_file(self.draft_vocab_size)


def resolve_target_vocab_size(cfg: VocabConfig) -> int:
    """The verifier vocabulary size: ``--target-vocab-size``, ``--verifier``'s config, or prepare.json."""
    from eagleflow.verifier import config_int

    if cfg.target_vocab_size is not None:
        if cfg.verifier is not None:
            from_model = config_int(cfg.verifier, "vocab_size")
            if from_model != cfg.target_vocab_size:
                raise UserError(
                    f"--target-vocab-size {cfg.target_vocab_size} disagrees with --verifier {cfg.verifier} "
                    f"(vocab_size {from_model}); give one of them"
                )
        return cfg.target_vocab_size
    if cfg.verifier is not None:
        return config_int(cfg.verifier, "vocab_size")
    marker = cfg.dataset / MARKER_FILE  # prepare-dataset records the verifier vocabulary size there
    if marker.exists():
        value = json.loads(marker.read_text()).get("vocab_size")
        if isinstance(value, int):
            return value
    raise UserError(
        f"cannot tell the verifier vocabulary size: pass --verifier or --target-vocab-size "
        f"({marker} has none)"
    )


def count_token_frequencies(dataset_dir: Path, target_vocab_size: int) -> np.ndarray:
    """Count each token id over positions whose loss mask is 1; returns ``int64[target_vocab_size]``.

    Reads the arrow columns in record batches (no per-row Python objects), so 21M tokens take
    seconds. A row whose mask length differs from its ids, whose mask is not 0/1, or whose id
    is outside the verifier vocabulary is a :class:`UserError` naming that row.
    """
    import pyarrow.compute as pc

    table = dataset_table(dataset_dir, ["input_ids", "loss_mask"])
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    progress = Progress(table.num_rows, label="rows", every=max(1000, table.num_rows // 10))
    first_row = 0
    for batch in table.to_batches(max_chunksize=4096):
        ids_col, mask_col = batch.column(0), batch.column(1)
        id_lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
        mask_lengths = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False)
        if (id_lengths != mask_lengths).any():
            row = first_row + int(np.flatnonzero(id_lengths != mask_lengths)[0])
            raise UserError(f"--dataset {dataset_dir} row {row}: loss_mask length differs from input_ids length")
        ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False)
        row_of_position = np.repeat(np.arange(first_row, first_row + len(id_lengths)), id_lengths)
        bad_mask = (mask != 0) & (mask != 1)
        if bad_mask.any():
            row = int(row_of_position[np.flatnonzero(bad_mask)[0]])
            raise UserError(f"--dataset {dataset_dir} row {row}: loss_mask values must be 0 or 1")
        out_of_range = (ids < 0) | (ids >= target_vocab_size)
        if out_of_range.any():
            pos = int(np.flatnonzero(out_of_range)[0])
            raise UserError(
                f"--dataset {dataset_dir} row {int(row_of_position[pos])}: token id {int(ids[pos])} is outside "
                f"the verifier vocabulary (0..{target_vocab_size - 1})"
            )
        counts += np.bincount(ids[mask == 1], minlength=target_vocab_size)
        first_row += len(id_lengths)
        progress.advance(len(id_lengths))
    return counts


def frequencies_to_dict(counts: np.ndarray) -> dict[int, int]:
    """The ``{token_id: count}`` dict speculators stores in ``token_freq.pt`` (seen ids only)."""
    seen = np.flatnonzero(counts)
    return dict(zip(seen.tolist(), counts[seen].tolist(), strict=True))


def build_mappings(token_freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t, t2d)`` as numpy arrays, from speculators' own mapping function."""
    with collector_paused():  # importing speculators: seconds of start-up (eagleflow.startup)
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=token_freq, draft_vocab_size=draft_vocab_size, target_vocab_size=target_vocab_size
    )
    return d2t.numpy(), t2d.numpy()


def validate_mappings(d2t: np.ndarray, t2d: np.ndarray, draft_vocab_size: int, target_vocab_size: int) -> None:
    """Raise ValueError unless ``d2t``/``t2d`` are what speculators loads for these sizes.

    ``d2t``: int64 ``[N]`` offsets with ``i + d2t[i]`` strictly increasing target ids;
    ``t2d``: bool ``[V]`` with exactly N ids set, the same ids ``d2t`` names.
    """
    if d2t.dtype != np.int64 or d2t.shape != (draft_vocab_size,):
        raise ValueError(f"d2t must be int64 [{draft_vocab_size}], got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dtype != np.bool_ or t2d.shape != (target_vocab_size,):
        raise ValueError(f"t2d must be bool [{target_vocab_size}], got {t2d.dtype} {list(t2d.shape)}")
    if int(t2d.sum()) != draft_vocab_size:
        raise ValueError(f"t2d marks {int(t2d.sum())} ids, expected {draft_vocab_size}")
    target_ids = np.arange(draft_vocab_size, dtype=np.int64) + d2t
    if not np.array_equal(target_ids, np.flatnonzero(t2d)):
        raise ValueError("d2t and t2d name different target ids")


def load_mappings(files: VocabFiles, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The stored mappings if both files exist and validate, else None."""
    if not (files.d2t.exists() and files.t2d.exists()):
        return None
    try:
        d2t, t2d = np.load(files.d2t), np.load(files.t2d)
        validate_mappings(d2t, t2d, files.draft_vocab_size, target_vocab_size)
    except (ValueError, OSError):
        return None
    return d2t, t2d


def _save_npy(target: Path, array: np.ndarray) -> None:
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as handle:  # np.save on a path would append ".npy" to the temp name
            np.save(handle, array)


def _save_token_freq(target: Path, token_freq: dict[int, int]) -> None:
    import torch

    with atomic_path(target) as tmp:
        torch.save(token_freq, tmp)


def _load_token_freq(path: Path) -> dict[int, int] | None:
    import torch

    try:
        loaded = torch.load(path, weights_only=True)
    except Exception:  # a truncated or foreign file is simply rewritten
        return None
    return loaded if isinstance(loaded, dict) else None


def build_vocab(cfg: VocabConfig) -> dict[str, Any]:
    """Count, map, validate and publish the vocabulary files; return a summary.

    Counting is cheap, so it always runs: files whose content is already right are left
    untouched (their mtime says when they were made), stale ones are replaced atomically.
    """
    target_vocab_size = resolve_target_vocab_size(cfg)
    n = cfg.draft_vocab_size
    if n > target_vocab_size:
        raise UserError(
            f"--draft-vocab-size {n} is larger than the verifier vocabulary ({target_vocab_size}); "
            f"no padding rule can fill it"
        )
    counts = count_token_frequencies(cfg.dataset, target_vocab_size)
    token_freq = frequencies_to_dict(counts)
    distinct = len(token_freq)
    total = int(counts.sum())
    if total == 0:
        raise UserError(f"--dataset {cfg.dataset} has no loss-masked tokens (every loss_mask is 0)")
    padded = max(0, n - distinct)
    if padded and not cfg.pad_unseen:
        raise UserError(
            f"--dataset {cfg.dataset} has only {distinct} distinct loss-masked token ids, fewer than "
            f"--draft-vocab-size {n}; lower --draft-vocab-size or allow --pad-unseen "
            f"(fills with {padded} ids that never occur, lowest first, as speculators does)"
        )
    d2t, t2d = build_mappings(token_freq, n, target_vocab_size)
    validate_mappings(d2t, t2d, n, target_vocab_size)

    files = VocabFiles(cfg.dataset, n)
    written: list[str] = []
    if _load_token_freq(files.token_freq) != token_freq:
        _save_token_freq(files.token_freq, token_freq)
        written.append(files.token_freq.name)
    stored = load_mappings(files, target_vocab_size)
    if stored is None or not (np.array_equal(stored[0], d2t) and np.array_equal(stored[1], t2d)):
        _save_npy(files.d2t, d2t)
        _save_npy(files.t2d, t2d)
        written += [files.d2t.name, files.t2d.name]

    covered = int(counts[t2d].sum())
    summary = {
        "dataset": str(cfg.dataset),
        "draft_vocab_size": n,
        "target_vocab_size": target_vocab_size,
        "loss_tokens": total,
        "distinct_tokens": distinct,
        "padded_unseen": padded,
        "coverage": covered / total,
        "token_freq": str(files.token_freq),
        "d2t": str(files.d2t),
        "t2d": str(files.t2d),
        "written": written,
    }
    note = f"; {padded} unseen ids added (lowest first)" if padded else ""
    print(
        f"draft vocabulary: {n} of {target_vocab_size} ids; {distinct} distinct ids in {total} loss-masked tokens; "
        f"the draft vocabulary covers {100 * covered / total:.2f}% of them{note}; "
        + (f"wrote {', '.join(written)}" if written else "files already up to date"),
        flush=True,
    )
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, VocabConfig)


def main(args: argparse.Namespace) -> int:
    from eagleflow.data.dataset_files import dataset_fingerprint
    from eagleflow.reuse import MadeFrom, settings_of

    cfg = model_from_args(VocabConfig, args)
    # The rows' token ids and masks make the vocabulary (not their hidden states, which extraction adds later).
    made = MadeFrom("build-vocab", cfg.dataset.absolute(), {"settings": settings_of(cfg, "dataset", "redo_finished"),
                    "dataset": dataset_fingerprint(cfg.dataset, hidden_states=False)}, f".made-from-vocab-{cfg.draft_vocab_size}.json")
    files = VocabFiles(cfg.dataset, cfg.draft_vocab_size)
    result = made.reuse_or_none(cfg.redo_finished)
    if result is None:
        result = build_vocab(cfg)
        made.save(result, [files.d2t, files.t2d, files.token_freq])
    emit_result(result)
    return 0
