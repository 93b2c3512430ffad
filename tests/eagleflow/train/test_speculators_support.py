"""Which speculators the training step drives: the version guard, eagleflow's noise, fp8 and 0.8.1.

The noise is checked inside speculators' own ``create_train_val_loaders``; fp8 training and
speculators 0.8.1 run for real, through ``python -m eagleflow train``. 0.8.1 is installed with
``pip install --no-deps --target`` into ``.cache/speculators-0.8.1`` (kept between runs) and put
first on PYTHONPATH, so the same environment runs either release.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow.errors import UserError
from eagleflow.metrics.records import read_records
from eagleflow.train import speculators_support
from eagleflow.train.noise import NoisyTrainSplit, install_noise
from eagleflow.train.speculators_support import RELEASES, UnsupportedSpeculators, check_internals, installed_release
from training_data import AUX, DRAFT_VOCAB, REPO, assert_records, copy_dataset, train_argv

OLD_RELEASE = "0.8.1"
OVERLAY = REPO / ".cache" / f"speculators-{OLD_RELEASE}"
NETWORK_ERRORS = ("NewConnectionError", "ConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Network is unreachable", "Name or service not known", "ConnectTimeout", "ReadTimeout", "ProxyError")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# -- the version guard -----------------------------------------------------------------------


def test_the_pinned_release_is_installed_and_has_every_internal() -> None:
    release = installed_release()
    assert release == RELEASES["0.9.0"] and not release.noise_std_flag and release.fp8_backend
    check_internals(release)
    check_internals(RELEASES[OLD_RELEASE])  # its own list: the noise internals are not needed there


def test_unknown_releases_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("0.9.1", "0.8.0", "1.0.0"):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        with pytest.raises(UnsupportedSpeculators, match=rf"supports speculators 0\.8\.1, 0\.9\.0; found speculators '{version}'"):
            installed_release()


def test_a_missing_internal_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import speculators.train.cli as cli
    import speculators.train.dataloader as dataloader

    monkeypatch.delattr(cli, "build_draft_model")
    monkeypatch.delattr(dataloader, "ArrowDataset")
    with pytest.raises(UnsupportedSpeculators) as info:
        check_internals(RELEASES["0.9.0"])
    assert "lacks speculators.train.cli:build_draft_model, speculators.train.dataloader:ArrowDataset" in str(info.value)
    assert isinstance(info.value, UserError)


def test_the_child_and_the_step_refuse_an_unknown_release_before_training(tmp_path: Path, trained_data: Path, tiny_model: Path) -> None:
    """A dist-info saying 0.9.1 ahead of the real package on the path: both processes stop with exit 2, by name."""
    fake = tmp_path / "site" / "speculators-0.9.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: speculators\nVersion: 0.9.1\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")}
    entry = subprocess.run(
        [sys.executable, "-m", "eagleflow.train.speculators_entry", "--metrics", str(tmp_path / "m.jsonl"), "--", "--epochs", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert entry.returncode == 2 and "found speculators '0.9.1'" in entry.stderr, entry.stderr[-2000:]
    step = subprocess.run(train_argv(trained_data, tiny_model, tmp_path / "train"), capture_output=True, text=True, timeout=300, env=env)
    assert step.returncode == 2 and "found speculators '0.9.1'" in step.stderr, step.stderr[-2000:]
    assert not (tmp_path / "train" / "checkpoints").exists()


# -- eagleflow's noise (0.9.0 has none) ------------------------------------------------------


def loaders(dataset: Path, num_workers: int = 0):
    """speculators 0.9.0's own train/validation loaders over ``dataset``."""
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.dataloader import create_train_val_loaders

    return create_train_val_loaders(
        data_path=str(dataset), total_seq_len=256, hidden_states_dtype=torch.bfloat16,
        transfer=FP8Transfer(dataset / "hidden_states"), vllm_endpoint="http://unused.invalid/v1", on_missing="raise",
        verifier_name_or_path="unused", request_timeout=1.0, max_retries=0, generation_validation_retries=0,
        max_consecutive_generation_failures=1, hidden_size=64, num_target_layers=len(AUX), num_workers=num_workers,
        prefetch_factor=None, preprocess=None, train_data_ratio=0.9,
    )


