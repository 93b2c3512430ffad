"""train: real speculators training on the tiny verifier's hidden states, on CPU.

The expensive artefacts are cached under ``.cache/test-data/`` keyed by what they depend on:
the trained tiny verifier (lead's ``tiny_model`` fixture) and a dataset of its hidden states
built the way the pipeline builds it (chat template masks, ``write_training_dataset``,
``capture_hidden_states``, ``write_sample``).
"""

from __future__ import annotations

import json
import os
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow.errors import UserError
from eagleflow.results import find_result
from eagleflow.layout import TrainLayout
from eagleflow.metrics.records import format_record
from eagleflow.metrics.records import read_records as read_metrics
from eagleflow.train.child import Device, TrainLog, child_command, speculators_flags
from eagleflow.train.config import TrainConfig
from eagleflow.train.recorder import MetricsRecorder
from eagleflow.train.resume import CHECKPOINT_FILES, prepare_checkpoints, truncate_for_resume
from eagleflow.train.speculators_support import RELEASES
from eagleflow.train.dataset_checks import check_dataset
from eagleflow.verifier.weights import EMBED, LM_HEAD, NORM, locate_weights
from eagleflow.train.verifier_head import HEAD_MANIFEST, prepare_verifier

from training_data import AUX, DRAFT_VOCAB, REPO, ROWS, TrainedRun, assert_records, copy_dataset, train_argv

@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny tensors gain nothing from a second thread, and on a shared 2-core machine
    # oversubscribed OpenMP threads make every step many times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def assert_checkpoint_set(checkpoints: Path, epochs: int) -> None:
    for epoch in range(epochs):
        for name in CHECKPOINT_FILES:
            assert (checkpoints / str(epoch) / name).is_file(), f"{checkpoints / str(epoch) / name} missing"
    assert (checkpoints / "checkpoint_best").exists()


# ---------------------------------------------------------------------------------------------
# Full runs through the CLI, the way the operator starts the step


def test_two_epochs_learn_and_record_every_step(trained_run: TrainedRun, tiny_model: Path) -> None:
    proc, out = trained_run, trained_run.out
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = find_result(proc.stdout.splitlines())
    assert result == json.loads((out / "result.json").read_text())
    assert result == {
        "checkpoint_dir": str(out / "checkpoints"),
        "best_checkpoint": str((out / "checkpoints" / "checkpoint_best").resolve()),
        "metrics_path": str(out / "metrics.jsonl"),
        "log_path": str(out / "train.log"),
        "train_seconds": result["train_seconds"],
    }
    assert 0 < result["train_seconds"] < 600, result  # the wall time of the attempt that trained (the comparison shows it)
    assert_checkpoint_set(out / "checkpoints", 2)
    train, val = assert_records(out / "metrics.jsonl", 2)

    # The drafter learns: step-0 accuracy of the last logged steps is clearly above the first ones.
    first = np.mean([r["full_acc_0"] for r in train[:5]])
    last = np.mean([r["full_acc_0"] for r in train[-5:]])
    assert last > first + 0.15, (first, last)
    assert val[-1]["full_acc_0"] > val[0]["full_acc_0"] - 0.05

    log = (out / "train.log").read_text()
    assert "step 0 epoch 0 lr " in log and " acc0 " in log and "val epoch 1 " in log
    assert "{'train'" not in log, "metric dicts are recorded, not printed raw"
    summary = [line for line in proc.stdout.splitlines() if "drafter:" in line and "trainable" in line]
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert summary and f"draft vocab {DRAFT_VOCAB} of verifier vocab {vocab}" in summary[-1]

    # The checkpoint is speculators' own model with the configured draft vocabulary.
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(result["best_checkpoint"])
    assert model.draft_vocab_size == DRAFT_VOCAB and model.lm_head.weight.shape[0] == DRAFT_VOCAB
    assert int(model.t2d.sum()) == DRAFT_VOCAB
    assert model.config.speculators_config.verifier.name_or_path == str(tiny_model)
    assert list(model.target_layer_ids) == AUX

    # Trained for the engine that serves it: SGLang's draft layer keeps the pre-norm residual.
    assert model.config.norm_before_residual is False
    assert "serving with sglang: norm_before_residual False (SGLang's" in log
    assert json.loads((out / "train-config.json").read_text())["serve_with"] == "sglang"


