"""build-vocab: counts over loss-masked tokens only, speculators' files and mapping, validation, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow.__main__ import main as cli_main
from eagleflow.errors import UserError
from eagleflow.data.prepare import write_training_dataset
from eagleflow.data.vocab import VocabConfig, VocabFiles, build_vocab, validate_mappings

# Row 0 trains on ids 5, 5, 7; row 1 on 7, 7, 7, 9. Ids 1, 2, 3 appear only where the mask is 0.
ROWS = [
    ([1, 2, 5, 5, 7], [0, 0, 1, 1, 1]),
    ([3, 3, 7, 7, 7, 9], [0, 0, 1, 1, 1, 1]),
]
EXPECTED_FREQ = {5: 2, 7: 4, 9: 1}
TARGET_VOCAB = 16


def make_dataset(path: Path, rows=ROWS) -> Path:
    write_training_dataset([ids for ids, _ in rows], [mask for _, mask in rows], path)
    return path


def test_counts_only_loss_masked_tokens_and_matches_speculators(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "ds")
    summary = build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=3, target_vocab_size=TARGET_VOCAB))

    files = VocabFiles(dataset, 3)
    ours = torch.load(files.token_freq, weights_only=True)
    assert ours == EXPECTED_FREQ
    assert summary["loss_tokens"] == 7 and summary["distinct_tokens"] == 3 and summary["padded_unseen"] == 0

    # speculators' own counter over the same dataset gives the same dict.
    import datasets
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    theirs_path = tmp_path / "theirs.pt"
    save_token_frequency_distribution(datasets.load_from_disk(str(dataset)), theirs_path)
    assert torch.load(theirs_path, weights_only=True) == ours


def test_files_are_what_speculators_loads(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "ds")
    build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=2, target_vocab_size=TARGET_VOCAB))
    files = VocabFiles(dataset, 2)
    assert files.d2t.name == "d2t-2.npy" and files.t2d.name == "t2d-2.npy"

    d2t, t2d = np.load(files.d2t), np.load(files.t2d)
    assert d2t.dtype == np.int64 and d2t.shape == (2,)
    assert t2d.dtype == np.bool_ and t2d.shape == (TARGET_VOCAB,) and int(t2d.sum()) == 2
    # The two most frequent masked ids, 7 (4x) and 5 (2x), in id order; d2t holds offsets.
    assert np.flatnonzero(t2d).tolist() == [5, 7]
    assert (np.arange(2) + d2t).tolist() == [5, 7]

    # speculators' training CLI finds them by name in --data-path and accepts them.
    from argparse import Namespace

    from speculators.train.cli import parse_vocab_mappings

    args = Namespace(d2t_path=None, t2d_path=None, data_path=str(dataset), draft_vocab_size=2, token_freq_path=None)
    loaded_d2t, loaded_t2d, size = parse_vocab_mappings(args)
    assert size == 2 and loaded_d2t.tolist() == d2t.tolist() and loaded_t2d.tolist() == t2d.tolist()


def test_rerun_keeps_files_and_changed_data_rewrites_them(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "ds")
    cfg = VocabConfig(dataset=dataset, draft_vocab_size=2, target_vocab_size=TARGET_VOCAB)
    first = build_vocab(cfg)
    assert sorted(first["written"]) == ["d2t-2.npy", "t2d-2.npy", "token_freq.pt"]
    mtime = VocabFiles(dataset, 2).d2t.stat().st_mtime_ns
    assert build_vocab(cfg)["written"] == []
    assert VocabFiles(dataset, 2).d2t.stat().st_mtime_ns == mtime

    # Id 9 becomes the most frequent: the vocabulary must follow the data, not the cache.
    make_dataset(dataset, rows=[([9, 9, 9, 9, 9, 5], [1, 1, 1, 1, 1, 1])])
    third = build_vocab(cfg)
    assert "d2t-2.npy" in third["written"]
    assert np.flatnonzero(np.load(VocabFiles(dataset, 2).t2d)).tolist() == [5, 9]
    assert not [p for p in dataset.iterdir() if p.name.endswith(".tmp")]


def test_too_few_distinct_tokens(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "ds")
    with pytest.raises(UserError, match=r"only 3 distinct loss-masked token ids, fewer than --draft-vocab-size 6"):
        build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=6, target_vocab_size=TARGET_VOCAB, pad_unseen=False))
    assert not VocabFiles(dataset, 6).d2t.exists()

    # speculators' rule (the default): fill with never-seen ids, lowest first.
    summary = build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=6, target_vocab_size=TARGET_VOCAB))
    assert summary["padded_unseen"] == 3
    assert np.flatnonzero(np.load(VocabFiles(dataset, 6).t2d)).tolist() == [0, 1, 2, 5, 7, 9]


def test_draft_larger_than_verifier_vocab_is_refused(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "ds")
    with pytest.raises(UserError, match="larger than the verifier vocabulary"):
        build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=TARGET_VOCAB + 1, target_vocab_size=TARGET_VOCAB))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([([1, 2], [1, 1]), ([3, 99], [1, 1])], r"row 1: token id 99 is outside the verifier vocabulary \(0..15\)"),
        ([([1, 2], [1, 1]), ([3, 4, 5], [1, 1])], "row 1: loss_mask length differs"),
        ([([1, 2], [1, 2])], "row 0: loss_mask values must be 0 or 1"),
        ([([1, 2], [0, 0])], "no loss-masked tokens"),
    ],
)
def test_bad_rows_are_named(tmp_path: Path, rows, message: str) -> None:
    dataset = make_dataset(tmp_path / "ds", rows=rows)
    with pytest.raises(UserError, match=message):
        build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=1, target_vocab_size=TARGET_VOCAB))


def test_target_vocab_from_verifier_or_prepare_marker(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "ds")
    with pytest.raises(UserError, match="cannot tell the verifier vocabulary size"):
        build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=2))

    (dataset / "prepare.json").write_text(json.dumps({"vocab_size": 32}))
    assert build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=2))["target_vocab_size"] == 32

    # A multimodal verifier nests the language model's config under text_config (Kimi-K2.5).
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {"vocab_size": 24, "hidden_size": 8}}))
    summary = build_vocab(VocabConfig(dataset=dataset, draft_vocab_size=2, verifier=verifier))
    assert summary["target_vocab_size"] == 24
    assert np.load(VocabFiles(dataset, 2).t2d).shape == (24,)


def test_validate_mappings_rejects_inconsistent_files() -> None:
    t2d = np.zeros(8, dtype=bool)
    t2d[[1, 4]] = True
    d2t = np.array([1, 3], dtype=np.int64)  # 0 + 1 = 1, 1 + 3 = 4
    validate_mappings(d2t, t2d, 2, 8)
    with pytest.raises(ValueError, match="d2t must be int64"):
        validate_mappings(d2t.astype(np.int32), t2d, 2, 8)
    with pytest.raises(ValueError, match="t2d marks 3 ids"):
        bad = t2d.copy()
        bad[6] = True
        validate_mappings(d2t, bad, 2, 8)
    with pytest.raises(ValueError, match="name different target ids"):
        validate_mappings(np.array([1, 2], dtype=np.int64), t2d, 2, 8)


def test_cli_prints_result_and_exits_2_on_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = make_dataset(tmp_path / "ds")
    argv = ["build-vocab", "--dataset", str(dataset), "--draft-vocab-size", "2", "--target-vocab-size", str(TARGET_VOCAB)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1].split(" ", 1)[1])
    assert result["d2t"] == str(dataset / "d2t-2.npy") and os.path.exists(result["t2d"])
    assert "covers" in out

    assert cli_main(argv[:-4] + ["--draft-vocab-size", "9", "--no-pad-unseen", "--target-vocab-size", "16"]) == 2
    assert "fewer than --draft-vocab-size 9" in capsys.readouterr().err