def test_noise_reaches_the_training_split_only_within_plus_minus_std(trained_data: Path) -> None:
    clean_train, clean_val = (loader.dataset for loader in loaders(trained_data))
    restore = install_noise(0.05)
    try:
        train_loader, val_loader = loaders(trained_data)
    finally:
        restore()
    noisy, val = train_loader.dataset, val_loader.dataset
    assert isinstance(noisy, NoisyTrainSplit) and not isinstance(val, NoisyTrainSplit)
    assert noisy.approx_lengths == clean_train.approx_lengths and len(noisy) == len(clean_train) == 108
    differences = []
    for index in range(0, 108, 9):
        item, reference = noisy[index], clean_train[index]
        assert torch.equal(item["verifier_last_hidden_states"], reference["verifier_last_hidden_states"])
        assert torch.equal(item["input_ids"], reference["input_ids"])
        differences.append((item["hidden_states"].float() - reference["hidden_states"].float()).flatten())
    diff = torch.cat(differences)
    # Uniform in [-0.05, 0.05] (plus bf16 rounding of the sum): mean |noise| 0.025, none far past 0.05.
    assert diff.abs().max() < 0.05 + 0.02 and abs(float(diff.abs().mean()) - 0.025) < 0.004, (diff.abs().max(), diff.abs().mean())
    assert abs(float(diff.mean())) < 0.002
    for index in range(len(val)):
        assert torch.equal(val[index]["hidden_states"], clean_val[index]["hidden_states"]), "validation stays clean"
    # Spawned data-loader workers get the wrapper by pickling, noise and all.
    again = pickle.loads(pickle.dumps(noisy))
    assert again.std == 0.05 and not torch.equal(again[0]["hidden_states"], clean_train[0]["hidden_states"])


# -- fp8 hidden states, trained with speculators' fp8 backend ----------------------------------


def fp8_copy(dataset: Path, dest: Path) -> Path:
    from eagleflow.extract.sample_store import load_sample, write_sample

    copy = copy_dataset(dataset, dest)
    for path in sorted((copy / "hidden_states").glob("hs_*.safetensors")):
        tensors = load_sample(path)
        write_sample(path.parent, int(path.stem.removeprefix("hs_")), tensors["hidden_states"], tensors["token_ids"], "fp8")
    return copy