def start_like_the_operator(argv: list[str]) -> subprocess.Popen[str]:
    """The step in a session of its own, as EagleflowStepOperator starts it."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_training(proc: subprocess.Popen[str], metrics: Path, epoch: int, after: float) -> None:
    """Until ``metrics`` holds a train record of ``epoch`` written after ``after`` (time.time())."""
    deadline = time.monotonic() + 600
    while not any(r["kind"] == "train" and r["epoch"] == epoch and r["time"] > after for r in read_metrics(metrics)):
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        assert time.monotonic() < deadline, f"epoch {epoch + 1} never started"
        time.sleep(0.05)


def trainer_pid(out: Path) -> int:
    """The speculators child named in the folder's lock (what a refused second trainer prints)."""
    from eagleflow.train.lock import TrainFolderLock

    deadline = time.monotonic() + 120
    while not (pid := TrainFolderLock(TrainLayout(out).lock, 0).holder().get("trainer_pid")):
        assert time.monotonic() < deadline, "the step never named its speculators process"
        time.sleep(0.05)
    return int(pid)


def assert_gone(pid: int, within: float) -> None:
    from eagleflow.engine.process import pid_alive

    deadline = time.monotonic() + within
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"trainer {pid} still alive {within:.0f}s after its step was killed"
        time.sleep(0.1)


