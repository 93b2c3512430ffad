"""The CPU demo: a tiny verifier, a synthetic dataset, and Params sized for 2 cores.

``make demo`` and ``make airflow`` both use this, so the form's defaults and the scripted run
are the same run: 120 conversations in 3 shards of 40, the reference engine with a short
simulated warmup, and a drafter small enough to train in a couple of minutes on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_patch.sample_format import HiddenStatesDtype

DEMO_ROWS = 120
DEMO_RUN_NAME = "demo"  # make demo's folder; runs from the form get one each, named by run id

# Overrides of the seed's GPU-sized defaults; everything else keeps its PipelineConfig /
# TrainConfig default.
DEMO_PARAMS: dict[str, Any] = {
    "engine": "reference",
    "shard_size": 40,
    "max_len": 512,
    "concurrency": 4,
    "server_port": 0,
    "tp_size": 1,  # one CPU process, not the 8-GPU node's default
    # One torch thread per engine: with torch's default (one per core) a lone request on a busy 2-core
    # machine ran ~25x slower than with one thread (OpenMP threads waiting on each other), which made
    # single-stream speedups meaningless (the 9x beside an accept length of 1.6 of issue 23).
    "server_extra_args": ["--warmup-seconds", "10", "--threads", "1"],
    "eval_server_extra_args": ["--warmup-seconds", "10", "--threads", "1"],
    "warmup_timeout": 300.0,
    "epochs": 4,
    # The seed's lr 3e-5 suits 10K rows on GPUs; 120 rows need a larger step to show learning
    # (step-0 accuracy 0.09 -> 0.52 over 4 epochs here, vs 0.01 -> 0.02 at 3e-5).
    "lr": 3e-3,
    "total_seq_len": 512,
    "num_workers": 0,
    "draft_vocab_size": 512,
    "device": "cpu",
    # A small sweep that fits the demo's 10 minutes on 2 cores (the full one: eval_configs): the
    # drafter's chain one at a time and 2 in flight, a tree of 8 one at a time, on two prompt sets.
    "eval_sets": ["heldout", "humaneval"],
    "eval_rows": 4,
    "eval_max_new_tokens": 32,
    "eval_concurrency": 2,
    "eval_configs": "1,3,1,4 2,3,1,4 1,3,4,8",
    # Rounds are cheap here (~7 s for the whole sweep); one round's ratio still moves by +-15 % on
    # this shared VM: with 7 rounds three demos' medians (0.84x, 0.90x, 0.84x) fell just outside
    # one another's min-max, 15 make the median steady well inside the spread the report states.
    "eval_rounds": 15,
}


# make demo with --draft-algorithm dflash: the same run with a DFlash block drafter, sized for 2 cores
# (speculators' recipe is 5 layers and blocks of 16 on GPUs). The tiny tokenizer has no <|MASK|> and
# its vocabulary is full, so SGLang could not add one: the mask token is <|pad|> (id 0), which no
# training row contains. Its sweep: the trained block one at a time and 2 in flight, a shorter block.
DEMO_DFLASH_PARAMS: dict[str, Any] = {
    "draft_algorithm": "dflash",
    "draft_vocab_size": None,  # the full vocabulary (the EAGLE-3 demo's 512 would be refused)
    "num_layers": 2,
    "block_size": 8,
    "mask_token_id": 0,
    "max_anchors": 128,
    # A block drafter learns slower than EAGLE-3's first step here (its context reaches the block only through
    # attention): 20 epochs of ~3 s each.
    "epochs": 20,
    "eval_configs": "1,1,1,8 2,1,1,8 1,1,1,4",
}


# scripts/demo.py --draft-algorithm dspark: the same run with a DSpark drafter, sized as the DFlash one. Its block drafts 7
# tokens (the DSpark paper's blocks; the anchor slot drafts too), so 8 are verified a round, as the DFlash demo's block of 8
# verifies; a Markov head of rank 64 (speculators' 256 on GPUs). Its sweep: the trained window one at a time and 2 in
# flight, a shorter block (4 drafts).
DEMO_DSPARK_PARAMS: dict[str, Any] = {
    **{k: v for k, v in DEMO_DFLASH_PARAMS.items() if k not in ("block_size", "eval_configs")},
    "draft_algorithm": "dspark",
    "block_size": 7,
    "markov_rank": 64,
    "eval_configs": "1,1,1,8 2,1,1,8 1,1,1,5",
}


# scripts/demo.py --compare: the EAGLE-3 of DEMO_PARAMS, the DFlash of DEMO_DFLASH_PARAMS and the DSpark of
# DEMO_DSPARK_PARAMS from one capture, measured side by side (each block drafter verifying 8 tokens at the same batch
# sizes as the EAGLE-3's chain: 1 and 2 in flight).
DEMO_COMPARE_DRAFTERS: list[Any] = [
    "eagle3",
    *({"name": params["draft_algorithm"], **{k: v for k, v in params.items() if k not in ("draft_vocab_size", "eval_configs")},
       "eval_configs": "1,1,1,8 2,1,1,8"} for params in (DEMO_DFLASH_PARAMS, DEMO_DSPARK_PARAMS)),
]


# scripts/demo.py --thinking: the verifier served as a thinking, tool-calling model (the tiny tokenizer's
# Qwen3/Kimi-like template), its conversations with thinking and tool calls, and thinking on.
DEMO_THINKING_PARAMS: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}


def make_thinking_inputs(demo_dir: str | Path) -> dict[str, str]:
    """The thinking variant's verifier folder (the tiny verifier with the thinking template) and conversations
    (the demo's, each answer after its thinking, every fourth row's first one found by a tool), built from the
    demo's inputs (:func:`make_demo_inputs`) when missing."""
    from eagleflow.demo.synthetic_data import thinking_conversation
    from eagleflow.demo.tiny_tokenizer import THINKING_CHAT_TEMPLATE, with_chat_template
    from eagleflow.files import atomic_write_text

    plain = make_demo_inputs(demo_dir)
    demo = Path(demo_dir).absolute()
    model, data = demo / "tiny-model-thinking", demo / "conversations-thinking.jsonl"
    with_chat_template(Path(plain["model_path"]), model, THINKING_CHAT_TEMPLATE)
    if not data.exists():
        rows = [json.loads(line) for line in Path(plain["dataset_input"]).read_text().splitlines() if line.strip()]
        atomic_write_text(data, "".join(json.dumps(thinking_conversation(r, i)) + "\n" for i, r in enumerate(rows)))
    return {**plain, "model_path": str(model), "dataset_input": str(data)}


