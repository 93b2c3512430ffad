"""Hidden-state training data of the tiny verifier, and a drafter trained on it: shared by the
training, export, speculative-decoding and evaluation tests.

The expensive artefacts are cached under ``.cache/test-data/`` keyed by what they depend on:
the trained tiny verifier (the session's ``tiny_model``) and a dataset of its hidden states
built the way the pipeline builds it (chat template masks, ``write_training_dataset``,
``capture_hidden_states``, ``write_sample``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagleflow.demo.tiny_model import build_lock
from eagleflow.metrics.records import read_records

REPO = Path(__file__).resolve().parents[1]
DATA_CACHE = REPO / ".cache" / "test-data"
AUX = [2, 4, 6]
ROWS = 120
DRAFT_VOCAB = 256
DATA_RECIPE = 2  # bump when the dataset recipe below changes (2: with its draft vocabulary)
# Small and fast: the drafter learns the trained tiny verifier within two epochs at this lr.
FAST = ["--total-seq-len", "256", "--num-workers", "0", "--draft-vocab-size", str(DRAFT_VOCAB), "--lr", "3e-3"]


def build_dataset(model_dir: Path, out: Path, rows: int, seed: int) -> Path:
    """Conversations -> chat-template masks -> §3.3 dataset -> captured hidden states -> the
    ``DRAFT_VOCAB`` draft vocabulary (as the DAG's build_vocab task leaves it before training)."""
    from transformers import AutoModelForCausalLM

    from eagleflow.engine.capture import capture_hidden_states
    from eagleflow.data import VocabConfig, build_vocab
    from eagleflow.data.chat_tokens import ChatTokenizer
    from eagleflow.data.prepare import write_training_dataset
    from eagleflow.extract.sample_store import write_sample
    from eagleflow.demo.synthetic_data import generate_conversations

    chat = ChatTokenizer(model_dir)
    encoded = [chat(c["messages"]) for c in generate_conversations(rows, seed=seed)]
    ids, masks = [e[0][:256] for e in encoded], [e[1][:256] for e in encoded]
    write_training_dataset(ids, masks, out)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for row, row_ids in enumerate(ids):
        write_sample(out / "hidden_states", row, capture_hidden_states(model, row_ids, AUX), torch.tensor(row_ids))
    build_vocab(VocabConfig(dataset=out, draft_vocab_size=DRAFT_VOCAB, verifier=model_dir))
    return out


def cached_dataset(model_dir: Path, rows: int = ROWS, seed: int = 11) -> Path:
    record = (model_dir / "eagleflow_tiny_model.json").read_bytes()
    key = hashlib.sha256(record + json.dumps([DATA_RECIPE, rows, seed, AUX]).encode()).hexdigest()[:16]
    final = DATA_CACHE / f"train-{key}" / "dataset"
    if (final.parent / "done").exists():
        return final
    # Parallel test workers: one builds, the others wait and find it (a second build would delete
    # the first one's folder under its readers).
    with build_lock(final.parent):
        if not (final.parent / "done").exists():
            staging = DATA_CACHE / f".train-{key}.{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            build_dataset(model_dir, staging / "dataset", rows, seed)
            (staging / "done").write_text("ok\n")
            shutil.rmtree(final.parent, ignore_errors=True)
            os.replace(staging, final.parent)
    return final


def copy_dataset(dataset: Path, dest: Path) -> Path:
    """A private copy (the step writes vocabulary files into the dataset folder)."""
    shutil.copytree(dataset, dest, symlinks=True)
    return dest


def train_argv(dataset: Path, verifier: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(verifier),
            "--out", str(out), "--aux-layer-ids", ",".join(map(str, AUX)), *FAST, *extra]


@dataclass(frozen=True)
class TrainedRun:
    """``python -m eagleflow train`` run once: its dataset copy, its folder and what it printed."""

    dataset: Path
    out: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def best_checkpoint(self) -> Path:
        return Path(json.loads((self.out / "result.json").read_text())["best_checkpoint"])


def train_once(dataset: Path, verifier: Path, folder: Path, epochs: int = 2, *extra: str) -> TrainedRun:
    """Train a drafter on a private copy of ``dataset`` (the defaults: served with SGLang; ``extra``: more flags)."""
    import subprocess

    copy = copy_dataset(dataset, folder / "dataset")
    out = folder / "train"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        train_argv(copy, verifier, out, "--epochs", str(epochs), *extra), capture_output=True, text=True, timeout=900, env=env
    )
    return TrainedRun(copy, out, proc.returncode, proc.stdout, proc.stderr)