@pytest.mark.e2e
def test_killed_twice_mid_epoch_leaves_no_trainer_behind_refuses_a_second_trainer_and_the_third_run_resumes(
    trained_data: Path, tiny_model: Path, tmp_path: Path
) -> None:
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    out = tmp_path / "train"
    argv = train_argv(dataset, tiny_model, out, "--epochs", "2", "--lock-wait", "1")

    # 1. Killed hard during epoch 2: SIGKILL to the step alone, as when its task process dies
    #    without on_kill. The kernel kills its speculators child at once: no trainer is left behind.
    first = start_like_the_operator(argv)
    try:
        child = trainer_pid(out)
        # Meanwhile a second trainer on the same folder (an Airflow retry, a run by hand) is refused,
        # naming the processes that hold it, and touches nothing.
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert f"another trainer holds {out}: pid {first.pid}" in refused.stderr
        assert f"its speculators process {child} (running)" in refused.stderr
        wait_for_training(first, out / "metrics.jsonl", epoch=1, after=0)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        assert_gone(child, within=15)
    finally:
        if first.poll() is None:
            first.kill()
    epoch0 = {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints" / "0").iterdir()}
    assert (out / "checkpoints" / "0" / "training_state.json").exists()
    assert not (out / "checkpoints" / "1" / "training_state.json").exists(), "killed during epoch 2"
    steps_per_epoch = json.loads((out / "checkpoints" / "0" / "training_state.json").read_text())["global_step"]

    # 2. Killed again during epoch 2, this time the way on_kill does it: SIGTERM to the step's process group.
    restarted = time.time()
    second = start_like_the_operator(argv)
    try:
        child = trainer_pid(out)
        wait_for_training(second, out / "metrics.jsonl", epoch=1, after=restarted)
        os.killpg(second.pid, signal.SIGTERM)
        output, _ = second.communicate(timeout=300)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "training stopped by SIGTERM" in output
    assert_gone(child, within=15)
    assert not (out / "checkpoints" / "1" / "training_state.json").exists()

    # 3. The third run resumes from epoch 1's checkpoint and finishes; nothing finished is redone.
    third = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert log.count(f"resuming from checkpoint {out / 'checkpoints' / '0'} (epoch 1 of 2 finished") == 2
    assert "Resuming training on epoch 1" in log  # speculators' own word for it
    assert_checkpoint_set(out / "checkpoints", 2)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints" / "0").iterdir()} == epoch0
    assert not (out / "checkpoints" / "interrupted").exists(), "the stale interrupt checkpoint moved aside"
    train, _ = assert_records(out / "metrics.jsonl", 2)
    assert sum(r["epoch"] == 0 for r in train) == steps_per_epoch, "epoch 1's records kept, once"
    assert train[-1]["epoch"] == 1 and train[steps_per_epoch]["epoch"] == 1


# ---------------------------------------------------------------------------------------------
# Kimi-K2.5 layout: language_model.-prefixed weights and a multimodal config


def save_kimi_style(model_dir: Path, dest: Path) -> dict[str, torch.Tensor]:
    """Re-save a tiny verifier the way Kimi-K2.5 ships: prefixed weights beside a vision tower."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    prefixed = {f"language_model.{k}": v for k, v in tensors.items()}
    prefixed["vision_tower.encoder.final_layernorm.weight"] = torch.ones(8)
    prefixed["mm_projector.proj.0.weight"] = torch.zeros(4, 8)
    dest.mkdir(parents=True)
    save_file(dict(list(prefixed.items())[: len(prefixed) // 2]), str(dest / "model-00001-of-00002.safetensors"))
    save_file(dict(list(prefixed.items())[len(prefixed) // 2 :]), str(dest / "model-00002-of-00002.safetensors"))
    names = list(prefixed)
    weight_map = {k: "model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors"
                  for i, k in enumerate(names)}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = json.loads((model_dir / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": text,
        "vision_config": {"hidden_size": 8},
    }
    (dest / "config.json").write_text(json.dumps(config))
    return tensors


def test_prepare_verifier_head_for_prefixed_weights(random_tiny_model: Path, tmp_path: Path) -> None:
    assert prepare_verifier(random_tiny_model, tmp_path / "unused") == random_tiny_model.absolute()
    assert not (tmp_path / "unused").exists(), "a plain verifier is used as it is"

    kimi = tmp_path / "kimi"
    originals = save_kimi_style(random_tiny_model, kimi)
    weights = locate_weights(kimi)
    assert (weights.embed_key, weights.lm_head_key, weights.norm_key) == (
        "language_model.model.embed_tokens.weight", "language_model.lm_head.weight", "language_model.model.norm.weight"
    )
    head = prepare_verifier(kimi, tmp_path / "head")
    from safetensors.torch import load_file

    loaded = load_file(str(head / "model.safetensors"))
    assert set(loaded) == {EMBED, LM_HEAD, NORM}
    for key in (EMBED, LM_HEAD, NORM):
        assert torch.equal(loaded[key], originals[key]), key
    config = json.loads((head / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "auto_map" not in config and "text_config" not in config
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]

    # speculators itself reads the head: its config through AutoConfig, its tensors by name.
    from speculators.models.utils import get_verifier_config
    from speculators.utils.loading import load_model_layers

    assert get_verifier_config(str(head)).vocab_size == originals[EMBED].shape[0]
    assert torch.equal(load_model_layers([NORM], str(head))[NORM], originals[NORM])

    mtime = (head / "model.safetensors").stat().st_mtime_ns
    assert prepare_verifier(kimi, tmp_path / "head") == head
    assert (head / "model.safetensors").stat().st_mtime_ns == mtime, "an up-to-date head is reused"
    assert json.loads((head / HEAD_MANIFEST).read_text())["source"] == str(kimi)

    (kimi / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"vision_tower.x.weight": "a"}}))
    with pytest.raises(UserError, match="no '\\*embed_tokens.weight' tensor"):
        prepare_verifier(kimi, tmp_path / "head2")


def test_kimi_layout_trains_in_a_host_that_configured_logging_first(
    trained_data: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """speculators runs in-process after the host set up logging (as an Airflow worker does)."""
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    kimi = tmp_path / "kimi"
    originals = save_kimi_style(tiny_model, kimi)
    out = tmp_path / "train"
    script = f"""
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="HOST %(name)s %(message)s")
logging.getLogger("speculators.metrics").addHandler(logging.StreamHandler(sys.stderr))  # dropped by dictConfig
from eagleflow.train.child import Device, speculators_flags
from eagleflow.train.config import TrainConfig
from eagleflow.train.speculators_support import RELEASES
from eagleflow.layout import TrainLayout
from eagleflow.train.verifier_head import prepare_verifier
from eagleflow.data.vocab import VocabConfig, build_vocab
from eagleflow.train import speculators_entry
cfg = TrainConfig(dataset=Path({str(dataset)!r}), verifier=Path({str(kimi)!r}), out=Path({str(out)!r}),
                  aux_layer_ids={AUX!r}, epochs=1, lr=3e-3, total_seq_len=256, num_workers=0,
                  draft_vocab_size={DRAFT_VOCAB})
paths = TrainLayout(cfg.out)
build_vocab(VocabConfig(dataset=cfg.dataset, draft_vocab_size=cfg.draft_vocab_size, verifier=cfg.verifier))
head = prepare_verifier(cfg.verifier, paths.verifier_head)
release = RELEASES["0.9.0"]
speculators_entry.run(speculators_flags(cfg, head, Device("cpu", 0), paths, release), paths.metrics, paths.drafter, cfg.noise_std)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train, val = assert_records(out / "metrics.jsonl", 1)
    assert "step 0 epoch 0 lr" in proc.stdout
    assert "{'train'" not in proc.stderr and "{'val'" not in proc.stderr, "no raw metric dicts in the host's log"
    assert "HOST speculators" in proc.stderr, "the host's own root handler kept working"

    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(str(out / "checkpoints" / "0"))
    assert model.config.speculators_config.verifier.name_or_path == str(out / "verifier-head")
    t2d = model.t2d.bool()
    assert torch.equal(model.embed_tokens.weight.to(originals[EMBED].dtype), originals[EMBED])
    assert torch.equal(model.verifier_norm.weight.to(originals[NORM].dtype), originals[NORM])
    assert torch.equal(model.verifier_lm_head.weight.to(originals[LM_HEAD].dtype), originals[LM_HEAD][t2d])
    drafter = json.loads((out / "drafter.json").read_text())
    assert drafter["verifier_vocab_size"] == originals[EMBED].shape[0] and drafter["draft_vocab_size"] == DRAFT_VOCAB
    assert 0 < drafter["trainable_parameters"] < drafter["total_parameters"]