def demo_paths(demo_dir: str | Path) -> dict[str, str]:
    """Where the demo's inputs and runs live under ``demo_dir``."""
    demo_dir = Path(demo_dir).absolute()
    return {
        "model_path": str(demo_dir / "tiny-model"),
        "dataset_input": str(demo_dir / "conversations.jsonl"),
        "output_root": str(demo_dir / "runs"),
    }


def demo_params(demo_dir: str | Path) -> dict[str, Any]:
    """The demo's full Params: its paths plus :data:`DEMO_PARAMS` (builds nothing)."""
    return {**demo_paths(demo_dir), **DEMO_PARAMS}


def form_params(demo_dir: str | Path) -> dict[str, Any]:
    """The trigger form's defaults where the demo is set up (``make airflow``): ``make demo``'s run, an EAGLE-3 and
    a DFlash compared from one capture (:data:`DEMO_COMPARE_DRAFTERS`)."""
    return {**demo_params(demo_dir), "drafters": DEMO_COMPARE_DRAFTERS}


def make_demo_inputs(demo_dir: str | Path) -> dict[str, str]:
    """Build the trained tiny verifier and the conversations if they are missing (both cached)."""
    from eagleflow.demo.synthetic_data import DatasetConfig, make_dataset
    from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model

    paths = demo_paths(demo_dir)
    make_tiny_model(TinyModelConfig(out=Path(paths["model_path"])))
    if not Path(paths["dataset_input"]).exists():
        make_dataset(DatasetConfig(verifier=Path(paths["model_path"]), out=Path(paths["dataset_input"]), rows=DEMO_ROWS))
    return paths


def run_summary(
    run_dir: str | Path, model_path: str | Path, aux_layer_ids: list[int], hidden_states_dtype: HiddenStatesDtype = "bf16"
) -> dict[str, Any]:
    """What a finished run produced: the run report (capture check included), every row's file validated, tokens,
    step-0 accuracy."""
    from eagleflow.data import MARKER_FILE
    from eagleflow.verifier import config_int
    from eagleflow.extract import validate_dataset
    from eagleflow.layout import RunLayout
    from eagleflow.metrics import read_metrics
    from eagleflow.report import run_summary as report

    layout = RunLayout(Path(run_dir))
    facts = report(layout)
    summary: dict[str, Any] = {
        "run": str(layout.root),
        "dataset": str(layout.dataset),
        "rows": facts["totals"]["rows_complete"],
        "shards": [s["name"] for s in facts["shards"]],
        "hidden_state_bytes": sum(p.stat().st_size for p in layout.hidden_states.glob("hs_*.safetensors")),
        "checkpoint": facts["checkpoint"],
        "regeneration": facts["regeneration"],
        "capture_checks": facts["capture_checks"],
        "evaluation": facts["evaluation"],
        "comparison": facts.get("comparison"),
        "online": facts["online"],
        "charts": sorted(str(p) for p in layout.charts.glob("*.*")),
    }
    if layout.hidden_states.exists():
        hidden = config_int(model_path, "hidden_size")
        problems = validate_dataset(layout.dataset, len(aux_layer_ids) + 1, hidden, hidden_states_dtype)
        summary["invalid_rows"] = problems[:20]
        summary["validated_rows"] = summary["rows"] - len(problems)
    prepared = layout.dataset / MARKER_FILE
    if prepared.exists():
        record = json.loads(prepared.read_text())
        summary["tokens"], summary["prepared_from"] = record["tokens"], record["input"]
    if layout.train.metrics.exists():
        frame = read_metrics(layout.train.metrics)
        train = frame[frame["kind"] == "train"]
        # EAGLE-3: the first draft step's accuracy; a block drafter: every block position's (full_acc).
        accuracy = "full_acc_0" if "full_acc_0" in train else "full_acc"
        if accuracy in train and len(train):
            window = max(1, len(train) // 10)
            summary["accuracy_metric"] = accuracy
            summary["step0_acc_first"] = round(float(train[accuracy].head(window).mean()), 4)
            summary["step0_acc_last"] = round(float(train[accuracy].tail(window).mean()), 4)
    return summary