def train_once_per_run(dataset: Path, verifier: Path, folder: Path) -> TrainedRun:
    """:func:`train_once` with the defaults into ``folder``, unless a worker of this test run did it already.

    ``folder``: one that this run's xdist workers share and no later run sees; never a cache
    across runs, since what it holds checks the code under test.
    """
    printed = folder / "printed.json"  # written last: the run is complete
    with build_lock(folder):
        if not printed.exists():
            shutil.rmtree(folder, ignore_errors=True)
            run = train_once(dataset, verifier, folder)
            printed.write_text(json.dumps([run.returncode, run.stdout, run.stderr]))
    returncode, stdout, stderr = json.loads(printed.read_text())
    return TrainedRun(folder / "dataset", folder / "train", returncode, stdout, stderr)


def random_speculators_checkpoint(
    verifier: Path,
    out: Path,
    norm_before_residual: bool,
    aux_layer_ids: list[int],
    draft_vocab: int,
    num_layers: int = 2,
    randomize: bool = True,
    vocab_mapping: tuple[Any, Any] | None = None,
    draft_flags: dict[str, bool] | None = None,
    layer_settings: dict[str, Any] | None = None,
) -> Path:
    """speculators' EAGLE-3 draft for ``verifier``, saved as speculators saves a checkpoint.

    ``randomize``: every weight random (a norm left at its initial ones would hide a mix-up);
    otherwise speculators' own initialisation (an untrained drafter). ``vocab_mapping``:
    ``(d2t, t2d)`` to use instead of a synthetic one. ``draft_flags``: speculators' draft flags
    instead of speculators 0.9.0's EAGLE-3 defaults (``norm_before_fc``, ``norm_output`` on,
    ``fc_norm`` off); ``layer_settings``: set on the draft layer config (``attention_bias``,
    ``rope_parameters``, …) before the model is built.
    """
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(0)
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    frequencies = {i: 1000 - i for i in range(0, 2 * draft_vocab, 2)}
    d2t, t2d = vocab_mapping or build_vocab_mappings_from_distribution(
        token_freq_dict=frequencies, draft_vocab_size=draft_vocab, target_vocab_size=vocab
    )
    layer = create_transformer_layer_config(
        verifier_name_or_path=str(verifier), num_layers=num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=2048, full_attention_indices=[],
    )
    for key, value in (layer_settings or {}).items():
        setattr(layer, key, value)
    flags = {"norm_before_fc": True, "norm_output": True, "fc_norm": False, **(draft_flags or {})}
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier), target_layer_ids=aux_layer_ids,
        draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual, ttt_steps=3, draft_attn_impl="sdpa", **flags,
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters() if randomize else ():
            if "embed" not in name and "verifier" not in name:
                shift = 1.0 if parameter.dim() == 1 else 0.0  # norms around 1, matrices around 0
                parameter.copy_(torch.randn_like(parameter) * (1.0 if parameter.dim() == 1 else 0.1) + shift)
    model.save_pretrained(out)
    return out


