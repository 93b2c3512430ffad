"""Benchmark: bf16 vs fp8 hidden states, bytes per token on disk and what the drafter learns from each.

The goal (issue 13): fp8 files take at most 0.55× the bf16 bytes per token, and the drafter
trained on them learns about as well. On the demo's inputs (the trained tiny verifier, 120
synthetic conversations, cached under .cache/demo):

1. prepare the dataset, capture every row's hidden states once (the reference engine's capture,
   bf16), and store them twice through the sample format's own encoder: bf16 and fp8;
2. print bytes per token on disk for each against the bf16 minimum (slots × hidden × 2 B);
3. train the demo drafter on each (``python -m eagleflow train``, the demo's Params, the same
   seed) and print the validation step-0 accuracy of every epoch side by side.

Run: ``.venv/bin/python benchmarks/bench_hidden_states_dtype.py`` (about 5 minutes on 2 cores).
Not a timed test; exits 1 when fp8 misses the bytes goal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CACHE = REPO / ".cache" / "bench-hidden-states"
DTYPES = ("bf16", "fp8")
GOAL_RATIO = 0.55


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def build_datasets(model: Path, conversations: Path, aux: list[int], max_len: int) -> dict[str, Path]:
    """The prepared dataset once, then its hidden states stored in each dtype (cached)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from eagleflow.data.prepare import PrepareConfig, prepare_dataset
    from eagleflow.engine.capture import capture_hidden_states
    from eagleflow.extract.sample_store import write_sample

    prepared = CACHE / "prepared"
    prepare_dataset(PrepareConfig(input=conversations, verifier=model, out=prepared, max_len=max_len))
    rows = datasets.load_from_disk(str(prepared)).with_format(None)["input_ids"]
    out = {dtype: CACHE / dtype / "dataset" for dtype in DTYPES}
    if all((path.parent / "done").exists() for path in out.values()):
        return out
    for path in out.values():
        shutil.rmtree(path.parent, ignore_errors=True)
        shutil.copytree(prepared, path)
    verifier = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    started = time.monotonic()
    for row, ids in enumerate(rows):
        states = capture_hidden_states(verifier, ids, aux)  # once; each dtype encodes the same states
        for dtype, path in out.items():
            write_sample(path / "hidden_states", row, states, torch.tensor(ids), dtype)
    for path in out.values():
        (path.parent / "done").write_text("ok\n")
    say(f"{len(rows)} rows captured and stored as {' and '.join(DTYPES)} in {time.monotonic() - started:.0f}s")
    return out


def bytes_table(datasets_by_dtype: dict[str, Path], n_slots: int, hidden: int) -> dict[str, float]:
    """Print bytes per token on disk against the bf16 minimum; return each dtype's ratio to bf16."""
    import json

    tokens = json.loads((next(iter(datasets_by_dtype.values())) / "prepare.json").read_text())["tokens"]
    minimum = n_slots * hidden * 2
    per_token = {
        dtype: sum(p.stat().st_size for p in (path / "hidden_states").glob("hs_*.safetensors")) / tokens
        for dtype, path in datasets_by_dtype.items()
    }
    print(f"\nhidden states on disk: {tokens:,} tokens, {n_slots} slots × hidden {hidden}; "
          f"bf16 minimum {n_slots} × {hidden} × 2 B = {minimum} B per token", flush=True)
    print(f"{'storage':8s} {'bytes/token':>12s} {'× bf16 minimum':>15s} {'× bf16 files':>13s}", flush=True)
    for dtype, size in per_token.items():
        print(f"{dtype:8s} {size:12.1f} {size / minimum:15.3f} {size / per_token['bf16']:13.3f}", flush=True)
    return {dtype: size / per_token["bf16"] for dtype, size in per_token.items()}


def train(dataset: Path, model: Path, aux: list[int], epochs: int) -> Path:
    """The demo drafter on ``dataset`` from scratch (seed 42, the demo's training Params)."""
    from eagleflow.demo import DEMO_PARAMS
    from eagleflow.train.config import TrainConfig

    out = dataset.parent / "train"
    knobs = {k: v for k, v in DEMO_PARAMS.items() if k in TrainConfig.model_fields}
    knobs["epochs"] = epochs
    argv = [sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(model),
            "--out", str(out), "--aux-layer-ids", ",".join(map(str, aux)), "--restart"]
    for name, value in knobs.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"training on {dataset} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    say(f"trained on {dataset.parent.name} in {time.monotonic() - started:.0f}s")
    return out / "metrics.jsonl"


def accuracy_table(metrics: dict[str, Path]) -> None:
    from eagleflow.metrics.records import read_records

    val = {dtype: [r for r in read_records(path) if r["kind"] == "val"] for dtype, path in metrics.items()}
    print("\nvalidation step-0 accuracy (full_acc_0), same seed and Params:", flush=True)
    print(f"{'epoch':>5s} " + " ".join(f"{d:>7s}" for d in DTYPES), flush=True)
    for epoch in range(max(len(v) for v in val.values())):
        cells = [f"{v[epoch]['full_acc_0']:7.3f}" if epoch < len(v) else f"{'-':>7s}" for v in val.values()]
        print(f"{epoch + 1:5d} " + " ".join(cells), flush=True)


def main() -> int:
    from eagleflow.demo import DEMO_PARAMS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=int(DEMO_PARAMS["epochs"]), help="training epochs per dtype")
    args = parser.parse_args()

    from eagleflow.verifier.config import config_int, resolve_aux_layer_ids
    from eagleflow.demo import make_demo_inputs

    paths = make_demo_inputs(REPO / ".cache" / "demo")
    model = Path(paths["model_path"])
    aux = resolve_aux_layer_ids(model, None)
    datasets_by_dtype = build_datasets(model, Path(paths["dataset_input"]), aux, int(DEMO_PARAMS["max_len"]))
    ratios = bytes_table(datasets_by_dtype, len(aux) + 1, config_int(model, "hidden_size"))
    metrics = {dtype: train(path, model, aux, args.epochs) for dtype, path in datasets_by_dtype.items()}
    accuracy_table(metrics)
    ok = ratios["fp8"] <= GOAL_RATIO
    print(f"\nfp8 / bf16 bytes per token: {ratios['fp8']:.3f} (goal <= {GOAL_RATIO}): {'met' if ok else 'MISSED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