# ---------------------------------------------------------------------------------------------
# Pieces, without training


def test_defaults_are_the_seed_run_and_flags_reach_speculators(tmp_path: Path) -> None:
    cfg = TrainConfig(dataset=tmp_path / "d", verifier=tmp_path / "v", out=tmp_path / "o", aux_layer_ids=[3, 31, 59])
    seed = dict(epochs=5, lr=3e-5, total_seq_len=2048, ttt_steps=3, noise_std=0.05, scheduler_type="cosine",
                scheduler_warmup_ratio=0.01, num_workers=4, draft_vocab_size=32000, optimizer="adamw")
    assert {k: getattr(cfg, k) for k in seed} == seed
    for field, info in TrainConfig.model_fields.items():
        assert info.description, f"{field} has no description"

    paths = TrainLayout(tmp_path / "o")
    flags = speculators_flags(cfg, Path("/abs/verifier"), Device("cpu", 0), paths, RELEASES["0.9.0"])
    assert flags[flags.index("--target-layer-ids") + 1 : flags.index("--target-layer-ids") + 4] == ["3", "31", "59"]
    assert flags.count("--target-layer-ids") == 1
    pairs = dict(zip(flags[::1], flags[1::1]))
    assert pairs["--optimizer"] == "adamw" and pairs["--lr"] == "3e-05" and pairs["--scheduler-type"] == "cosine"
    assert pairs["--loss-implementation"] == "eager" and pairs["--draft-attn-impl"] == "sdpa"
    assert pairs["--on-missing"] == "raise" and pairs["--mask-token-id"] == "0"
    assert pairs["--save-path"] == str((tmp_path / "o" / "checkpoints").absolute())
    # 0.9.0 has no --noise-std (an argparse error): the child entry adds eagleflow's noise instead.
    assert "--noise-std" not in flags and "--hidden-states-backend" not in flags
    cpu = child_command(Device("cpu", 0), paths, flags, cfg.noise_std)
    assert cpu[:4] == [sys.executable, "-u", "-m", "eagleflow.train.speculators_entry"]
    assert cpu[cpu.index("--noise-std") + 1] == "0.05" and cpu.index("--noise-std") < cpu.index("--")

    # Every flag we pass is one speculators' own parser accepts (0.9.0, the installed release).
    from speculators.train.config import TrainConfig as SpeculatorsConfig

    parsed = SpeculatorsConfig.resolve(flags)
    assert parsed.draft.target_layer_ids == [3, 31, 59] and parsed.optimizer.lr == 3e-5
    assert parsed.scheduler.scheduler_warmup_ratio == 0.01 and parsed.data.hidden_states_backend == "file"
    fp8 = speculators_flags(cfg, Path("/abs/verifier"), Device("cpu", 0), paths, RELEASES["0.9.0"], "fp8")
    assert SpeculatorsConfig.resolve(fp8).data.hidden_states_backend == "fp8"
    with pytest.raises(SystemExit):  # what 0.9.0 says to 0.8.1's noise flag
        SpeculatorsConfig.resolve([*flags, "--noise-std", "0.05"])
    # serve_with decides what speculators trains: SGLang's function by default, its own default for vLLM.
    assert parsed.draft.norm_before_residual is False
    vllm = cfg.model_copy(update={"serve_with": "vllm"})
    vllm_flags = speculators_flags(vllm, Path("/v"), Device("cpu", 0), paths, RELEASES["0.9.0"])
    assert SpeculatorsConfig.resolve(vllm_flags).draft.norm_before_residual
    # draft_algorithm decides how the aux states are normed before fc; both feed each step the normed state.
    assert (parsed.draft.norm_before_fc, parsed.draft.fc_norm, parsed.draft.norm_output) == (True, False, True)
    assert parsed.speculator_type == "eagle3" and parsed.draft.draft_vocab_size == cfg.draft_vocab_size
    eagle31 = speculators_flags(cfg.model_copy(update={"draft_algorithm": "eagle3.1"}), Path("/v"), Device("cpu", 0), paths,
                                RELEASES["0.9.0"])
    draft = SpeculatorsConfig.resolve(eagle31).draft
    assert (draft.norm_before_fc, draft.fc_norm, draft.norm_output) == (False, True, True)
    # dflash: speculators' block drafter, the mask token given, the full vocabulary, its family's defaults.
    dflash_cfg = TrainConfig(**{**cfg.model_dump(), "draft_algorithm": "dflash", "num_layers": None})
    assert (dflash_cfg.num_layers, dflash_cfg.block_size) == (5, 16)
    dflash = SpeculatorsConfig.resolve(
        speculators_flags(dflash_cfg, Path("/v"), Device("cpu", 0), paths, RELEASES["0.9.0"], mask_token_id=7))
    assert (dflash.speculator_type, dflash.dflash.block_size, dflash.draft.mask_token_id) == ("dflash", 16, 7)
    assert dflash.draft.num_layers == 5 and dflash.draft.draft_vocab_size is None and dflash.draft.target_layer_ids == [3, 31, 59]
    with pytest.raises(UserError, match=r"dflash needs speculators >= 0.9.0 .* found speculators 0.8.1"):
        speculators_flags(dflash_cfg, Path("/v"), Device("cpu", 0), paths, RELEASES["0.8.1"], mask_token_id=7)

    # 0.8.1 still gets its own noise flag, and cannot read fp8 files.
    old = speculators_flags(cfg, Path("/abs/verifier"), Device("cpu", 0), paths, RELEASES["0.8.1"])
    assert old[old.index("--noise-std") + 1] == "0.05" and "--hidden-states-backend" not in old
    with pytest.raises(UserError, match="stored as fp8, which speculators 0.8.1 cannot read"):
        speculators_flags(cfg, Path("/abs/verifier"), Device("cpu", 0), paths, RELEASES["0.8.1"], "fp8")

    gpu = speculators_flags(cfg, Path("/abs/verifier"), Device("cuda", 8), paths, RELEASES["0.9.0"])
    assert "fused" in gpu and "simple_flex_attention" in gpu
    command = child_command(Device("cuda", 8), paths, gpu)
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8"]
    assert command[5:7] == ["-m", "eagleflow.train.speculators_entry"] and command[-len(gpu):] == gpu

    with pytest.raises(ValueError, match=r"aux layer ids \[2, 2\] repeat \[2\]"):
        TrainConfig(dataset=tmp_path, verifier=tmp_path, out=tmp_path, aux_layer_ids=[2, 2])

    # The operator builds the step's argv with model_to_argv; the step's parser reads it back.
    import argparse

    from eagleflow.config import model_from_args, model_to_argv
    from eagleflow.train.step import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    custom = cfg.model_copy(update={"draft_config": tmp_path / "draft.json", "gpus": 2, "restart": True})
    assert model_from_args(TrainConfig, parser.parse_args(model_to_argv(custom))) == custom