def random_dflash_checkpoint(
    verifier: Path,
    out: Path,
    aux_layer_ids: list[int],
    block_size: int = 4,
    num_layers: int = 2,
    mask_token_id: int = 0,
    layer_settings: dict[str, Any] | None = None,
    full_attention_indices: list[int] | None = None,
    randomize: bool = True,
    dspark: dict[str, Any] | None = None,
) -> Path:
    """speculators' DFlash block draft for ``verifier`` (full vocabulary), saved as speculators saves one; with
    ``dspark`` (its settings: ``markov_rank``, ``markov_head_type``, …), speculators' DSpark draft instead.

    The layer config is the one ``speculators train --speculator-type dflash --draft-arch qwen3``
    builds (sliding window 2048; ``full_attention_indices``: the layers on full attention, none by
    default as speculators' CLI); ``layer_settings``: set on it (``num_key_value_heads``,
    ``rope_parameters``, ``sliding_window``, ``attention_bias``, …) before the model is built.
    ``randomize``: every saved weight random (a norm left at ones would hide a mix-up); the
    embedding and head stay the verifier's, as a full-vocabulary draft does not save them.
    """
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(0)
    layer = create_transformer_layer_config(
        verifier_name_or_path=str(verifier), num_layers=num_layers, draft_arch="qwen3", hidden_act=None,
        sliding_window=2048, full_attention_indices=list(full_attention_indices or []),
    )
    for key, value in (layer_settings or {}).items():
        setattr(layer, key, value)
    model = (DFlashDraftModel if dspark is None else DSparkDraftModel).from_training_args(
        verifier_config=layer, verifier_name_or_path=str(verifier), target_layer_ids=aux_layer_ids,
        draft_vocab_size=layer.vocab_size, block_size=block_size, mask_token_id=mask_token_id, draft_attn_impl="sdpa",
        **(dspark or {}),
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters() if randomize else ():
            if not name.startswith(("embed_tokens", "lm_head", "verifier_")):
                norm = "norm" in name  # norms around 1, matrices and biases around 0
                parameter.copy_(torch.randn_like(parameter) * (1.0 if norm else 0.1) + (1.0 if norm else 0.0))
    model.save_pretrained(out)
    return out


def tampered_checkpoint(
    checkpoint: Path,
    dest: Path,
    config: dict[str, Any] | None = None,
    weights: Any = None,
) -> Path:
    """A copy of ``checkpoint`` at ``dest`` whose ``config.json`` has ``config``'s keys set and whose
    ``model.safetensors`` is rewritten by ``weights`` (a function editing the name -> tensor dict)."""
    shutil.copytree(checkpoint, dest)
    edit_folder(dest, (lambda settings: settings.update(config)) if config else None, weights)
    return dest


def edit_folder(folder: Path, config: Any = None, weights: Any = None) -> None:
    """Rewrite ``folder``'s ``config.json`` by ``config`` and its ``model.safetensors`` by ``weights`` (functions
    editing the parsed dict, the name -> tensor dict), in place."""
    from safetensors.torch import load_file, save_file

    if config is not None:
        settings = json.loads((folder / "config.json").read_text())
        config(settings)
        (folder / "config.json").write_text(json.dumps(settings, indent=2))
    if weights is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        weights(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def folder_snapshot(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``folder``: (inode, mtime_ns, sha256) by relative path, to show it was not touched."""
    return {
        str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def staging_leftovers(out: Path) -> list[str]:
    """Staging (or old) folders an atomic write of ``out`` left beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


TRAIN_KEYS = {"kind", "step", "epoch", "lr", "loss", "tokens_per_s", "time"}
VAL_KEYS = {"kind", "step", "epoch", "loss", "time"}


def assert_records(metrics: Path, epochs: int, online: bool = False) -> tuple[list[dict], list[dict]]:
    """The metrics file holds one train record per step and one val record per epoch, every key present
    (``online``: the train records also carry the trainer's ``data_wait_s``)."""
    records = list(read_records(metrics))
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == list(range(len(train))), "one record per step, in order, no repeats"
    assert sorted({r["epoch"] for r in train}) == list(range(epochs))
    assert [r["epoch"] for r in val] == list(range(epochs))
    ttt = {f"{name}_{k}" for k in range(3) for name in ("loss", "full_acc", "cond_acc")}
    train_keys = TRAIN_KEYS | ttt | ({"data_wait_s"} if online else set())
    for r in train:
        assert set(r) == train_keys, set(r) ^ train_keys
        assert isinstance(r["lr"], float) and isinstance(r["loss"], float) and r["tokens_per_s"] > 0
    for r in val:
        assert set(r) == VAL_KEYS | ttt
    return train, val


# A thinking, tool-calling conversation (two user messages: a Qwen3- or Kimi-like template drops the thinking of the
# turns before the second) and its tools, for the tests of chat formats and of regeneration.
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
THINKING_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny, 21 C.", "reasoning_content": "The tool says sunny."},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
]
