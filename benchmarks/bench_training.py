"""Benchmark: what ``python -m eagleflow train`` costs on top of speculators' own training.

Both train the same drafter on the same data with the same speculators flags (the ones
``eagleflow train`` builds): (a) ``python -m eagleflow train`` — dataset checks, the folder
lock, resume bookkeeping, the child process, metrics capture, log streaming; (b) speculators'
own entry point (``speculators.train.cli.main``) called directly, with nothing but the three CPU
device shims it needs to run on a CPU at all. Wall time of each whole process, alternating,
three of each. Both are dominated by importing torch, transformers and speculators (10-16 s of a
~20 s run here, and that time swings by seconds from run to run on a shared VM), so the figure
compares the least time of each: noise only ever adds time, and the least is each command's own
cost.

The data are the demo's: synthetic conversations, chat-template masks, a tiny DeepSeek-V3
verifier (untrained: the figure is about time, not accuracy) and its captured hidden states.
Run: ``.venv/bin/python benchmarks/bench_training.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench_common import REPO, Row, run_alone

AUX, ROWS, DRAFT_VOCAB = [2, 4, 6], 64, 256
# No noise: speculators 0.9.0 has none, so eagleflow's own would be extra work, not overhead.
FAST = ["--epochs", "1", "--total-seq-len", "256", "--num-workers", "0", "--draft-vocab-size", str(DRAFT_VOCAB), "--device", "cpu",
        "--noise-std", "0"]
GOAL_OVERHEAD = 0.05
PAIRS = 3

_DIRECT = """
import sys
from eagleflow.train.speculators_entry import apply_cpu_shims
apply_cpu_shims()
from speculators.train.cli import main
from speculators.train.config import TrainConfig
main(TrainConfig.resolve(sys.argv[1:]))
"""


def demo_data(work: Path) -> tuple[Path, Path]:
    """The tiny verifier (cached under .cache/test-models) and a dataset of its hidden states."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagleflow.data.chat_tokens import ChatTokenizer
    from eagleflow.data.prepare import write_training_dataset
    from eagleflow.demo.synthetic_data import generate_conversations
    from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model
    from eagleflow.engine.capture import capture_hidden_states
    from eagleflow.extract.sample_store import write_sample

    model = make_tiny_model(TinyModelConfig(out=REPO / ".cache" / "test-models" / "tiny-random", train_steps=0, corpus_rows=400))
    chat = ChatTokenizer(model)
    encoded = [chat(c["messages"]) for c in generate_conversations(ROWS, seed=5)]
    ids, masks = [e[0][:256] for e in encoded], [e[1][:256] for e in encoded]
    dataset = work / "dataset"
    write_training_dataset(ids, masks, dataset)
    verifier = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    for row, row_ids in enumerate(ids):
        write_sample(dataset / "hidden_states", row, capture_hidden_states(verifier, row_ids, AUX), torch.tensor(row_ids))
    subprocess.run([sys.executable, "-m", "eagleflow", "build-vocab", "--dataset", str(dataset), "--verifier", str(model),
                    "--draft-vocab-size", str(DRAFT_VOCAB)], check=True, capture_output=True, cwd=REPO)
    return model, dataset


def speculators_argv(model: Path, dataset: Path, out: Path) -> list[str]:
    """The speculators flags ``eagleflow train`` passes for this run (built by the same function)."""
    from eagleflow.layout import TrainLayout
    from eagleflow.train.child import Device, speculators_flags
    from eagleflow.train.config import TrainConfig
    from eagleflow.train.speculators_support import installed_release

    cfg = TrainConfig(dataset=dataset, verifier=model, out=out, aux_layer_ids=AUX, epochs=1, total_seq_len=256,
                      num_workers=0, draft_vocab_size=DRAFT_VOCAB, device="cpu", noise_std=0.0)
    return speculators_flags(cfg, model.absolute(), Device("cpu", 0), TrainLayout(out), installed_release())


def timed(argv: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds


def measure(work: Path) -> list[Row]:
    model, dataset = demo_data(work)
    pairs = []
    for pair in range(PAIRS):
        ours_out, direct_out = work / f"eagleflow-{pair}", work / f"direct-{pair}"
        ours = timed([sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(model),
                      "--out", str(ours_out), "--aux-layer-ids", ",".join(map(str, AUX)), *FAST])
        direct = timed([sys.executable, "-c", _DIRECT, *speculators_argv(model, dataset, direct_out)])
        pairs.append((ours, direct))
        print(f"training pair {pair + 1}/{PAIRS}: eagleflow train {ours:.1f}s, speculators directly {direct:.1f}s "
              f"({ours / direct - 1:+.1%})", flush=True)
    ours, direct = min(o for o, _ in pairs), min(d for _, d in pairs)
    overhead = ours / direct - 1
    return [Row("training: eagleflow train vs speculators directly (1 epoch, demo data)",
                f"{ours:.1f} s vs {direct:.1f} s = {overhead:+.1%}", f"<= +{GOAL_OVERHEAD:.0%}", overhead <= GOAL_OVERHEAD,
                f"least of {PAIRS} runs each, alternating; pairs: {', '.join(f'{o:.1f}/{d:.1f} s' for o, d in pairs)}")]


if __name__ == "__main__":
    sys.exit(run_alone(measure, "bench-training"))