def test_dataset_checks_name_the_problem(trained_data: Path, tmp_path: Path) -> None:
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    cfg = TrainConfig(dataset=dataset, verifier=tmp_path, out=tmp_path / "o", aux_layer_ids=AUX)
    assert check_dataset(cfg, hidden_size=64) == (ROWS, "bf16")

    with pytest.raises(UserError, match=r"need \[seq_len, 3, 64\]"):
        check_dataset(cfg.model_copy(update={"aux_layer_ids": [2, 4]}), hidden_size=64)
    with pytest.raises(UserError, match=r"need \[seq_len, 4, 32\]"):
        check_dataset(cfg, hidden_size=32)
    # One row re-extracted in the other storage dtype: speculators would read it wrong, so it is refused.
    from eagleflow.extract.sample_store import load_sample, write_sample

    hs_dir = dataset / "hidden_states"
    original = load_sample(hs_dir / "hs_3.safetensors")
    write_sample(hs_dir, 3, original["hidden_states"], original["token_ids"], "fp8")
    with pytest.raises(UserError, match=r"not all stored alike \(bf16: rows 0, 1, 2, 4, .* …; fp8: rows 3\)"):
        check_dataset(cfg, hidden_size=64)
    (hs_dir / "hs_5.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"unreadable or another dtype: rows 5\)"):
        check_dataset(cfg, hidden_size=64)
    write_sample(hs_dir, 3, original["hidden_states"], original["token_ids"])
    (hs_dir / "hs_5.safetensors").unlink()
    (hs_dir / "hs_7.safetensors").unlink()
    (hs_dir / "hs_9.safetensors").unlink()
    with pytest.raises(UserError, match=r"3 of 120 rows have no hidden states .*\(rows 5, 7, 9\)"):
        check_dataset(cfg, hidden_size=64)
    state = json.loads((dataset / "state.json").read_text())
    (dataset / "state.json").write_text(json.dumps({**state, "_format_type": None}))
    with pytest.raises(UserError, match="set_format\\('torch'\\)"):
        check_dataset(cfg, hidden_size=64)