def test_an_fp8_dataset_trains_with_the_fp8_backend(trained_data: Path, tiny_model: Path, tmp_path: Path) -> None:
    dataset = fp8_copy(trained_data, tmp_path / "dataset")
    out = tmp_path / "train"
    # Two epochs: one showed the learning on one machine's build of the tiny verifier and not on another's
    # (first/last 5 steps 0.113 -> 0.187 here, at this commit and the one before alike).
    proc = subprocess.run(train_argv(dataset, tiny_model, out, "--epochs", "2"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "hidden states stored as fp8" in log and "speculators 0.9.0" in log
    command = next(line for line in log.splitlines() if line.startswith("[eagleflow] command: "))
    assert "--hidden-states-backend fp8" in command and "--noise-std 0.05 --" in command
    train, _ = assert_records(out / "metrics.jsonl", 2)
    first = np.mean([r["full_acc_0"] for r in train[:5]])
    last = np.mean([r["full_acc_0"] for r in train[-5:]])
    assert last > first + 0.1, (first, last)


# -- speculators 0.8.1 still trains ------------------------------------------------------------


@pytest.fixture(scope="session")
def old_release() -> Path:
    """speculators and hs-connectors 0.8.1 in their own folder, for PYTHONPATH (installed once)."""
    marker = OVERLAY / ".complete"
    if not marker.exists():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--timeout", "30", "--retries", "1",
               "--target", str(OVERLAY), f"speculators=={OLD_RELEASE}", f"hs-connectors=={OLD_RELEASE}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            if any(marker_text in done.stderr for marker_text in NETWORK_ERRORS):
                pytest.skip(f"PyPI unreachable, cannot install speculators=={OLD_RELEASE}")
            pytest.fail(f"pip install speculators=={OLD_RELEASE} failed:\n{done.stderr}")
        marker.write_text("ok\n")
    return OVERLAY


def old_release_env(overlay: Path) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(overlay)}


@pytest.mark.e2e
def test_speculators_0_8_1_trains_with_its_own_noise_flag(old_release: Path, trained_data: Path, tiny_model: Path, tmp_path: Path) -> None:
    env = old_release_env(old_release)
    # Where the interpreter finds speculators, without importing it (10 CPU-s): the overlay's 0.8.1, noise transforms and all.
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, importlib.util as u, pathlib; "
                            "s = u.find_spec('speculators'); n = pathlib.Path(s.origin).parent / 'train' / 'noise_transforms.py'; "
                            "print(m.version('speculators'), n if n.is_file() else None)"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert probe.stdout.startswith(f"{OLD_RELEASE} {old_release}"), probe.stdout + probe.stderr
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    out = tmp_path / "train"
    proc = subprocess.run(train_argv(dataset, tiny_model, out, "--epochs", "1"), capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert f"speculators {OLD_RELEASE}" in log
    command = next(line for line in log.splitlines() if line.startswith("[eagleflow] command: "))
    assert "--noise-std 0.0 --" in command and command.endswith("--noise-std 0.05 --num-layers 1")
    assert_records(out / "metrics.jsonl", 1)
    assert json.loads((out / "drafter.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB
    # 0.8.1 reads the draft variant's flags too and trains eagle3.1 (its DraftArgs has fc_norm).
    trained = json.loads((out / "checkpoints" / "0" / "config.json").read_text())
    assert (trained["norm_before_fc"], trained["fc_norm"], trained["norm_output"]) == (True, False, True)
    out31 = tmp_path / "train-eagle31"
    proc = subprocess.run(train_argv(copy_dataset(trained_data, tmp_path / "dataset31"), tiny_model, out31, "--epochs", "1",
                                     "--draft-algorithm", "eagle3.1"), capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = json.loads((out31 / "checkpoints" / "0" / "config.json").read_text())
    assert (trained["norm_before_fc"], trained["fc_norm"], trained["norm_output"]) == (False, True, True)

    fp8 = fp8_copy(trained_data, tmp_path / "fp8")
    refused = subprocess.run(train_argv(fp8, tiny_model, tmp_path / "fp8-train"), capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2 and "stored as fp8, which speculators 0.8.1 cannot read" in refused.stderr


def test_release_table_names_the_pins() -> None:
    """The newest supported release is the one pyproject.toml pins (and the one this environment has)."""
    pyproject = (REPO / "pyproject.toml").read_text()
    newest = list(speculators_support.RELEASES)[-1]
    assert f'"speculators=={newest}"' in pyproject and f'"hs-connectors=={newest}"' in pyproject


class SignalOnWrite(io.StringIO):
    """A log stream that sends this process SIGTERM while a record is being printed: the stop signal
    lands inside a logging handler's ``emit``, where an operator's kill can land."""

    def write(self, text: str) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return super().write(text)


@pytest.mark.parametrize("let_through", [True, False])
def test_a_stop_signal_landing_in_a_metrics_record_stops_training(tmp_path: Path, let_through: bool) -> None:
    from speculators.train.graceful_shutdown import GracefulShutdownHandler, TrainingInterruptedError

    from eagleflow.train.recorder import MetricsRecorder
    from eagleflow.train.speculators_entry import let_interrupts_through_logging

    handle_error = logging.Handler.handleError
    logger = logging.getLogger("eagleflow.test.interrupts")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    recorder = MetricsRecorder(tmp_path / "metrics.jsonl", stream=SignalOnWrite())
    logger.addHandler(recorder)
    undo = let_interrupts_through_logging() if let_through else (lambda: None)
    handler = GracefulShutdownHandler()
    handler.install()
    step = {"train": {"loss": 1.0}, "epoch": 0, "lr": 1e-4, "global_step": 7}
    try:
        if let_through:
            with pytest.raises(TrainingInterruptedError):
                logger.info(step, extra={"step": 7})
        else:  # speculators' handler alone: the interrupt is eaten by handleError and training would go on
            logger.info(step, extra={"step": 7})
    finally:
        handler.restore()
        undo()
        logger.removeHandler(recorder)
        recorder.close()
    assert logging.Handler.handleError is handle_error, "undone after training"
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [7], "the record was written before the print"