def test_the_dataset_and_verifier_checks_import_neither_torch_nor_datasets(
    trained_data: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """They run while the speculators child imports both on the other core: headers and Arrow files only.
    (torch in the step also cost 0.6 s at its exit, after training: its interpreter's teardown.)"""
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from eagleflow.train.config import TrainConfig\n"
        "from eagleflow.train.dataset_checks import check_dataset\n"
        "from eagleflow.train.verifier_head import prepare_verifier\n"
        f"cfg = TrainConfig(dataset=Path({str(trained_data)!r}), verifier=Path('.'), out=Path({str(tmp_path / 'o')!r}), "
        f"aux_layer_ids={AUX!r})\n"
        "print(check_dataset(cfg, 64))\n"
        f"print(prepare_verifier(Path({str(tiny_model)!r}), Path({str(tmp_path / 'head')!r})))\n"
        "print(sorted(m for m in ('torch', 'datasets', 'safetensors', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"({ROWS}, 'bf16')", str(tiny_model.absolute()), "[]"]


def test_device_auto_on_a_machine_without_a_gpu_driver_is_cpu_without_importing_torch(tmp_path: Path) -> None:
    """No GPU driver node: cpu, and torch (seconds of the step's start) is not imported to learn it. With a
    driver node, torch is asked, and its answer is what the step uses."""
    node = tmp_path / "nvidiactl"
    node.touch()
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from eagleflow.errors import UserError\n"
        "from eagleflow.train import child\n"
        "from eagleflow.train.config import TrainConfig\n"
        "def cfg(**kw): return TrainConfig(dataset=Path('d'), verifier=Path('v'), out=Path('o'), aux_layer_ids=[2, 4, 6], **kw)\n"
        f"child.GPU_DRIVER_NODES = ({str(tmp_path / 'absent')!r},)\n"
        "print(child.resolve_device(cfg(device='auto')), 'torch' in sys.modules)\n"
        "try:\n"
        "    child.resolve_device(cfg(device='auto', gpus=1))\n"
        "except UserError as exc:\n"
        "    print(exc, 'torch' in sys.modules)\n"
        f"child.GPU_DRIVER_NODES = ({str(node)!r},)\n"
        "import torch\n"
        "seen = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "print(child.resolve_device(cfg(device='auto')) == child.Device('cuda' if seen else 'cpu', seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "Device(kind='cpu', gpus=0) False",
        "--gpus 1: torch sees no GPU (use --device cpu without --gpus to train on CPU) False",
        "True",
    ]


def test_the_trainer_started_before_the_checks_exits_untrained_when_they_refuse_the_dataset(
    trained_data: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The speculators child starts before the dataset checks, so its imports overlap them; a
    refused dataset stops it without training, and the step reports the check's own error."""
    dataset = copy_dataset(trained_data, tmp_path / "dataset")
    (dataset / "hidden_states" / "hs_5.safetensors").unlink()
    out = tmp_path / "train"
    proc = subprocess.run(train_argv(dataset, tiny_model, out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 of 120 rows have no hidden states" in proc.stderr, proc.stderr[-2000:]
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(out) in _cmdline(int(pid))]
    assert not left, f"processes left on {out}: {left}"
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert "command:" not in (out / "train.log").read_text()  # it never got its flags


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _fake_checkpoint(path: Path, global_step: int) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    (path / "optimizer_state_dict.pt").write_bytes(b"x")
    (path / "training_state.json").write_text(json.dumps({"epoch": int(path.name), "local_step": 0, "global_step": global_step}))


def test_resume_point_cleanup_and_mismatched_settings(tmp_path: Path) -> None:
    cfg = TrainConfig(dataset=tmp_path, verifier=tmp_path, out=tmp_path / "o", aux_layer_ids=AUX, epochs=3)
    paths = TrainLayout(cfg.out)
    log = TrainLog(paths.log)
    assert prepare_checkpoints(cfg, paths, log) is None

    _fake_checkpoint(paths.checkpoints / "0", 10)
    _fake_checkpoint(paths.checkpoints / "1", 20)
    (paths.checkpoints / "2").mkdir()  # killed while saving epoch 3
    (paths.checkpoints / "2" / "config.json").write_text("{}")
    (paths.checkpoints / "interrupted").mkdir()
    (paths.checkpoints / "epoch2_end").symlink_to("2")
    lines = [{"kind": "train", "step": s, "epoch": s // 10} for s in range(25)] + [
        {"kind": "val", "step": 10, "epoch": 0}, {"kind": "val", "step": 20, "epoch": 1}, {"kind": "val", "step": 25, "epoch": 2}]
    paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "tra')  # torn last line
    paths.config.write_text(cfg.model_dump_json())

    point = prepare_checkpoints(cfg, paths, log)
    assert point is not None and (point.epoch, point.global_step) == (1, 20)
    assert not (paths.checkpoints / "2").exists() and not (paths.checkpoints / "interrupted").exists()
    assert not (paths.checkpoints / "epoch2_end").is_symlink()
    moved = list(paths.previous.glob("*/2"))
    assert moved and (moved[0].parent / "interrupted").exists()
    kept = list(read_metrics(paths.metrics))
    assert [r["step"] for r in kept if r["kind"] == "train"] == list(range(20))
    assert [r["epoch"] for r in kept if r["kind"] == "val"] == [0, 1]
    assert "resuming from checkpoint" in paths.log.read_text()

    # A run made before draft_algorithm (then draft_variant) existed trained eagle3 (speculators' defaults).
    stored = json.loads(paths.config.read_text())
    del stored["draft_algorithm"], stored["block_size"]
    paths.config.write_text(json.dumps(stored))
    with pytest.raises(UserError, match=r"--draft-algorithm was eagle3, now eagle3.1"):
        prepare_checkpoints(cfg.model_copy(update={"draft_algorithm": "eagle3.1"}), paths, log)
    # ... and one made while it was called draft_variant, with the name it had then.
    paths.config.write_text(json.dumps({**stored, "draft_variant": "eagle3.1"}))
    with pytest.raises(UserError, match=r"--draft-algorithm was eagle3.1, now eagle3\)"):
        prepare_checkpoints(cfg, paths, log)
    paths.config.write_text(json.dumps(stored))
    with pytest.raises(UserError, match=r"--epochs was 3, now 5.*pass --restart"):
        prepare_checkpoints(cfg.model_copy(update={"epochs": 5}), paths, log)
    assert prepare_checkpoints(cfg.model_copy(update={"epochs": 5, "restart": True}), paths, log) is None
    assert not paths.checkpoints.exists() and not paths.metrics.exists()
    log.close()


def test_an_epoch_saved_but_not_validated_is_redone_not_resumed_from(tmp_path: Path) -> None:
    """speculators saves an epoch, then validates it: a run stopped mid-validation (an online feed that lost its
    engine or its store) leaves a whole checkpoint of an unvalidated epoch, which a resume would never validate."""
    cfg = TrainConfig(dataset=tmp_path, verifier=tmp_path, out=tmp_path / "o", aux_layer_ids=AUX, epochs=3)
    paths = TrainLayout(cfg.out)
    log = TrainLog(paths.log)
    _fake_checkpoint(paths.checkpoints / "0", 10)
    _fake_checkpoint(paths.checkpoints / "1", 20)
    records = [{"kind": "train", "step": s, "epoch": s // 10} for s in range(20)] + [{"kind": "val", "step": 10, "epoch": 0}]
    paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    paths.config.write_text(cfg.model_dump_json())
    point = prepare_checkpoints(cfg, paths, log)
    assert point is not None and (point.epoch, point.global_step) == (0, 10), "epoch 1 is trained and validated again"
    assert list(paths.previous.glob("*/1")) and not (paths.checkpoints / "1").exists()
    assert [r["step"] for r in read_metrics(paths.metrics) if r["kind"] == "train"] == list(range(10))
    assert "an epoch whose validation did not finish" in paths.log.read_text()
    # Validated (speculators' own val_metrics.json, or our val record): resumed from as it is.
    _fake_checkpoint(paths.checkpoints / "1", 20)
    (paths.checkpoints / "1" / "val_metrics.json").write_text("{}")
    point = prepare_checkpoints(cfg, paths, log)
    assert point is not None and point.epoch == 1
    log.close()


def test_metric_records_from_speculators_dicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now = iter([100.0, 101.0, 102.0])
    recorder = MetricsRecorder(tmp_path / "m.jsonl", clock=lambda: next(now))
    logger = logging.getLogger("test.speculators.metrics")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    try:
        recorder.begin_epoch(0, 2, 10, 0)
        train = {"loss_0": 1.5, "full_acc_0": 0.25, "cond_acc_0": 0.25, "kl_div_0": 1.5, "loss_1": 1.7,
                 "full_acc_1": 0.1, "cond_acc_1": 0.4, "loss": 3.2, "error_records": 0.0}
        logger.info({"train": train, "profile": {"tokens_per_s": 500.0}, "epoch": 0, "lr": {"Muon": 3e-4, "AdamW": 3e-5},
                     "global_step": 0}, extra={"step": 0})
        logger.info({"train": {**train, "loss": float("nan")}, "profile": None, "epoch": 0, "lr": 3e-5, "global_step": 1},
                    extra={"step": 1})
        logger.info({"val": {"loss_0_epoch": 1.0, "full_acc_0_epoch": 0.5, "cond_acc_0_epoch": 0.5, "loss_epoch": 2.0},
                     "epoch": 0}, extra={"step": 2})
        logger.info({"verifier": {"x": 1}}, extra={"hparams": True})  # run config: not a metric record
        logger.info("a plain message")
    finally:
        logger.removeHandler(recorder)
        recorder.close()
    records = list(read_metrics(tmp_path / "m.jsonl"))
    assert records[0] == {"kind": "train", "step": 0, "epoch": 0, "lr": 3e-5, "loss": 3.2, "loss_0": 1.5,
                          "full_acc_0": 0.25, "cond_acc_0": 0.25, "loss_1": 1.7, "full_acc_1": 0.1, "cond_acc_1": 0.4,
                          "tokens_per_s": 500.0, "time": 100.0}
    assert records[1]["loss"] is None and records[1]["tokens_per_s"] is None
    assert records[2] == {"kind": "val", "step": 2, "epoch": 0, "loss": 2.0, "loss_0": 1.0, "full_acc_0": 0.5,
                          "cond_acc_0": 0.5, "time": 102.0}
    assert len(records) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 0 epoch 0 lr 3.0e-05 loss 3.2000 acc0 0.250 acc1 0.100 500 tok/s [epoch 1/2 step 1/10")
    assert lines[1].startswith("step 1 epoch 0 lr 3.0e-05 loss nan")
    assert lines[2] == format_record(records[2]) == "val epoch 0 step 2 loss 2.0000 acc0 0.500"
    assert truncate_for_resume(tmp_path / "m.jsonl", resume_step=1, last_epoch=-1) == 2
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [0]


@pytest.mark.e2e
def test_a_finished_training_is_reused_until_its_dataset_changes(trained_data: Path, tiny_model: Path, tmp_path: Path) -> None:
    """A rerun on the same data (Airflow's clear of a complete shard with its downstream tasks) finishes at once,
    saying so, checkpoints untouched, and so does one after the same rows were written again (prepare-dataset cleared);
    a rewritten hidden-state file (a cleared failed shard, a re-extraction) trains again from the start, the former
    run moved aside."""
    from training_data import train_argv, train_once

    first = train_once(trained_data, tiny_model, tmp_path, 1)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    argv = train_argv(first.dataset, tiny_model, first.out, "--epochs", "1")
    checkpoint = first.best_checkpoint
    made = {p: p.stat().st_mtime_ns for p in checkpoint.iterdir()}
    began = time.monotonic()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "train: reusing the finished result" in again.stdout, again.stdout[-3000:]
    assert find_result(again.stdout.splitlines()) == find_result(first.stdout.splitlines())
    assert {p: p.stat().st_mtime_ns for p in checkpoint.iterdir()} == made
    assert time.monotonic() - began < 60, "nothing but the record was read"

    # prepare-dataset run again over the same input: the same rows in new files, and every file touched besides.
    from eagleflow.data import dataset_table
    from eagleflow.data.prepare import write_training_dataset

    table = dataset_table(first.dataset, ["input_ids", "loss_mask"])
    write_training_dataset(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), first.dataset)
    for item in first.dataset.glob("*.*"):
        os.utime(item)
    rewritten = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert rewritten.returncode == 0 and "train: reusing the finished result" in rewritten.stdout, rewritten.stdout[-3000:]

    row = first.dataset / "hidden_states" / "hs_3.safetensors"
    row.write_bytes(row.read_bytes())  # the same states rewritten: another file as far as anyone can tell
    retrained = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert retrained.returncode == 0, retrained.stdout[-3000:] + retrained.stderr[-3000:]
    assert "the dataset changed since the training" in retrained.stdout and "reusing" not in retrained.stdout
    assert "--restart: moved" in retrained.stdout and list((first.out / "previous").iterdir())
    assert json.loads((first.out / "result.json").read_text())["best_checkpoint"] and TrainLayout(first.out).metrics.exists()
